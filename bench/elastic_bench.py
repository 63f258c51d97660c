"""Elastic jobs (issue 19) against a TorchElastic-style restart, on a
heterogeneous CPU cluster on this machine.

Three ranks, each a profiler agent and an executor daemon in a cgroup with
its CPU quota (shares 0.7, 1, 0.3 of a core by default, pinned to cores as
scripts/demo.sh does), and a planner. Each round measures both sides, the
order alternating between rounds:

  hap:   a job (hapctl create job) trains on the three; rank 1's agent and
         executor are SIGKILLed; the planner re-plans onto the two survivors and resumes
         from the latest committed checkpoint. Recovery = the job's failure
         detection (its event's detect_time) -> the new deployment's first
         step done. Then steps/s on the two; then rank 1 is started
         again, the job re-plans onto the three (a join) and steps/s
         on the three.
  base:  TorchElastic-style, on the same devices: every worker restarted
         from the same checkpoint with the old layout and an even split
         (data parallelism, dp-even, planned beforehand: the layout does
         not change). Recovery = the restart asked -> its first step done.
         Steps/s on the two survivors, then on the three.

Steps/s are measured over --window steps after --warmup steps of each
deployment. The report gives per round and in median the recovery times and
the throughput ratios hap/base after the loss and after the join.

    bazel build --config=cuda //tools:hapctl //planner/service:hap-planner \\
        //profiler_agent:hap-agent //executor/cli:hap-executor
    /usr/bin/python3 bench/elastic_bench.py --bin-dir bazel-bin [--rounds 3]

Root with cgroup v1's cpu controller for the shares; without, it says so
and runs unthrottled ranks (a homogeneous cluster: the ratios mean little).
"""

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

CGROUP = "/sys/fs/cgroup/cpu"
PERIOD_US = 20000
TOKEN = "bench"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_for(what, pred, timeout, poll=0.1, explain=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}" +
                       (f"; {explain()}" if explain else ""))


def rfc3339(ts):
    """Seconds since the epoch of a protobuf JSON timestamp."""
    base, _, frac = ts.rstrip("Z").partition(".")
    t = datetime.datetime.strptime(base, "%Y-%m-%dT%H:%M:%S").replace(
        tzinfo=datetime.timezone.utc).timestamp()
    return t + (float("0." + frac) if frac else 0.0)


