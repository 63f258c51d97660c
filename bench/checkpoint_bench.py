#!/usr/bin/env python3
"""Checkpoint save and restore of the paper-size GPT (113M parameters with
Adam state, 1.36 GB) against two baselines, in interleaved rounds:

  plain       one sequential write (new file, fsync) / read of the same bytes
  torch       torch.save / torch.load of the same state dict (same names and
              shapes), file fsynced; PyTorch 1.13 from /usr/bin/python3

Ours (bench/checkpoint_worker): save from 2 and 4 ranks (ZeRO-sharded, each
rank writes its own slices, commit protocol included), restore onto the
other world size (4 -> 2, 2 -> 4: resharding). Reads start with the files'
page cache dropped (posix_fadvise DONTNEED) for every contender.

  bazel build -c opt //bench:checkpoint_worker
  /usr/bin/python3 bench/checkpoint_bench.py [--rounds 3] [--dir PARENT]

The files (about 5.5 GB) go to a fresh folder hap-ckpt-bench.* under PARENT
(default: the system's temporary folder), removed at the end, on failure and
on Ctrl-C; what PARENT already holds is left alone. Prints a table of medians
and the ratios the issue asks for.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "bazel-bin", "bench", "checkpoint_worker")
HAPCTL = os.path.join(ROOT, "bazel-bin", "tools", "hapctl")


def worker(*args):
    try:
        p = subprocess.run([WORKER, *args], capture_output=True, text=True)
    except OSError as e:
        sys.exit(f"checkpoint_bench: cannot run {WORKER} ({e.strerror}); "
                 "bazel build -c opt //bench:checkpoint_worker")
    if p.returncode:
        sys.exit(f"checkpoint_bench: checkpoint_worker {' '.join(args)} failed "
                 f"(exit {p.returncode}):\n{p.stderr.strip()}")
    return json.loads(p.stdout.strip().splitlines()[-1])["seconds"]


def drop(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def state_dict_like(ckpt):
    """Tensors of the checkpoint's names and shapes (filled)."""
    info = json.loads(subprocess.run([HAPCTL, "checkpoint", "inspect", ckpt, "-o", "json"],
                                     capture_output=True, text=True, check=True).stdout)
    sd = {}
    for t in info["index"]["tensors"]:
        shape = [int(d) for d in t.get("shape", [])]
        # Values that differ from page to page (pages of one constant can
        # be merged by the host and then read from cache: not a real state).
        n = 1
        for d in shape:
            n *= d
        sd[t["name"]] = ((torch.arange(n, dtype=torch.int64) % 977).float() * 1e-3).reshape(shape)
    return sd


def torch_save(sd, path):
    if os.path.exists(path):
        os.remove(path)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def torch_load(path):
    drop(path)
    t0 = time.perf_counter()
    sd = torch.load(path)
    s = time.perf_counter() - t0
    del sd
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None,
                    help="where the fresh scratch folder is made [the system's temp folder]")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.dir is not None:
        os.makedirs(a.dir, exist_ok=True)
    # A folder of its own: --dir may hold anything, and is never emptied.
    scratch = tempfile.mkdtemp(prefix="hap-ckpt-bench.", dir=a.dir)
    try:
        bench(a, scratch)
    except KeyboardInterrupt:
        sys.exit("checkpoint_bench: interrupted")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def bench(a, scratch):
    c2, c4 = os.path.join(scratch, "c2"), os.path.join(scratch, "c4")
    plain, tfile = os.path.join(scratch, "plain.bin"), os.path.join(scratch, "torch.pt")
    worker("save", "--ranks", "2", "--dir", c2)  # warm-up, and the names for torch
    sd = state_dict_like(c2)
    nbytes = sum(t.numel() * 4 for t in sd.values())
    times = {k: [] for k in ["plain write", "ours save 2 ranks", "ours save 4 ranks",
                             "torch.save", "plain read", "ours restore 2->4",
                             "ours restore 4->2", "torch.load"]}
    writes = [("plain write", lambda: worker("plain-write", "--bytes", str(nbytes), "--file", plain)),
              ("ours save 2 ranks", lambda: worker("save", "--ranks", "2", "--dir", c2)),
              ("torch.save", lambda: torch_save(sd, tfile)),
              ("ours save 4 ranks", lambda: worker("save", "--ranks", "4", "--dir", c4))]
    reads = [("plain read", lambda: worker("plain-read", "--file", plain)),
             ("ours restore 2->4", lambda: worker("restore", "--ranks", "4", "--dir", c2)),
             ("torch.load", lambda: torch_load(tfile)),
             ("ours restore 4->2", lambda: worker("restore", "--ranks", "2", "--dir", c4))]
    for r in range(a.rounds):
        for d in (c2, c4):
            shutil.rmtree(d, ignore_errors=True)
        # Each contender starts with nothing dirty in the page cache (the
        # one before it flushed), and the order rotates every round.
        for ops in (writes, reads):
            for name, op in ops[r % len(ops):] + ops[:r % len(ops)]:
                os.sync()
                time.sleep(0.5)
                times[name].append(op())
        print(f"round {r + 1}/{a.rounds}: " +
              ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{nbytes / 1e9:.2f} GB of parameters and Adam state, {a.rounds} interleaved rounds, "
          "median seconds:")
    for k, v in med.items():
        print(f"  {k:<20} {v:7.2f} s  ({nbytes / v / 1e9:.2f} GB/s)")
    print("\nratios (target: save <= 1.5x plain write and < torch.save; restore <= 2x plain read):")
    for n in ("2", "4"):
        s = med[f"ours save {n} ranks"]
        print(f"  save {n} ranks: {s / med['plain write']:.2f}x plain write, "
              f"{med['torch.save'] / s:.2f}x faster than torch.save")
    for k in ("ours restore 2->4", "ours restore 4->2"):
        print(f"  {k[5:]}: {med[k] / med['plain read']:.2f}x plain read, "
              f"{med['torch.load'] / med[k]:.2f}x faster than torch.load")


if __name__ == "__main__":
    sys.exit(main())
