"""One rank of PyTorch DistributedDataParallel for bench/e2e/e2e_bench.py.

The zoo's GPT-style LM (tests/torch_models.py ZooGpt, dropout on) trained
with DDP over the gloo backend on 127.0.0.1. Before torch is imported (so
every thread torch and gloo start inherits both), the process moves itself
into its cgroup (cgroup v1 cpu, made by the driver) and pins itself to its
core: the same throttled device hap-launch gives our executor.

    /usr/bin/python3 bench/e2e/ddp_worker.py --rank R --world N --port P \
        --batches B0,B1 [--cgroup DIR] [--core C] --steps K --warmup W \
        --layers 2 --hidden 64 --heads 4 --ffn 256 --seq 32 --vocab 18328

--batches is each rank's share of the global batch (sequences); the loss of
rank r is scaled by B_r * N / sum(B) so that DDP's average of the gradients
is the gradient of the global mean loss, whatever the split. The optimizer is
Adam (lr --lr) with global-norm clipping (--clip), as in the HAP plans.

A step is forward, backward (with DDP's bucketed all-reduce), clipping,
optimizer.step() and zero_grad(set_to_none=True); the token batches are made
before the timed steps. Rank 0 prints `step I loss L time T s` per step, the
format hap-executor prints, for the warm-up steps too (the driver drops
them).
"""

import argparse
import os
import sys


def parse():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--batches", required=True,
                    help="per-rank batch sizes, comma separated")
    ap.add_argument("--cgroup", default="", help="cgroup v1 directory to join")
    ap.add_argument("--core", type=int, default=-1, help="core to pin to")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120)
    for k, d in (("layers", 2), ("hidden", 64), ("heads", 4), ("ffn", 256),
                 ("seq", 32), ("vocab", 18328)):
        ap.add_argument(f"--{k}", type=int, default=d)
    a = ap.parse_args()
    a.batches = [int(b) for b in a.batches.split(",")]
    if len(a.batches) != a.world or min(a.batches) < 1:
        ap.error(f"--batches needs {a.world} positive sizes, got {a.batches}")
    return a


def confine(cgroup, core):
    """Joins the cgroup (all of this process's threads) and pins the calling
    thread, whose mask the threads started later inherit."""
    if cgroup:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    if core >= 0:
        os.sched_setaffinity(0, {core})


def main():
    a = parse()
    confine(a.cgroup, a.core)

    import datetime
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "tests"))
    import torch_models as M  # noqa: E402

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}",
                            rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=a.timeout))
    torch.manual_seed(a.seed)  # the same initial parameters on every rank
    model = M.ZooGpt(layers=a.layers, hidden=a.hidden, heads=a.heads,
                     ffn=a.ffn, seq=a.seq, vocab=a.vocab)
    model.train()
    # The causal masks are constant bool buffers that gloo cannot broadcast
    # (and every rank builds alike): DDP leaves them alone.
    DDP._set_params_and_buffers_to_ignore_for_model(
        model, [n for n, b in model.named_buffers() if b.dtype == torch.bool])
    ddp = DDP(model, broadcast_buffers=False)
    opt = torch.optim.Adam(ddp.parameters(), lr=a.lr)
    local = a.batches[a.rank]
    scale = local * a.world / sum(a.batches)

    gen = torch.Generator().manual_seed(a.seed + 1000 * a.rank)
    total = a.warmup + a.steps
    batches = [(torch.randint(0, a.vocab, (local, a.seq), generator=gen),
                torch.randint(0, a.vocab, (local * a.seq,), generator=gen))
               for _ in range(total)]
    torch.manual_seed(a.seed + a.rank)  # dropout masks differ per rank
    dist.barrier()
    for i, (tokens, labels) in enumerate(batches):
        t0 = time.perf_counter()
        loss = ddp(tokens, labels)
        (loss * scale).backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        if a.rank == 0:
            print(f"step {i} loss {loss.item():.6f} time {seconds:.4f} s",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
