"""Pipeline x SPMD measured on the network testbed (issue 17): the planner's
plan (--pipeline auto) against the best SPMD plan (--pipeline off),
DP-proportional and, for reference, a forced 2-stage pipeline, on 2 nodes x 2
ranks with a slow link between the nodes, all in one run, interleaved.

The cluster: rank i pinned to core i (mod cores) and given the fraction
--shares[i] of it through a cgroup v1 CPU quota (bench/e2e/e2e_bench.py's
cgroups); ranks 0, 1 form node 0 and ranks 2, 3 node 1. At run time each node
is a network namespace of the testbed (README "The network testbed"), the
nodes joined through a bridge with tc limits (--network, default 10 Gbit/s
inside a node and 1 Gbit/s between the nodes).

1. Measure: an agent per rank in its cgroup, as bench/e2e does; the
   measured devices grouped into the two nodes, the links set to the
   testbed's rates (--intra-bytes-per-second, --inter-bytes-per-second).
2. Plan offline from that cluster with hapctl: hap (--pipeline auto), spmd
   (--pipeline off), dp-prop (--baseline dp-prop), pipe2 (--pipeline 2).
3. Run, interleaved: each round runs every configuration once through
   `hap-launch --network SPEC --cpu-shares ... --pin-cores`, the order
   rotating between rounds; rank 0's step times after the warm-up are kept.
   The table gives the median step, the ratio of the best SPMD plan's median
   to each configuration's, and the median over rounds of the per-round
   ratios with their range.
2b. Unless --no-calibrate: spmd and dp-prop (and pipe2, when it is run: its
   kernel times at the microbatch size) run once more on the testbed with
   --profile, `hapctl calibrate` fits the cluster to their per-op times, and
   hap-cal / spmd-cal are the two plans again from the calibrated cluster
   (so the choice between a pipeline and the SPMD plan is made on measured
   op times); they join the rounds. When hap-cal is a pipeline (and not
   --no-refit), it is profiled too, the cluster calibrated again with its
   run added, and hap-cal / spmd-cal planned again; the first hap-cal joins
   the rounds as hap-cal-first.

Needs root (cgroup v1 cpu controller, network namespaces, tc).

    bazel build //tools:hapctl //executor/cli:hap-launch \
        //executor/cli:hap-executor //planner/service:hap-planner \
        //profiler_agent:hap-agent --config=cuda
    python3 bench/pipeline_testbed_bench.py [--rounds 4] [--steps 6]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "e2e"))
import e2e_bench as e2e  # noqa: E402  (the cgroups, agents and launcher runs)

CONFIGS = ["hap", "spmd", "dp-prop", "pipe2", "pipe2-m2"]
# With calibration (default; --no-calibrate skips it): the planner's plan and
# the best SPMD plan again, from the cluster calibrated on profiled runs of
# spmd, dp-prop and pipe2 on the testbed (hapctl calibrate).
CALIBRATED_CONFIGS = ["hap-cal", "spmd-cal"]
LABELS = {
    "hap": "the planner's plan (--pipeline auto)",
    "spmd": "best SPMD plan (--pipeline off)",
    "dp-prop": "DP-proportional",
    "pipe2": "2-stage pipeline x SPMD (--pipeline 2)",
    "pipe2-m2": "2-stage pipeline, 2 microbatches (--pipeline 2 --microbatches 2)",
    "hap-cal": "the planner's plan, calibrated model",
    "spmd-cal": "best SPMD plan, calibrated model",
    "hap-cal-first": "the planner's first calibrated plan (before it was profiled)",
}
PLAN_FLAGS = {
    "hap": ["--pipeline", "auto"],
    "spmd": ["--pipeline", "off"],
    "dp-prop": ["--baseline", "dp-prop"],
    "pipe2": ["--pipeline", "2"],
    "pipe2-m2": ["--pipeline", "2", "--microbatches", "2"],
    "hap-cal": ["--pipeline", "auto"],
    "spmd-cal": ["--pipeline", "off"],
}


OVERLAP = ["off"]  # --overlap: every plan made with hapctl plan --overlap on


def log(msg):
    print(msg, flush=True)


def two_node_cluster(measured, ranks_per_node, intra, inter):
    """The measured single-device nodes regrouped into the testbed's nodes."""
    nodes = []
    for n in range(len(measured) // ranks_per_node):
        devices = []
        for local in range(ranks_per_node):
            r = n * ranks_per_node + local
            d = dict(measured[r]["devices"][0])
            keep = ("kind", "model", "flops", "memoryBytes", "launchOverheadSeconds")
            d = {k: d[k] for k in keep if k in d}
            d.update({"id": f"cpu{r}", "node": f"node{n}", "localIndex": local})
            devices.append(d)
        nodes.append({"name": f"node{n}", "devices": devices})
    return {"nodes": nodes,
            "defaults": {"intraNodeBandwidthBytesPerSecond": intra,
                         "intraNodeLatencySeconds": 5e-5,
                         "interNodeBandwidthBytesPerSecond": inter,
                         "interNodeLatencySeconds": 2e-4}}


DEFAULT_MODEL = "gpt --layers 4 --hidden 512 --heads 8 --ffn 2048 --seq 32 --batch 8 --vocab 8192"


def model_flags(text):
    """hapctl plan's model flags from --model: "gpt --layers 4 ..." (a zoo
    name first, as the default reads) or the flags themselves ("--model gpt
    ...", "--graph FILE"). hapctl refuses a bare word, so a name first is
    given as --model NAME."""
    words = text.split()
    if words and not words[0].startswith("-"):
        words = ["--model"] + words
    return words


def plan(c, bins, cluster_path, model, name):
    path = os.path.join(c.state, f"{name}.pb")
    cmd = [bins["hapctl"], "plan", "--cluster", cluster_path, *model,
           "--optimizer", "adam", "--lr", "3e-3", "--clip-norm", "1",
           *PLAN_FLAGS[name], "--overlap", OVERLAP[0], "--save-plan", path]
    p = e2e.subprocess.run(cmd + ["-o", "table"], capture_output=True, text=True)
    if p.returncode:
        e2e.die(f"hapctl plan ({name}) failed:\n{p.stderr}")
    with open(os.path.join(c.state, f"{name}.txt"), "w") as f:
        f.write(p.stdout)
    predicted = None
    for line in p.stdout.splitlines():
        # "predicted step 0.7175 s = ..." (SPMD) or "predicted step: 1.1129 s
        # (bubble ...)" (a pipeline).
        if line.startswith("predicted step"):
            predicted = float(line.replace(":", " ").split()[2])
            break
    stages = next((line for line in p.stdout.splitlines() if line.startswith("pipeline:")),
                  "one SPMD program")
    return {"path": path, "predicted": predicted, "stages": stages, "table": p.stdout}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shares", default="0.5,0.5,0.25,0.25",
                    help="CPU share per rank; ranks 0-1 node 0, 2-3 node 1 [0.5,0.5,0.25,0.25]")
    ap.add_argument("--network", default="between=1gbit inside=10gbit",
                    help="hap-launch --network SPEC [between=1gbit inside=10gbit]")
    ap.add_argument("--intra-bytes-per-second", type=float, default=1.25e9)
    ap.add_argument("--inter-bytes-per-second", type=float, default=1.25e8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run [6]")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--configs", default="hap,spmd,dp-prop,pipe2",
                    help=f"some of {','.join(CONFIGS)} [hap,spmd,dp-prop,pipe2]")
    ap.add_argument("--probe-seconds", type=float, default=3)
    ap.add_argument("--run-timeout", type=float, default=300)
    ap.add_argument("--bin-dir", default=os.path.join(e2e.WORKSPACE, "bazel-bin"))
    ap.add_argument("--keep-state", action="store_true")
    ap.add_argument("--no-refit", action="store_true",
                    help="do not profile a pipeline the calibrated planner chose and calibrate "
                         "again")
    ap.add_argument("--overlap", action="store_true",
                    help="make every plan with --overlap on: the SPMD plans' gradient buckets "
                         "behind their backward, the pipelines' behind each stage's last "
                         "microbatch's backward (each rank's communication thread)")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="skip the calibrated plans (hap-cal, spmd-cal)")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="the model: a zoo name and its hapctl plan flags (or hapctl plan's "
                         "own --model NAME / --graph FILE flags)")
    args = ap.parse_args()
    OVERLAP[0] = "on" if args.overlap else "off"
    shares = [float(s) for s in args.shares.split(",")]
    if len(shares) != 4 or not all(0 < s <= 1 for s in shares):
        ap.error("--shares needs 4 values in (0, 1]")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--rounds and --steps must be at least 1, --warmup not negative")
    configs = args.configs.split(",")
    if "spmd" not in configs or any(x not in CONFIGS for x in configs):
        ap.error(f"--configs must name spmd and some of {','.join(CONFIGS)}")
    if len(set(configs)) != len(configs):
        ap.error(f"--configs names a configuration twice: {args.configs}")
    if not args.no_calibrate:
        if "dp-prop" not in configs:
            ap.error("calibration profiles spmd and dp-prop: name dp-prop or pass --no-calibrate")
        configs += CALIBRATED_CONFIGS
    bins = e2e.binaries(args.bin_dir)
    c = e2e.Cluster(shares, None)
    c.check_cgroups()
    # Made once nothing can refuse the run: run_guarded removes it.
    c.state = tempfile.mkdtemp(prefix="hap-pipebed.")

    e2e.run_guarded("pipeline_testbed_bench", c, args.keep_state,
                    lambda: bench(c, bins, args, configs))


