"""Training step time on CPU: our executor against PyTorch 1.13.

For each configuration (zoo model, size, thread count) it starts two workers
that hold the model in memory, bench/step_worker.cc (ours: the single-device
program on the rank-program interpreter) and bench/torch_step.py (PyTorch,
the mirrors of tests/torch_models.py), with the same model, global batch,
SGD with momentum and thread count (OMP/OpenBLAS/MKL thread variables set to
it for both, and OMP_WAIT_POLICY=passive: see thread_env). After 2 warm-up steps each, it interleaves them: a round is
`--steps` steps of one then of the other, the order alternating between
rounds. Each round gives the ratio of the median step times, ours / torch;
the table reports the median step time of each over all rounds and the
median of the round ratios (min-max alongside: their spread is the noise of
this shared machine). The target is ours <= 1.2x torch.

    bazel run -c opt //bench:step_bench -- [--quick] [--breakdown]
    # or, with the worker built:
    /usr/bin/python3 bench/step_bench.py --worker PATH/TO/step_worker

--precision bf16: bf16 mixed precision on both sides (ours: the plan option,
oneDNN's bf16 GEMMs; PyTorch: CPU autocast). Each configuration is then
measured twice, each pair interleaved as above: ours bf16 against PyTorch
autocast bf16 (target <= 1.0x), and ours bf16 against ours fp32 (target
< 1.0x: bf16 faster than our fp32).

--breakdown: after the table, each configuration's time per step by kernel
(ours) and the PyTorch profiler's per-operator table, from separate runs
(the timed rounds run without instrumentation).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (model, label, zoo parameters). The global batch is the zoo's `batch`.
CONFIGS = [
    ("mlp", "4 x 1024, batch 256",
     dict(layers=4, hidden=1024, input=1024, classes=10, batch=256)),
    ("gpt", "2 layers, h 256, seq 64, batch 8",
     dict(layers=2, hidden=256, heads=4, ffn=1024, seq=64, vocab=18328,
          batch=8)),
    ("vit", "2 layers, h 256, 65 tokens, batch 16",
     dict(layers=2, hidden=256, heads=4, ffn=1024, image=32, patch=4,
          classes=10, batch=16)),
    ("mlp", "4 x 2048, batch 512",
     dict(layers=4, hidden=2048, input=2048, classes=10, batch=512)),
    ("gpt", "4 layers, h 512, seq 128, batch 8",
     dict(layers=4, hidden=512, heads=8, ffn=2048, seq=128, vocab=18328,
          batch=8)),
]
QUICK = 3  # --quick: the first configurations only


def thread_env(threads, omp_wait):
    """The environment with every thread-count variable set to `threads`.

    Debian's torch runs its own loops on libgomp threads and its matrix
    products on OpenBLAS's pthreads. With libgomp's default (active) waiting,
    the two pools spin against each other on 2 cores and torch at 2 threads is
    2-3x slower than at 1; OMP_WAIT_POLICY=passive removes that, so it is the
    default here (it changes nothing for our side, which uses no OpenMP)."""
    env = dict(os.environ)
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[v] = str(threads)
    env["OMP_WAIT_POLICY"] = omp_wait
    return env


class Worker:
    """A worker process in --serve mode: one line with a step count in, one
    JSON line with the steps' seconds and losses out."""

    def __init__(self, name, cmd, env):
        self.name = name
        self.proc = subprocess.Popen(cmd + ["--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env=env)

    def run(self, steps):
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            err = self.proc.stderr.read()
            sys.exit(f"step_bench: the {self.name} worker stopped:\n{err}")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def worker_args(model, params, threads):
    args = ["--model", model, "--threads", str(threads)]
    for k, v in params.items():
        args += [f"--{k}", str(v)]
    return args


def measure(cmds, env, rounds, steps, pause):
    """Interleaved rounds; returns per side the step times, the first
    warm-up loss, and the per-round ratios ours / torch."""
    workers = [Worker(n, c, env) for n, c in cmds]
    first_loss = [w.run(2)["losses"][0] for w in workers]  # warm-up
    times = [[], []]
    ratios = []
    for r in range(rounds):
        medians = [0.0, 0.0]
        for i in ([0, 1] if r % 2 == 0 else [1, 0]):
            time.sleep(pause)  # let the other side's BLAS threads go idle
            s = workers[i].run(steps)["seconds"]
            times[i] += s
            medians[i] = statistics.median(s)
        ratios.append(medians[0] / medians[1])
    for w in workers:
        w.close()
    return times, first_loss, ratios


def breakdown(cmds, env, steps):
    for name, cmd in cmds:
        p = subprocess.run(cmd + ["--steps", str(steps), "--breakdown"],
                           capture_output=True, text=True, env=env)
        if p.returncode:
            sys.exit(f"step_bench: {name} --breakdown failed:\n{p.stderr}")
        print(f"\n{name}:\n")
        print("\n".join(p.stdout.splitlines()[1:]))  # after the JSON line


def bf16_tables(a, configs, rounds, threads, worker, torch_worker):
    """--precision bf16: ours bf16 / torch autocast bf16 and ours bf16 /
    ours fp32, each pair interleaved."""
    print("| model | size | threads | ours bf16 ms | torch bf16 ms | ours fp32 ms | "
          "bf16 ours / torch | <= 1.0x | ours bf16 / fp32 | < 1.0x | "
          "first loss ours / torch (bf16) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model, label, params in configs:
        for t in threads:
            args = worker_args(model, params, t)
            bf = ["--precision", "bf16"]
            env = thread_env(t, a.omp_wait)
            vs_torch = [("ours bf16", [worker] + args + bf),
                        ("torch bf16", [sys.executable, torch_worker] + args + bf)]
            vs_fp32 = [("ours bf16", [worker] + args + bf), ("ours fp32", [worker] + args)]
            times, loss, ratios = measure(vs_torch, env, rounds, a.steps, a.pause)
            times2, _, ratios2 = measure(vs_fp32, env, rounds, a.steps, a.pause)
            r1, r2 = statistics.median(ratios), statistics.median(ratios2)
            print(f"| {model} | {label} | {t} | "
                  f"{1e3 * statistics.median(times[0]):.1f} | "
                  f"{1e3 * statistics.median(times[1]):.1f} | "
                  f"{1e3 * statistics.median(times2[1]):.1f} | "
                  f"{r1:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
                  f"{'yes' if r1 <= 1.0 else 'NO'} | "
                  f"{r2:.2f}x ({min(ratios2):.2f}-{max(ratios2):.2f}) | "
                  f"{'yes' if r2 < 1.0 else 'NO'} | "
                  f"{loss[0]:.3f} / {loss[1]:.3f} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", default=os.path.join(
        HERE, "..", "bazel-bin", "bench", "step_worker"),
        help="the step_worker binary (bazel build -c opt //bench:step_worker)")
    ap.add_argument("--torch-worker", default=os.path.join(HERE, "torch_step.py"))
    ap.add_argument("--quick", action="store_true",
                    help=f"the first {QUICK} configurations, 3 rounds")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=2, help="steps per round")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--models", default="", help="e.g. mlp,gpt (default: all)")
    ap.add_argument("--pause", type=float, default=0.3,
                    help="seconds between the two sides' blocks")
    ap.add_argument("--omp-wait", default="passive", choices=["passive", "active"],
                    help="OMP_WAIT_POLICY for both workers (see thread_env)")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    a = ap.parse_args()
    configs = CONFIGS[:QUICK] if a.quick else CONFIGS
    if a.models:
        configs = [c for c in configs if c[0] in a.models.split(",")]
        if not configs:
            ap.error(f"--models: no configuration of {a.models}"
                     f"{' in the --quick set' if a.quick else ''} "
                     f"(models: {', '.join(sorted({c[0] for c in CONFIGS}))})")
    rounds = 3 if a.quick else a.rounds
    if rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.steps < 1:
        ap.error("--steps must be at least 1")
    if a.pause < 0:
        ap.error("--pause must not be negative")
    try:
        threads = [int(t) for t in a.threads.split(",")]
    except ValueError:
        threads = []
    if not threads or min(threads) < 1:
        ap.error(f"--threads needs positive integers, e.g. 1,2; got '{a.threads}'")
    worker = os.path.abspath(a.worker)
    torch_worker = os.path.abspath(a.torch_worker)
    if not os.access(worker, os.X_OK):
        ap.error(f"no step_worker at {worker} (bazel build -c opt //bench:step_worker, "
                 "or --worker)")

    print(f"{rounds} rounds of {a.steps} steps per side, interleaved; "
          "step times are medians over all rounds; ratio = median over rounds "
          "of (median ours / median torch), min-max in brackets; "
          f"OMP_WAIT_POLICY={a.omp_wait}.\n")
    if a.precision == "bf16":
        bf16_tables(a, configs, rounds, threads, worker, torch_worker)
        return
    print("| model | size | threads | ours ms/step | torch ms/step | "
          "ours / torch | <= 1.2x | first loss ours / torch |")
    print("|---|---|---|---|---|---|---|---|")
    todo = []
    for model, label, params in configs:
        for t in threads:
            args = worker_args(model, params, t)
            cmds = [("ours", [worker] + args),
                    ("torch", [sys.executable, torch_worker] + args)]
            env = thread_env(t, a.omp_wait)
            times, loss, ratios = measure(cmds, env, rounds, a.steps, a.pause)
            ratio = statistics.median(ratios)
            print(f"| {model} | {label} | {t} | "
                  f"{1e3 * statistics.median(times[0]):.1f} | "
                  f"{1e3 * statistics.median(times[1]):.1f} | "
                  f"{ratio:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
                  f"{'yes' if ratio <= 1.2 else 'NO'} | "
                  f"{loss[0]:.3f} / {loss[1]:.3f} |", flush=True)
            todo.append((f"{model} {label}, {t} thread(s)", cmds, env))
    if a.breakdown:
        for title, cmds, env in todo:
            print(f"\n### {title}")
            breakdown(cmds, env, a.steps * 2)


if __name__ == "__main__":
    main()