class Cluster:
    def __init__(self, args):
        self.a = args
        self.bin = os.path.abspath(args.bin_dir)
        self.state = tempfile.mkdtemp(prefix="hap-elastic-bench.")
        self.procs = []
        self.groups = []
        self.agent = {}
        self.executor = {}
        self.address = {}
        self.group = {}
        self.shares = [float(x) for x in args.shares.split(",")]
        self.cores = os.cpu_count() or 1
        with open(os.path.join(self.state, "token"), "w") as f:
            f.write(TOKEN + "\n")

    def start(self, name, argv, group=None, core=None):
        log = open(os.path.join(self.state, name + ".log"), "w")

        def enter():
            if group:
                with open(os.path.join(group, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
            if core is not None:
                os.sched_setaffinity(0, {core})

        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=enter)
        self.procs.append(p)
        return p

    def line(self, name, text, timeout=30):
        path = os.path.join(self.state, name + ".log")

        def found():
            with open(path) as f:
                for ln in f:
                    if text in ln:
                        return ln.strip()
            return None
        return wait_for(f"'{text}' in {path}", found, timeout)

    def ctl(self, *argv, check=True):
        r = subprocess.run([os.path.join(self.bin, "tools/hapctl"), *argv, "--server",
                            self.planner, "--token-file", os.path.join(self.state, "token")],
                           capture_output=True, text=True, timeout=300)
        if check and r.returncode != 0:
            raise RuntimeError(f"hapctl {' '.join(argv)}: {r.stderr.strip()}")
        return r.stdout

    def json(self, *argv):
        return json.loads(self.ctl(*argv, "-o", "json"))

    def up(self):
        self.cgroups = os.access(CGROUP, os.W_OK)
        if not self.cgroups:
            print("bench: cgroups unavailable: unthrottled ranks (a homogeneous cluster)")
        self.planner = f"127.0.0.1:{free_port()}"
        self.start("planner", [os.path.join(self.bin, "planner/service/hap-planner"), "--listen",
                               self.planner, "--metrics-listen", "off", "--database",
                               os.path.join(self.state, "planner.db"), "--token-file",
                               os.path.join(self.state, "token"), "--heartbeat-seconds", "2"])
        self.line("planner", "listening on")
        for r, share in enumerate(self.shares):
            group = None
            if self.cgroups:
                group = os.path.join(CGROUP, f"hap-elastic-bench-{os.getpid()}-r{r}")
                os.mkdir(group)
                self.groups.append(group)
                for k, v in [("cpu.cfs_period_us", PERIOD_US),
                             ("cpu.cfs_quota_us", int(share * PERIOD_US)),
                             ("cpu.shares", 262144)]:
                    with open(os.path.join(group, k), "w") as f:
                        f.write(f"{v}\n")
            self.group[r] = group
            self.start_node(r)
        wait_for("every node READY", lambda: sum(
            n.get("state") == "READY" for n in self.json("get", "nodes").get("nodes", []))
            == len(self.shares), 120, 0.3)

    def start_node(self, r, suffix=""):
        """Rank r's agent and executor; started again, the executor listens
        where it did and the agent measures no links while others train."""
        again = f"node{r}/cpu0" in self.address
        self.agent[r] = self.start(
            f"agent{r}{suffix}",
            [os.path.join(self.bin, "profiler_agent/hap-agent"), "--planner", self.planner,
             "--name", f"node{r}", "--token-file", os.path.join(self.state, "token"),
             "--threads", "1", "--probe-seconds", "3", "--drift", "0",
             "--link-probe-seconds", "3600", "--link-probe-delay", "3600" if again else "0",
             "--devices", "cpu"],
            self.group[r], r % self.cores)
        listen = self.address.get(f"node{r}/cpu0", "127.0.0.1:0")
        self.executor[r] = self.start(
            f"executor{r}{suffix}",
            [os.path.join(self.bin, "executor/cli/hap-executor"), "--serve", "--listen", listen,
             "--planner", self.planner, "--device-id", f"node{r}/cpu0", "--token-file",
             os.path.join(self.state, "token"), "--threads", "1", "--timeout", "120"],
            self.group[r], r % self.cores)
        ln = self.line(f"executor{r}{suffix}", "listening on")
        self.address[f"node{r}/cpu0"] = ln.split("listening on ")[1]

    def kill_node(self, r):
        for p in (self.agent[r], self.executor[r]):
            p.send_signal(signal.SIGKILL)
            p.wait()

    def down(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for g in self.groups:
            for _ in range(50):
                try:
                    os.rmdir(g)
                    break
                except OSError:
                    time.sleep(0.1)
        shutil.rmtree(self.state, ignore_errors=True)


def model_flags(a):
    return ["--model", "gpt", "--layers", str(a.layers), "--hidden", str(a.hidden), "--heads",
            "4", "--ffn", str(4 * a.hidden), "--seq", str(a.seq), "--batch", str(a.batch),
            "--optimizer", "adam", "--lr", "3e-3"]


def steps_per_second(get_steps, warmup, window, start):
    """Steps/s over `window` steps, after `warmup` steps past `start`."""
    s0 = wait_for("warm-up steps", lambda: (get_steps() or 0) >= start + warmup
                  and get_steps(), 300, 0.05)
    t0 = time.time()
    s1 = wait_for("measured steps", lambda: (get_steps() or 0) >= s0 + window and get_steps(),
                  600, 0.05)
    return (s1 - s0) / (time.time() - t0)


def deployment_steps(c, name):
    def get():
        d = c.json("describe", "deployment", name)
        if d.get("state") in ("FAILED", "STOPPED"):
            raise RuntimeError(f"{name} {d.get('state')}: {d.get('error', '')}")
        return int(d.get("stepsCompleted", 0))
    return get


def job(c, name):
    return c.json("describe", "job", name)


def run_hap(c, a, rnd, devices3):
    """A job on three, rank 1 lost, then back: recovery, steps/s on 2 and 3."""
    name = f"hap-r{rnd}"
    ckpt = os.path.join(c.state, f"ckpt-{name}")
    argv = ["create", "job", "--id", name, *model_flags(a), "--steps", "1000000", "--data",
            "synthetic", "--checkpoint-dir", ckpt, "--checkpoint-every", str(a.every),
            "--join-stable", "8"]
    for d, addr in c.address.items():
        argv += ["--executor", f"{d}={addr}"]
    c.ctl(*argv)

    def status():
        return job(c, name).get("status", {})

    def explain():
        return c.ctl("describe", "job", name)
    wait_for("the job training on 3 past a checkpoint", lambda: (
        lambda s: s.get("state") == "RUNNING" and len(s.get("devices", [])) == 3
        and int(s.get("checkpointStep", -1)) >= a.every)(status()), 300, 0.2)
    c.kill_node(1)
    s = wait_for("the job re-planned onto 2", lambda: (
        lambda s: int(s.get("generation", 0)) >= 2 and s.get("state") == "RUNNING"
        and s)(status()), 120, 0.05, explain)
    ev = s["events"][-1]
    resume = int(ev.get("resumeStep", 0))
    dep = s["deployment"]
    get2 = deployment_steps(c, dep)
    wait_for("the first step after recovery", lambda: get2() > resume, 120, 0.02)
    recovery = time.time() - rfc3339(ev["detectTime"])
    sps2 = steps_per_second(get2, a.warmup, a.window, resume)
    c.start_node(1, f"-{name}")
    sps3, pred3, why = None, 0.0, ""
    try:
        s = wait_for("the job re-planned onto 3 (the join)", lambda: (
            lambda s: int(s.get("generation", 0)) >= 3 and s.get("state") == "RUNNING"
            and len(s.get("devices", [])) == 3 and s)(status()), a.join_timeout, 0.2)
        ev3 = s["events"][-1]
        pred3 = float(ev3.get("predictedStepAfter", 0))
        sps3 = steps_per_second(deployment_steps(c, s["deployment"]), a.warmup, a.window,
                                int(ev3.get("resumeStep", 0)))
    except RuntimeError:  # the job judged the join not worth it: said, not measured
        why = status().get("message", "")
        print(f"round {rnd}: no join within {a.join_timeout} s: {why}", flush=True)
    c.ctl("stop", "job", name)
    wait_for("the job stopped", lambda: status().get("state") in ("STOPPED", "SUCCEEDED",
                                                                  "FAILED"), 60, 0.2)
    latest = int(status().get("checkpointStep", -1))
    return dict(recovery=recovery, sps2=sps2, sps3=sps3, ckpt=ckpt, step=latest,
                pred2=float(ev.get("predictedStepAfter", 0)), pred3=pred3, why=why)


def run_base(c, a, rnd, ckpt, step, devices3):
    """TorchElastic-style: every worker restarted from the checkpoint, the same
    layout (dp-even) on the survivors, then on all three."""
    out = {}
    for n, devices in ((2, ["node0/cpu0", "node2/cpu0"]), (3, devices3)):
        plan = f"base{n}"
        resume = os.path.join(ckpt, f"step-{step:08d}")
        argv = ["deploy", "plan", plan, "--steps", "1000000", "--data", "synthetic",
                "--resume", resume]
        for d in devices:
            argv += ["--executor", f"{d}={c.address[d]}"]
        asked = time.time()
        dep = json.loads(c.ctl(*argv, "-o", "json"))["name"]
        get = deployment_steps(c, dep)
        wait_for("the baseline's first step", lambda: get() > step, 120, 0.02)
        if n == 2:
            out["recovery"] = time.time() - asked
        out[f"sps{n}"] = steps_per_second(get, a.warmup, a.window, step)
        c.ctl("stop", "deployment", dep)
        wait_for("the baseline stopped", lambda: c.json("describe", "deployment", dep).get(
            "state") in ("STOPPED", "SUCCEEDED", "FAILED"), 60, 0.2)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin-dir", default="bazel-bin")
    p.add_argument("--shares", default="0.7,1,0.3")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--every", type=int, default=20, help="checkpoint interval (steps)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--window", type=int, default=60)
    p.add_argument("--join-timeout", type=float, default=60,
                   help="seconds to wait for the job's join once rank 1 is back")
    a = p.parse_args()
    try:
        shares = [float(x) for x in a.shares.split(",")]
    except ValueError:
        shares = []
    if len(shares) != 3 or not all(0 < s <= 1 for s in shares):
        p.error(f"--shares needs three numbers in (0, 1], got '{a.shares}'")
    for k in ("rounds", "layers", "hidden", "seq", "batch", "every", "window"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be at least 1")
    if a.warmup < 0:
        p.error("--warmup must not be negative")
    for b in ("tools/hapctl", "planner/service/hap-planner", "profiler_agent/hap-agent",
              "executor/cli/hap-executor"):
        if not os.access(os.path.join(a.bin_dir, b), os.X_OK):
            p.error(f"missing binary {os.path.join(a.bin_dir, b)} (build it, see --help, "
                    "or pass --bin-dir)")
    c = Cluster(a)
    try:
        c.up()
        devices3 = [f"node{r}/cpu0" for r in range(3)]
        for n, devices in ((2, "node0/cpu0,node2/cpu0"), (3, ",".join(devices3))):
            c.ctl("create", "plan", "--id", f"base{n}", *model_flags(a), "--devices", devices,
                  "--baseline", "dp-even", "--wait", "--timeout", "300")
        nodes = c.json("get", "nodes")["nodes"]
        print("cluster: " + ", ".join(
            "%s %.1f GFLOP/s (share %s)" % (n["name"], [x["flops"] for x in n["devices"][0]["flops"]
                                                        if x["dtype"] == "FLOAT32"][0] / 1e9,
                                             c.shares[int(n["name"][4:])])
            for n in sorted(nodes, key=lambda n: n["name"])))
        print(f"model: gpt layers {a.layers}, hidden {a.hidden}, seq {a.seq}, batch {a.batch}; "
              f"checkpoint every {a.every}; steps/s over {a.window} steps after {a.warmup}")
        rows = []
        last = None
        for rnd in range(a.rounds):
            if rnd % 2 == 0 or last is None:
                h = run_hap(c, a, rnd, devices3)
                b = run_base(c, a, rnd, h["ckpt"], h["step"], devices3)
            else:  # the baseline first, from the last round's checkpoint
                b = run_base(c, a, rnd, last["ckpt"], last["step"], devices3)
                h = run_hap(c, a, rnd, devices3)
            last = h
            row = dict(round=rnd, hap_recovery=h["recovery"], base_recovery=b["recovery"],
                       hap_sps2=h["sps2"], base_sps2=b["sps2"], hap_sps3=h["sps3"],
                       base_sps3=b["sps3"], loss_ratio=h["sps2"] / b["sps2"],
                       join_ratio=h["sps3"] / b["sps3"] if h["sps3"] else None,
                       no_join=h["why"])
            rows.append(row)
            print("round %d: recovery hap %.2f s, base %.2f s; steps/s on 2: hap %.2f, base %.2f "
                  "(%.2fx); on 3: hap %s, base %.2f (%s)" % (
                      rnd, row["hap_recovery"], row["base_recovery"], row["hap_sps2"],
                      row["base_sps2"], row["loss_ratio"],
                      "%.2f" % row["hap_sps3"] if row["hap_sps3"] else "no join",
                      row["base_sps3"],
                      "%.2fx" % row["join_ratio"] if row["join_ratio"] else "-"), flush=True)
        med, rng = {}, {}
        for k in rows[0]:
            vals = [r[k] for r in rows if isinstance(r[k], float)]
            if vals:
                med[k] = statistics.median(vals)
                rng[k] = (min(vals), max(vals))
        joined = sum(1 for r in rows if r["join_ratio"])
        if not joined:
            med["hap_sps3"] = med["join_ratio"] = float("nan")
            rng["join_ratio"] = (float("nan"), float("nan"))
        print()
        print("| measure | hap | TorchElastic-style | ratio (median of rounds, min-max) |")
        print("|---|---|---|---|")
        print("| recovery, failure detected -> first step (s) | %.2f | %.2f | |" % (
            med["hap_recovery"], med["base_recovery"]))
        print("| steps/s after the loss (2 survivors) | %.2f | %.2f | %.2fx (%.2f-%.2f) |" % (
            med["hap_sps2"], med["base_sps2"], med["loss_ratio"], *rng["loss_ratio"]))
        print("| steps/s after the join (3; %d of %d rounds joined) | %.2f | %.2f | "
              "%.2fx (%.2f-%.2f) |" % (joined, len(rows), med["hap_sps3"], med["base_sps3"],
                                       med["join_ratio"], *rng["join_ratio"]))
        print(json.dumps(dict(rounds=rows, median=med)))
    finally:
        c.down()


if __name__ == "__main__":
    main()