def bench(c, bins, args, configs):
    log(f"pipeline_testbed_bench: 2 nodes x 2 ranks, shares {args.shares}, network "
        f"'{args.network}', {c.cores} cores; load {e2e.loadavg()}")
    c.make_groups()
    log("\n== 1. Measuring the throttled devices ==")
    measured = e2e.measure_devices(c, bins, args.probe_seconds)
    cluster = two_node_cluster(measured, 2, args.intra_bytes_per_second,
                               args.inter_bytes_per_second)
    cluster_path = os.path.join(c.state, "cluster.json")
    with open(cluster_path, "w") as f:
        json.dump(cluster, f, indent=1)
    for n in cluster["nodes"]:
        for d in n["devices"]:
            log(f"   {n['name']}/{d['id']}: {e2e.flops_of(d) / 1e9:.1f} GFLOP/s")

    log(f"\n== 2. Plans (hapctl plan {args.model}) ==")
    model = model_flags(args.model)
    plans = {name: plan(c, bins, cluster_path, model, name) for name in configs
             if name not in CALIBRATED_CONFIGS}
    if "hap-cal" in configs:
        profiled = [n for n in ("spmd", "dp-prop", "pipe2") if n in plans]
        log(f"\n== 2b. Calibration: {', '.join(profiled)} run once on the testbed with "
            "--profile, then hapctl calibrate ==")
        runs = []
        cal_path = os.path.join(c.state, "cluster-calibrated.json")

        def profile_and_calibrate(names):
            for name in names:
                prefix = os.path.join(c.state, f"profile-{name}")
                e2e.run_hap_launch(c, bins, plans[name]["path"], args, f"profile-{name}",
                                   profile=prefix, flags=("--network", args.network))
                runs.extend(["--plan", plans[name]["path"], "--profile", prefix])
            p = e2e.subprocess.run([bins["hapctl"], "calibrate", "--cluster", cluster_path,
                                    *runs, "--out", cal_path, "--op-scales", "per-kind"],
                                   capture_output=True, text=True)
            if p.returncode:
                e2e.die(f"hapctl calibrate failed:\n{p.stderr}")
            log("\n".join("   " + line for line in p.stdout.strip().splitlines()))
            for name in CALIBRATED_CONFIGS:
                plans[name] = plan(c, bins, cal_path, model, name)

        profile_and_calibrate(profiled)
        # A calibrated choice of a pipeline not profiled yet: profiled too
        # (its own stalls) and the plans made again, once, as a job re-plans
        # after measuring what it chose.
        if not args.no_refit and plans["hap-cal"]["stages"] != "one SPMD program":
            os.replace(plans["hap-cal"]["path"], os.path.join(c.state, "hap-cal-first.pb"))
            plans["hap-cal-first"] = dict(plans["hap-cal"],
                                          path=os.path.join(c.state, "hap-cal-first.pb"))
            log(f"   the calibrated plan is a pipeline ({plans['hap-cal']['stages']}, predicted "
                f"{plans['hap-cal']['predicted']:.4f} s): profiling it and calibrating again")
            profile_and_calibrate(["hap-cal-first"])
            configs.append("hap-cal-first")
    for name in configs:
        p = plans[name]
        log(f"   {name:8s} predicted {p['predicted']:.4f} s  {p['stages']}")

    log(f"\n== 3. {args.rounds} interleaved rounds, {args.warmup} warm-up + {args.steps} "
        "timed steps each ==")
    times = {name: [] for name in configs}
    round_medians = []
    for rnd in range(args.rounds):
        order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
        medians = {}
        for name in order:
            out = e2e.run_hap_launch(c, bins, plans[name]["path"], args, f"{name}-{rnd}",
                                     flags=("--network", args.network))
            t, _ = e2e.step_times(out, args.warmup)
            if len(t) < args.steps:
                e2e.die(f"{name} round {rnd}: {len(t)} timed steps in its output")
            times[name] += t
            medians[name] = statistics.median(t)
        round_medians.append(medians)
        log(f"   round {rnd + 1}: " + ", ".join(f"{n} {medians[n]:.4f} s" for n in order)
            + f" (load {e2e.loadavg()})")

    log("\n| configuration | plan | predicted s | median step s | best SPMD / this | "
        "per-round ratio median [min, max] |")
    log("|---|---|---:|---:|---:|---|")
    base = statistics.median(times["spmd"])
    for name in configs:
        med = statistics.median(times[name])
        ratios = [r["spmd"] / r[name] for r in round_medians]
        log(f"| {LABELS[name]} | {plans[name]['stages']} | {plans[name]['predicted']:.4f} | "
            f"{med:.4f} | {base / med:.2f}x | {statistics.median(ratios):.2f}x "
            f"[{min(ratios):.2f}, {max(ratios):.2f}] |")


if __name__ == "__main__":
    main()
