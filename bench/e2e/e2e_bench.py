"""End to end on a heterogeneous CPU cluster: the synthesized HAP plan against
data parallelism (ours) and PyTorch DDP, all in one run on the same throttled
ranks.

The cluster: rank i pinned to core i (mod cores) and given the fraction
--shares[i] of it through a cgroup v1 CPU quota (cpu.cfs_period_us = 20000,
cpu.cfs_quota_us = share x period). With the default 1,0.4 rank 0 has a
whole core and rank 1 40% of the other.

1. Measure: a planner (planner/service/hap-planner) on a free 127.0.0.1 port
   and, per rank, a profiler agent (profiler_agent/hap-agent) inside that
   rank's cgroup, pinned to its core. `hapctl get nodes -o json` gives the
   measured devices, written as a cluster JSON (the format of
   planner/examples/cpu-2rank.json; link figures are that file's, this
   machine's loopback). The planner and the agents are then stopped.
2. Plan offline from that file: `hapctl plan --cluster ... --save-plan` for
   hap (synthesized), dp-even and dp-prop, with Adam (--lr, clip 1).
3. Run, interleaved: each round runs every configuration once, the order
   rotating between rounds, so the machine's drift hits all alike:
     hap, dp-even, dp-prop  executor/cli/hap-launch --plan X.pb --cpu-shares S
                            --pin-cores (its own cgroups, the same quota);
     ddp-even, ddp-prop     bench/e2e/ddp_worker.py per rank (PyTorch DDP over
                            gloo, Debian's /usr/bin/python3), in this
                            script's cgroups, pinned; the global batch split
                            evenly or in proportion to the shares.
   Each run trains --warmup + --steps steps on synthetic token ids; rank 0's
   per-step times after the warm-up are kept. The table gives the median
   over all rounds, and the speed-up against DP-even and against the best
   proportional baseline (dp-prop or ddp-prop) as the ratio of those
   medians, with the range of the per-round ratios (each round's medians).

With --overlap (issue 16): the synthesized plan made with `hapctl plan
--overlap on` (its gradient buckets and ZeRO-3 gathers started early and run
behind compute on a communication thread with a second Gloo context), the
same plan run with `--overlap off` (every collective in line), DP-proportional
planned with overlap, and PyTorch DDP (which overlaps its bucketed all-reduce
with backward) at the overlapped plan's batch split; all in the same
interleaved rounds.

The ideal speed-up of a proportional split over the even one, compute bound,
is sum(shares) / (n x min(shares)) (1.75x for 1,0.4).

Everything it starts runs on 127.0.0.1 and is stopped by pid; every cgroup
it or hap-launch made is removed on exit and on Ctrl-C.

    bazel build -c opt //tools:hapctl //executor/cli:hap-launch \
        //executor/cli:hap-executor //planner/service:hap-planner \
        //profiler_agent:hap-agent
    python3 bench/e2e/e2e_bench.py [--shares 1,0.4] [--rounds 4] [--steps 10]

Needs root (cgroup v1 cpu controller at /sys/fs/cgroup/cpu) and Debian's
python3-torch.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKSPACE = os.path.abspath(os.path.join(HERE, "..", ".."))
CGROUP_ROOT = "/sys/fs/cgroup/cpu"
PERIOD_US = 20000  # as hap-launch: 20 ms keeps throttling fine-grained
CONFIGS = ["hap", "dp-even", "dp-prop", "ddp-even", "ddp-prop"]
# Diagnostics (--quota-profile): the same plans from the measured profile
# with each rank's FLOP/s replaced by the fastest measurement x its share.
QUOTA_CONFIGS = ["hap-q", "dp-prop-q"]
# With calibration (default; --no-calibrate skips it): the synthesized plan
# again, from the cluster calibrated on separate profiled runs.
# dp-split-cal: data parallelism at hap-cal's split, to tell the program's
# gain from the split's.
CALIBRATED_CONFIGS = ["hap-cal", "dp-split-cal"]
# With --overlap: hap-ov, its plan run in line (hap-ov-inline), DP-proportional
# planned with overlap, PyTorch DDP at hap-ov's split.
OVERLAP_CONFIGS = ["hap-ov", "hap-ov-inline", "dp-prop-ov", "ddp-split-ov"]
# Flags hap-launch passes to hap-executor for a configuration.
RUN_FLAGS = {"hap-ov-inline": ["--overlap", "off"]}
LABELS = {
    "hap": "HAP (synthesized plan)",
    "dp-even": "DP-even (ours)",
    "dp-prop": "DP-proportional (ours)",
    "ddp-even": "PyTorch DDP, even split",
    "ddp-prop": "PyTorch DDP, proportional split",
    "hap-q": "diagnostic: HAP, quota-scaled profile",
    "dp-prop-q": "diagnostic: DP-proportional, quota-scaled profile",
    "hap-cal": "HAP (synthesized from the calibrated cost model)",
    "dp-split-cal": "DP at the calibrated HAP's split (ours)",
    "hap-ov": "HAP with overlap (synthesized with --overlap on, run overlapped)",
    "hap-ov-inline": "the same plan run in line (--overlap off)",
    "dp-prop-ov": "DP-proportional with overlap (ours)",
    "ddp-split-ov": "PyTorch DDP at HAP-with-overlap's split",
}
STEP_RE = re.compile(r"^step (\d+) loss (\S+) time (\S+) s", re.M)


def log(msg):
    print(msg, flush=True)


def die(msg):
    raise SystemExit(f"e2e_bench: {msg}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_env():
    """One compute thread everywhere; passive OpenMP waiting (see
    bench/step_bench.py thread_env: active waiting spins on a shared core)."""
    env = dict(os.environ)
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[v] = "1"
    env["OMP_WAIT_POLICY"] = "passive"
    return env


class Cluster:
    """Owns what the run starts: processes (stopped by pid) and cgroups
    (removed), its own and those hap-launch makes."""

    def __init__(self, shares, state_dir, weight=0, period_us=PERIOD_US):
        # state_dir: the run's folder; None until the checks that may refuse
        # the run have passed (it is made then, and removed by run_guarded).
        self.shares = shares
        self.period_us = period_us
        self.weight = weight
        self.state = state_dir
        self.cores = os.cpu_count() or 1
        self.procs = []      # Popen objects still to stop
        self.groups = []     # cgroup directories this script made
        self.launch_pids = []  # hap-launch pids: their groups are theirs
        self.env = thread_env()

    # --- cgroups -------------------------------------------------------------
    def check_cgroups(self):
        probe = os.path.join(CGROUP_ROOT, f"hap-e2e-{os.getpid()}-probe")
        try:
            os.mkdir(probe)
            try:
                with open(os.path.join(probe, "cpu.cfs_period_us"), "w") as f:
                    f.write(str(self.period_us))
            finally:
                os.rmdir(probe)
        except OSError as e:
            die(f"cannot write cgroups under {CGROUP_ROOT} ({e}); this benchmark "
                "needs root and the cgroup v1 cpu controller to throttle the ranks")

    def make_groups(self):
        for r, share in enumerate(self.shares):
            g = os.path.join(CGROUP_ROOT, f"hap-e2e-{os.getpid()}-r{r}")
            os.mkdir(g)
            self.groups.append(g)
            with open(os.path.join(g, "cpu.cfs_period_us"), "w") as f:
                f.write(str(self.period_us))
            with open(os.path.join(g, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(int(share * self.period_us)))
            self.prioritize(g)

    def prioritize(self, group):
        """cpu.shares = --weight: against other work on the machine (tasks in
        the root group weigh 1024 each) the rank gets its whole share; the
        quota still caps it."""
        if self.weight:
            with open(os.path.join(group, "cpu.shares"), "w") as f:
                f.write(str(self.weight))

    def core(self, rank):
        return rank % self.cores

    # --- processes -----------------------------------------------------------
    def start(self, cmd, log_path, rank=None):
        """Starts cmd with output to log_path; inside rank's cgroup and pinned
        to its core when rank is given. Its own session: a terminal's Ctrl-C
        reaches this script only, which stops it by pid."""
        group = self.groups[rank] if rank is not None else None
        core = self.core(rank) if rank is not None else None

        def confine():
            if group:
                with open(os.path.join(group, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
            if core is not None:
                os.sched_setaffinity(0, {core})

        out = open(log_path, "w")
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=self.env,
                             start_new_session=True, preexec_fn=confine)
        out.close()
        self.procs.append(p)
        return p

    def stop(self, procs=None):
        procs = list(self.procs if procs is None else procs)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p in self.procs:
                self.procs.remove(p)

    def launch_groups(self, pid):
        try:
            return [os.path.join(CGROUP_ROOT, d) for d in os.listdir(CGROUP_ROOT)
                    if d.startswith(f"hap-launch-{pid}-")]
        except OSError:
            return []

    def cleanup(self):
        self.stop()
        groups = list(self.groups)
        for pid in self.launch_pids:
            groups += self.launch_groups(pid)
        for g in groups:
            # A group holding tasks cannot go: stop what is left in it (the
            # ranks of a hap-launch that died), by pid.
            for _ in range(50):
                try:
                    os.rmdir(g)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    try:
                        with open(os.path.join(g, "cgroup.procs")) as f:
                            for pid in f.read().split():
                                try:
                                    os.kill(int(pid), signal.SIGKILL)
                                except OSError:
                                    pass
                    except OSError:
                        pass
                    time.sleep(0.1)
            else:
                print(f"e2e_bench: could not remove {g}", file=sys.stderr)
        self.groups = []


def wait_for(pred, seconds, what):
    deadline = time.time() + seconds
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    die(f"timed out waiting for {what}")


def binaries(bin_dir):
    """The programs a benchmark run starts, from a bazel-bin directory."""
    bins = {k: os.path.join(bin_dir, v) for k, v in (
        ("hapctl", "tools/hapctl"), ("launch", "executor/cli/hap-launch"),
        ("executor", "executor/cli/hap-executor"),
        ("planner", "planner/service/hap-planner"), ("agent", "profiler_agent/hap-agent"))}
    for b in bins.values():
        if not os.access(b, os.X_OK):
            die(f"missing binary {b} (build it, see --help, or pass --bin-dir)")
    return bins


def run_guarded(name, c, keep_state, body):
    """Runs body(); on Ctrl-C or SIGTERM, and at the end either way, stops
    everything `c` started, removes its cgroups and (unless keep_state) its
    state directory."""
    def on_signal(sig, _):
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        body()
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted; stopping everything it started", file=sys.stderr)
        sys.exit(130)
    finally:
        c.cleanup()
        if keep_state:
            log(f"state kept in {c.state}")
        else:
            shutil.rmtree(c.state, ignore_errors=True)


# --- 1. measure the devices ----------------------------------------------------
def measure_devices(c, bins, probe_seconds):
    token = os.path.join(c.state, "token")
    with open(token, "w") as f:
        f.write("e2e\n")
    planner = f"127.0.0.1:{free_port()}"
    plog = os.path.join(c.state, "planner.log")
    started = [c.start([bins["planner"], "--listen", planner, "--metrics-listen", "off",
                        "--database", "", "--token-file", token,
                        "--heartbeat-seconds", "2"], plog)]
    wait_for(lambda: "listening on" in open(plog).read(), 30, "the planner")
    ctl = ["--server", planner, "--token-file", token]
    for r in range(len(c.shares)):
        started.append(c.start(
            [bins["agent"], "--planner", planner, "--name", f"node{r}",
             "--token-file", token, "--threads", "1", "--probe-seconds",
             str(probe_seconds), "--drift", "0", "--link-probe-seconds", "3600"],
            os.path.join(c.state, f"agent{r}.log"), rank=r))

    def nodes():
        p = subprocess.run([bins["hapctl"], "get", "nodes", "-o", "json", *ctl],
                           capture_output=True, text=True)
        if p.returncode:
            return None
        d = json.loads(p.stdout or "{}")
        ready = [n for n in d.get("nodes", []) if n.get("state") == "READY"
                 and n.get("devices") and n["devices"][0].get("flops")]
        return ready if len(ready) == len(c.shares) else None

    got = wait_for(nodes, 120 + 10 * probe_seconds, "the agents' measurements")
    c.stop(started)
    return sorted(got, key=lambda n: int(n["name"][4:]))


def cluster_json(nodes):
    """The measured nodes as a hap.v1.Cluster (planner/examples format)."""
    with open(os.path.join(WORKSPACE, "planner", "examples", "cpu-2rank.json")) as f:
        defaults = json.load(f)["defaults"]
    keep = ("id", "kind", "model", "flops", "memoryBytes", "launchOverheadSeconds",
            "node", "localIndex")
    return {"nodes": [{"name": n["name"],
                       "devices": [{k: d[k] for k in keep if k in d} for d in n["devices"]]}
                      for n in nodes],
            "defaults": defaults}


def flops_of(device):
    return [f["flops"] for f in device["flops"] if f.get("dtype") == "FLOAT32"][0]


# --- 2. plan -------------------------------------------------------------------
def quota_scaled(cluster, shares):
    """The cluster with rank i's FLOP/s = the fastest measurement x share_i /
    the largest share: what the devices deliver over many CFS periods."""
    q = json.loads(json.dumps(cluster))
    devs = [n["devices"][0] for n in q["nodes"]]
    peak = max(flops_of(d) for d in devs)
    for d, s in zip(devs, shares):
        for f in d["flops"]:
            f["flops"] = peak * s / max(shares)
    return q


def make_plans(c, bins, cluster_path, device_ids, model, opt,
               names=("hap", "dp-even", "dp-prop"), suffix="", split=None, extra=()):
    """Plans `names` (hap, a baseline, or dp-split: data parallelism at the
    ratios `split`), with hapctl plan flags `extra`."""
    plans = {}
    for name in names:
        path = os.path.join(c.state, f"{name}{suffix}.pb")
        cmd = [bins["hapctl"], "plan", "--cluster", cluster_path, "--devices",
               ",".join(device_ids), *model, *opt, *extra, "--save-plan", path]
        if name == "dp-split":
            cmd += ["--baseline", "dp-prop", "--ratios", ",".join(f"{r:.12g}" for r in split)]
        elif name != "hap":
            cmd += ["--baseline", name]
        p = subprocess.run(cmd + ["-o", "json"], capture_output=True, text=True)
        if p.returncode:
            die(f"hapctl plan ({name}) failed:\n{p.stderr}")
        d = json.loads(p.stdout)
        table = subprocess.run(cmd + ["-o", "table"], capture_output=True, text=True).stdout
        with open(os.path.join(c.state, f"{name}{suffix}.txt"), "w") as f:
            f.write(table)
        plans[name + suffix] = {"path": path, "predicted": d["predicted_step_seconds"],
                       "ratios": d["ratios"], "devices": d["devices"], "table": table,
                       # The op table and the ratios fix the rank programs
                       # (the lowering is deterministic).
                       "programs": json.dumps([d.get("ops"),
                                               [round(r, 9) for r in d["ratios"]],
                                               list(extra)],
                                              sort_keys=True)}
    return plans


def proportional_split(batch, weights):
    """Integer batch sizes (each >= 1) minimizing the slowest rank's
    batch / weight, ties broken towards the even split."""
    n = len(weights)
    best = None
    def rec(prefix, left):
        nonlocal best
        if len(prefix) == n - 1:
            split = prefix + [left]
            if left < 1:
                return
            key = (max(b / w for b, w in zip(split, weights)),
                   max(split) - min(split))
            if best is None or key < best[0]:
                best = (key, split)
            return
        for b in range(1, left - (n - len(prefix) - 1) + 1):
            rec(prefix + [b], left - b)
    rec([], batch)
    return best[1]


# --- 3. run --------------------------------------------------------------------
def run_hap_launch(c, bins, plan, args, tag, profile=None, flags=()):
    steps = max(args.warmup, 2) + args.steps if profile else args.warmup + args.steps
    cmd = [bins["launch"], "--plan", plan, "--cpu-shares", ",".join(map(str, c.shares)),
           "--cpu-period-us", str(c.period_us), "--pin-cores", "--threads", "1", "--steps", str(steps), "--data", "synthetic",
           "--executor", bins["executor"], "--timeout", "120", *flags]
    if profile:
        cmd += ["--profile", profile]
    log_path = os.path.join(c.state, f"{tag}.log")
    p = c.start(cmd, log_path)
    c.launch_pids.append(p.pid)
    # hap-launch makes its groups with the default weight: raise it as soon
    # as they appear (the warm-up steps cover the first milliseconds).
    todo = len(c.shares) if c.weight else 0
    done = set()
    deadline = time.time() + args.run_timeout
    while p.poll() is None and len(done) < todo and time.time() < deadline:
        for g in c.launch_groups(p.pid):
            if g not in done:
                try:
                    c.prioritize(g)
                    done.add(g)
                except OSError:
                    pass  # not ready yet, or already gone
        time.sleep(0.005)
    try:
        p.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        c.stop([p])
        die(f"hap-launch ran past {args.run_timeout} s; log {log_path}")
    c.procs.remove(p)
    out = open(log_path).read()
    if p.returncode:
        die(f"hap-launch failed ({p.returncode}); log {log_path}:\n{out[-2000:]}")
    left = c.launch_groups(p.pid)
    if left:
        die(f"hap-launch left cgroups behind: {left}")
    c.launch_pids.remove(p.pid)
    return out


def run_ddp(c, args, split, model_kv, tag):
    port = free_port()
    steps = args.steps
    procs = []
    for r in range(len(c.shares)):
        cmd = [args.python, os.path.join(HERE, "ddp_worker.py"), "--rank", str(r),
               "--world", str(len(c.shares)), "--port", str(port),
               "--batches", ",".join(map(str, split)), "--cgroup", c.groups[r],
               "--core", str(c.core(r)), "--steps", str(steps), "--warmup",
               str(args.warmup), "--lr", str(args.lr), "--clip", "1"]
        for k, v in model_kv.items():
            cmd += [f"--{k}", str(v)]
        # The worker joins its cgroup and pins itself (before importing torch).
        procs.append(c.start(cmd, os.path.join(c.state, f"{tag}-r{r}.log")))
    deadline = time.time() + args.run_timeout
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            c.stop(procs)
            die(f"DDP ran past {args.run_timeout} s; logs {c.state}/{tag}-r*.log")
    c.stop(procs)
    outs = [open(os.path.join(c.state, f"{tag}-r{r}.log")).read()
            for r in range(len(procs))]
    for r, p in enumerate(procs):
        if p.returncode:
            die(f"DDP rank {r} failed ({p.returncode}):\n{outs[r][-2000:]}")
    return outs[0]


def step_times(out, warmup):
    steps = [(int(m.group(1)), float(m.group(2)), float(m.group(3)))
             for m in STEP_RE.finditer(out)]
    return [t for i, _, t in steps if i >= warmup], [l for _, l, _ in steps]


def loadavg():
    return "%.2f %.2f %.2f" % os.getloadavg()


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shares", default="1,0.4",
                    help="CPU share of each rank, values in (0, 1] [1,0.4]")
    ap.add_argument("--steps", type=int, default=10,
                    help="timed steps per run, after the warm-up [10]")
    ap.add_argument("--rounds", type=int, default=4,
                    help="rounds; each runs every configuration once [4]")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per run [3]")
    ap.add_argument("--bin-dir", default=os.path.join(WORKSPACE, "bazel-bin"),
                    help="where tools/hapctl, executor/cli/hap-launch, "
                         "executor/cli/hap-executor, planner/service/hap-planner "
                         "and profiler_agent/hap-agent are [WORKSPACE/bazel-bin]")
    ap.add_argument("--python", default="/usr/bin/python3",
                    help="the Python with torch for the DDP workers")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"subset of {','.join(CONFIGS)}")
    ap.add_argument("--quota-profile", action="store_true",
                    help="also run " + ",".join(QUOTA_CONFIGS) + ": HAP and DP-proportional "
                         "planned from the fastest measured rate x each share")
    ap.add_argument("--overlap", action="store_true",
                    help="also run " + ",".join(OVERLAP_CONFIGS) + ": the plans made with\n"
                         "--overlap on, HAP's run in line too, DDP at HAP's split")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="skip the calibration phase (profiled runs, hapctl calibrate,\n"
                         "the HAP plan again from the calibrated model, accuracy table)")
    ap.add_argument("--period-us", type=int, default=PERIOD_US,
                    help=f"CFS period of the ranks' cgroups, microseconds [{PERIOD_US}]; "
                         "the quota is share x period")
    ap.add_argument("--weight", type=int, default=262144,
                    help="cpu.shares of every rank's cgroup (its weight against other "
                         "work on the machine; 0 = leave the default 1024) [262144]")
    ap.add_argument("--probe-seconds", type=float, default=3,
                    help="the agents' probe length [3]")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--run-timeout", type=float, default=300,
                    help="seconds one run may take [300]")
    ap.add_argument("--keep-state", action="store_true",
                    help="keep the logs, cluster JSON and plans (path printed)")
    for k, d in (("layers", 2), ("hidden", 64), ("heads", 4), ("ffn", 256), ("seq", 32),
                 ("batch", 16), ("vocab", 18328)):
        ap.add_argument(f"--{k}", type=int, default=d, help=f"model size [{d}]")
    args = ap.parse_args()
    try:
        shares = [float(s) for s in args.shares.split(",")]
    except ValueError:
        ap.error(f"--shares must be numbers, got '{args.shares}'")
    if len(shares) < 2 or not all(0 < s <= 1 for s in shares):
        ap.error("--shares needs at least 2 values in (0, 1]")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        ap.error("--steps and --rounds must be positive, --warmup not negative")
    configs = args.configs.split(",")
    if not configs or any(x not in CONFIGS for x in configs):
        ap.error(f"--configs must name some of {','.join(CONFIGS)}")
    if len(set(configs)) != len(configs):
        # Its per-round medians would not line up with the other configurations'.
        ap.error(f"--configs names a configuration twice: {args.configs}")
    if args.quota_profile:
        configs += QUOTA_CONFIGS
    if args.overlap:
        configs += OVERLAP_CONFIGS
    if not args.no_calibrate:
        configs += CALIBRATED_CONFIGS
    bins = binaries(args.bin_dir)
    if any(x.startswith("ddp") for x in configs) and not os.access(args.python, os.X_OK):
        die(f"no Python at {args.python} for the DDP workers (--python)")

    if args.weight and not 2 <= args.weight <= 262144:
        ap.error("--weight must be 0 or within 2..262144")
    c = Cluster(shares, None, args.weight, args.period_us)
    c.check_cgroups()
    # Made once nothing can refuse the run: run_guarded removes it.
    c.state = tempfile.mkdtemp(prefix="hap-e2e.")

    run_guarded("e2e_bench", c, args.keep_state, lambda: bench(c, bins, args, configs))


def bench(c, bins, args, configs):
    shares = c.shares
    n = len(shares)
    ideal = sum(shares) / (n * min(shares))
    model_kv = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "seq",
                                               "vocab")}
    model = ["--model", "gpt"] + [x for k in ("layers", "hidden", "heads", "ffn", "seq",
                                              "batch", "vocab")
                                  for x in (f"--{k}", str(getattr(args, k)))]
    opt = ["--optimizer", "adam", "--lr", str(args.lr), "--clip-norm", "1"]
    log(f"e2e_bench: {n} ranks, shares {args.shares}, {c.cores} cores; "
        f"state in {c.state}; load {loadavg()}")
    c.make_groups()

    log("\n== 1. Measuring the throttled devices (planner + an agent per rank cgroup) ==")
    nodes = measure_devices(c, bins, args.probe_seconds)
    cluster = cluster_json(nodes)
    cluster_path = os.path.join(c.state, "cluster.json")
    with open(cluster_path, "w") as f:
        json.dump(cluster, f, indent=1)
    devices = [n["devices"][0] for n in nodes]
    for r, d in enumerate(devices):
        log(f"   rank {r} ({shares[r]:.0%} of core {c.core(r)}): {d['id']} "
            f"{flops_of(d) / 1e9:.1f} GFLOP/s measured")
    measured_ratio = flops_of(devices[0]) / flops_of(devices[-1])

    log("\n== 2. Plans (hapctl plan --cluster <measured>, Adam lr %g, clip 1) ==" % args.lr)
    ids = [d["id"] for d in devices]
    plans = make_plans(c, bins, cluster_path, ids, model, opt)
    if "hap-q" in configs:
        qpath = os.path.join(c.state, "cluster-quota.json")
        with open(qpath, "w") as f:
            json.dump(quota_scaled(cluster, shares), f, indent=1)
        plans.update(make_plans(c, bins, qpath, ids, model, opt, ("hap", "dp-prop"), "-q"))
    if "hap-cal" in configs:
        log("\n== 2b. Calibration: each plan run once with --profile, then hapctl calibrate ==")
        # Only plans whose throttled rank computes most of the step: a plan
        # that leaves it waiting (ZeRO-3's two collectives per parameter here)
        # lets it run its kernels in bursts up to 25% faster than it can
        # sustain, and the calibrated model then gives it too much work.
        calib = dict(plans)
        runs = []
        for name in ("hap", "dp-even", "dp-prop"):
            prefix = os.path.join(c.state, f"profile-{name}")
            run_hap_launch(c, bins, calib[name]["path"], args, f"profile-{name}", profile=prefix)
            runs += ["--plan", calib[name]["path"], "--profile", prefix]
        cal_path = os.path.join(c.state, "cluster-calibrated.json")
        # Op-time scales pooled over the (CPU) devices: the throttled rank's
        # kernel wall times depend on the plan (when it waits it runs in
        # bursts); the agents' measured FLOP/s rank the devices.
        p = subprocess.run([bins["hapctl"], "calibrate", "--cluster", cluster_path, *runs,
                            "--out", cal_path, "--op-scales", "per-kind"],
                           capture_output=True, text=True)
        if p.returncode:
            die(f"hapctl calibrate failed:\n{p.stderr}")
        log("\n".join("   " + l for l in p.stdout.strip().splitlines()))
        plans.update(make_plans(c, bins, cal_path, ids, model, opt,
                                ("hap", "dp-even", "dp-prop"), "-cal"))
        plans.update(make_plans(c, bins, cal_path, ids, model, opt, ("dp-split",), "-cal",
                                split=plans["hap-cal"]["ratios"]))
    if "hap-ov" in configs:
        plans.update(make_plans(c, bins, cluster_path, ids, model, opt, ("hap", "dp-prop"),
                                "-ov", extra=["--overlap", "on"]))
        # The same plan, its collectives run in line by the executors.
        plans["hap-ov-inline"] = dict(plans["hap-ov"])
        plans["hap-ov-inline"]["programs"] += " in line"
    for name, p in plans.items():
        log(f"   {name:8s} predicted {p['predicted']:.4f} s, ratios "
            + ", ".join(f"{x:.3f}" for x in p["ratios"]))
    hap_head = plans["hap"]["table"].split("\nOP")[0]
    log("\n" + "\n".join("   " + l for l in hap_head.strip().splitlines()))
    even_split = proportional_split(args.batch, [1.0] * n)
    prop_split = proportional_split(args.batch, shares)
    ov_split = proportional_split(args.batch, plans["hap-ov"]["ratios"]) \
        if "hap-ov" in plans else None
    log(f"\n   DDP batch split: even {even_split}, proportional to the shares {prop_split}"
        + (f", HAP with overlap's {ov_split}" if ov_split else ""))

    log(f"\n== 3. {args.rounds} rounds x {len(configs)} configurations, "
        f"{args.warmup} warm-up + {args.steps} timed steps each ==")
    times = {x: [] for x in configs}
    per_round = {x: [] for x in configs}
    first_loss = {}
    loads = [loadavg()]
    for rnd in range(args.rounds):
        k = rnd % len(configs)
        order = configs[k:] + configs[:k]
        if rnd % 2:
            order.reverse()
        for x in order:
            tag = f"{x}-round{rnd}"
            if x.startswith("ddp"):
                split = {"ddp-even": even_split, "ddp-split-ov": ov_split}.get(x, prop_split)
                out = run_ddp(c, args, split, model_kv, tag)
            else:
                out = run_hap_launch(c, bins, plans[x]["path"], args, tag,
                                     flags=RUN_FLAGS.get(x, ()))
            ts, losses = step_times(out, args.warmup)
            if len(ts) != args.steps:
                die(f"{x}: expected {args.steps} timed steps, parsed {len(ts)}:\n{out[-1500:]}")
            times[x] += ts
            per_round[x].append(statistics.median(ts))
            first_loss.setdefault(x, losses[0] if losses else float("nan"))
        loads.append(loadavg())
        log(f"   round {rnd + 1}: " + ", ".join(
            f"{x} {1e3 * per_round[x][-1]:.1f} ms" for x in configs) + f"  (load {loads[-1]})")

    med = {x: statistics.median(times[x]) for x in configs}
    props = [x for x in ("dp-prop", "ddp-prop", "dp-prop-q") if x in configs]
    best_prop = min(props, key=lambda x: med[x]) if props else None

    def round_ratio(base, x):
        rs = [b / t for b, t in zip(per_round[base], per_round[x])]
        return statistics.median(rs), min(rs), max(rs)

    date = datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC")
    commit = subprocess.run(["git", "-C", WORKSPACE, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    log(f"\n== Results: median step time over {args.rounds} x {args.steps} steps, "
        f"ranks at {args.shares} of a core, CFS period {c.period_us} us ==")
    log(f"{date}, {c.cores} cores, commit {commit}, load averages per round {loads}")
    log(f"gpt: layers {args.layers}, hidden {args.hidden}, heads {args.heads}, "
        f"ffn {args.ffn}, seq {args.seq}, global batch {args.batch}, vocab {args.vocab}; "
        f"Adam lr {args.lr}, clip 1; synthetic token ids\n")
    head = "| configuration | batch per rank | predicted s | median ms/step | min-max ms |"
    sep = "|---|---|---|---|---|"
    if "dp-even" in configs:
        head += " speed-up vs DP-even (per-round range) |"
        sep += "---|"
    if best_prop:
        head += f" speed-up vs best proportional ({best_prop}; per-round range) |"
        sep += "---|"
    head += " first loss |"
    sep += "---|"
    log(head)
    log(sep)
    for x in configs:
        if x in plans:
            split = "ratios " + ", ".join(f"{r:.3f}" for r in plans[x]["ratios"])
            pred = f"{plans[x]['predicted']:.4f}"
        else:
            split = ", ".join(map(str, {"ddp-even": even_split,
                                        "ddp-split-ov": ov_split}.get(x, prop_split)))
            pred = "-"
        row = (f"| {LABELS[x]} | {split} | {pred} | {1e3 * med[x]:.1f} | "
               f"{1e3 * min(times[x]):.1f}-{1e3 * max(times[x]):.1f} |")
        if "dp-even" in configs:
            m, lo, hi = round_ratio("dp-even", x)
            row += f" {med['dp-even'] / med[x]:.2f}x ({lo:.2f}-{hi:.2f}) |"
        if best_prop:
            m, lo, hi = round_ratio(best_prop, x)
            row += f" {med[best_prop] / med[x]:.2f}x ({lo:.2f}-{hi:.2f}) |"
        row += f" {first_loss[x]:.3f} |"
        log(row)
    log(f"\nideal compute-bound speed-up of a proportional split over the even one: "
        f"{ideal:.2f}x (shares {args.shares}); measured devices "
        f"{measured_ratio:.2f}:1 (shares {shares[0] / shares[-1]:.2f}:1)")
    for h in ("hap", "hap-cal"):
        if h not in configs:
            continue
        what = "HAP" if h == "hap" else "HAP, calibrated"
        if "dp-even" in configs:
            log(f"{what} vs DP-even: {med['dp-even'] / med[h]:.2f}x (target >= 1.7x)")
        if best_prop:
            log(f"{what} vs best proportional ({best_prop}): "
                f"{med[best_prop] / med[h]:.2f}x (target >= 1.05x)")
    if "hap-ov" in configs:
        for base, what in (("hap-ov-inline", "the same plan in line"),
                           ("dp-prop", "DP-proportional in line"),
                           ("dp-prop-ov", "DP-proportional with overlap"),
                           ("ddp-split-ov", "PyTorch DDP at its split"),
                           ("ddp-prop", "PyTorch DDP proportional")):
            if base in configs:
                m, lo, hi = round_ratio(base, "hap-ov")
                log(f"HAP with overlap vs {what}: {med[base] / med['hap-ov']:.2f}x "
                    f"(per round {m:.2f}, {lo:.2f}-{hi:.2f})")
    if "hap-cal" in configs and "dp-split-cal" in configs:
        log(f"HAP, calibrated vs DP at its split: "
            f"{med['dp-split-cal'] / med['hap-cal']:.2f}x (the program's gain; the rest of "
            f"the gain over DP-proportional is the split's)")
    # Two configurations that run the same rank programs (the same program and
    # the same per-rank shards) differ only by noise: say so.
    for a in configs:
        for b in configs:
            if a < b and a in plans and b in plans and plans[a].get("programs") and \
                    plans[a]["programs"] == plans[b].get("programs"):
                log(f"{LABELS[a]} and {LABELS[b]} run the same rank programs: "
                    f"{1e3 * med[a]:.1f} vs {1e3 * med[b]:.1f} ms is this run's noise")
    if "hap-cal" in configs:
        log("\nCost-model accuracy: predicted vs measured median step (error = predicted / "
            "measured - 1); 'after' plans and predicts with the calibrated cluster")
        log("| plan | predicted before | predicted after | measured | error before | error after |")
        log("|---|---|---|---|---|---|")
        for x, before, after in (("dp-even", "dp-even", "dp-even-cal"),
                                 ("dp-prop", "dp-prop", "dp-prop-cal"),
                                 ("hap", "hap", None), ("hap-cal", None, "hap-cal"),
                                 ("dp-split-cal", None, "dp-split-cal")):
            if x not in med:
                continue
            b = plans[before]["predicted"] if before else None
            a = plans[after]["predicted"] if after else None
            fmt = lambda v: f"{v:.4f}" if v is not None else "-"
            err = lambda v: f"{100 * (v / med[x] - 1):+.0f}%" if v is not None else "-"
            log(f"| {LABELS[x]} | {fmt(b)} | {fmt(a)} | {med[x]:.4f} | {err(b)} | {err(a)} |")
    with open(os.path.join(c.state, "results.json"), "w") as f:
        json.dump({"times": times, "per_round": per_round, "loads": loads,
                   "plans": {k: {kk: vv for kk, vv in v.items() if kk != "table"}
                             for k, v in plans.items()},
                   "cluster": cluster}, f, indent=1)


if __name__ == "__main__":
    main()
