"""A heterogeneous CPU cluster on this machine: two ranks pinned to their
own cores, one with a whole core and one with 40% of a core (cgroup v1
cpu.cfs_quota_us, via hap-launch --cpu-shares). The synthesized plan (ratios
by the profile) must train measurably faster than data parallelism with an
even split: median step time over steps after warm-up, the two plans run in
turns so machine noise hits both alike; required > 1.2x (the compute-bound
ideal for 100%/40% is 1.75x). Both plans compute the same model, so their
losses agree. Afterwards no cgroup made by hap-launch remains, also when it
is interrupted with SIGINT.

The synthesized plan is the product's: planned, run three times with
--profile in turns with DP-even, the cost model calibrated from those runs (hapctl
calibrate) and planned again. The test also checks that calibration corrects
a profile that is off: the same runs calibrate a copy of the cluster whose
FLOP/s are 4x too high (what a GEMM probe reports against what small
training kernels reach), and DP-even's predicted step time on it must come
at least twice as close to the measured one. (The cluster above was set by
hand near the truth, so there its uncalibrated prediction is already within
noise of the measurement and "closer" would be a coin toss.)

Skipped, with the reason, only where cgroups cannot be written (not root,
or no cgroup v1 cpu controller)."""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_test_util as util  # noqa: E402

HAPCTL = util.HAPCTL
EXECUTOR = os.path.abspath(os.environ.get("HAP_EXECUTOR", ""))
LAUNCH = os.path.abspath(os.environ.get("HAP_LAUNCH", ""))
CGROUP = "/sys/fs/cgroup/cpu"
MODEL = ["--model", "gpt", "--layers", "2", "--hidden", "128", "--heads", "4", "--ffn", "512",
         "--seq", "32", "--batch", "32", "--vocab", "2048"]
SHARES = "1,0.4"


def cgroups_writable():
    probe = os.path.join(CGROUP, f"hap-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        with open(os.path.join(probe, "cpu.cfs_quota_us"), "w") as f:
            f.write("50000")
        os.rmdir(probe)
        return ""
    except OSError as e:
        try:
            os.rmdir(probe)
        except OSError:
            pass
        return f"cannot write cgroups under {CGROUP}: {e}"


def groups_of(pid):
    """The cgroups the hap-launch process `pid` made (other tests may run
    their own launches at the same time)."""
    try:
        return sorted(d for d in os.listdir(CGROUP) if d.startswith(f"hap-launch-{pid}-"))
    except OSError:
        return []


def step_times(out):
    return [float(m.group(1)) for m in re.finditer(r"^step \d+ loss \S+ time (\S+) s", out, re.M)]


def losses(out):
    return [m.group(1) for m in re.finditer(r"^step \d+ loss (\S+)", out, re.M)]


CGROUPS_PROBLEM = cgroups_writable()


def launch(plan, steps, extra=()):
    """Runs `plan` on the throttled ranks; returns rank 0's output. The
    cgroups hap-launch made are gone when it returns."""
    p = subprocess.Popen([LAUNCH, "--plan", plan, "--steps", str(steps), "--cpu-shares",
                          SHARES, "--pin-cores", "--threads", "1", "--executor", EXECUTOR,
                          *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=600)
    if p.returncode != 0:
        raise AssertionError(f"hap-launch failed ({p.returncode}): {err}")
    if groups_of(p.pid):
        raise AssertionError(f"hap-launch left cgroups behind: {groups_of(p.pid)}")
    return out


@unittest.skipIf(CGROUPS_PROBLEM, CGROUPS_PROBLEM)
class HeteroSpeedupTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = util.tmpdir()
        cluster = {"nodes": [{"name": "local", "devices": [
            {"id": "fast", "kind": "CPU", "model": "one core, 100%",
             "flops": [{"dtype": "FLOAT32", "flops": 5e10}], "memoryBytes": str(8 << 30),
             "node": "local"},
            {"id": "slow", "kind": "CPU", "model": "one core, 40%",
             "flops": [{"dtype": "FLOAT32", "flops": 2e10}], "memoryBytes": str(8 << 30),
             "node": "local", "localIndex": 1}]}],
            "defaults": {"intraNodeBandwidthBytesPerSecond": 2e9, "intraNodeLatencySeconds": 2e-5,
                         "interNodeBandwidthBytesPerSecond": 1e9, "interNodeLatencySeconds": 5e-5}}
        cls.cluster = os.path.join(cls.dir, "cluster.json")
        with open(cls.cluster, "w") as f:
            json.dump(cluster, f)
        for d in cluster["nodes"][0]["devices"]:
            d["flops"][0]["flops"] *= 4
        cls.overstated = os.path.join(cls.dir, "cluster-overstated.json")
        with open(cls.overstated, "w") as f:
            json.dump(cluster, f)
        cls.plans, cls.predicted = {}, {}
        cls.plan("hap", cls.cluster, [])
        cls.plan("dp-even", cls.cluster, ["--baseline", "dp-even"])
        # Calibration: each plan run three times with --profile, in turns,
        # then hapctl calibrate over all six runs. (Once each, a burst of
        # load on the machine during one profile moved the calibrated
        # prediction 26% off the later measurement, and the check below
        # failed.)
        runs = []
        for turn in range(3):
            for name in ("hap", "dp-even"):
                prefix = os.path.join(cls.dir, f"profile-{name}-{turn}")
                launch(cls.plans[name], 8, ["--profile", prefix])
                runs += ["--plan", cls.plans[name], "--profile", prefix]
        cls.calibrated = os.path.join(cls.dir, "cluster-calibrated.json")
        print(util.run([HAPCTL, "calibrate", "--cluster", cls.cluster, *runs,
                        "--out", cls.calibrated, "--op-scales", "per-kind"]).stdout)
        cls.plan("hap-cal", cls.calibrated, [])
        cls.plan("dp-even-cal", cls.calibrated, ["--baseline", "dp-even"])
        # The same runs calibrate the overstated profile.
        overstated_cal = os.path.join(cls.dir, "cluster-overstated-calibrated.json")
        util.run([HAPCTL, "calibrate", "--cluster", cls.overstated, *runs,
                  "--out", overstated_cal, "--op-scales", "per-kind"])
        cls.plan("dp-even-overstated", cls.overstated, ["--baseline", "dp-even"])
        cls.plan("dp-even-overstated-cal", overstated_cal, ["--baseline", "dp-even"])

    @classmethod
    def plan(cls, name, cluster, extra):
        path = os.path.join(cls.dir, f"{name}.pb")
        out = util.run([HAPCTL, "plan", "--cluster", cluster, *MODEL, "--save-plan", path,
                        "-o", "json", *extra]).stdout
        cls.plans[name] = path
        cls.predicted[name] = json.loads(out[out.index("{"):out.rindex("}") + 1])[
            "predicted_step_seconds"]

    def test_synthesized_plan_beats_even_data_parallel(self):
        times = {"hap-cal": [], "dp-even": []}
        first_losses = {}
        for _ in range(3):
            for name in ("hap-cal", "dp-even"):
                out = launch(self.plans[name], 8)
                ts = step_times(out)
                self.assertEqual(len(ts), 8, out)
                times[name] += ts[2:]  # after warm-up
                first_losses.setdefault(name, losses(out))
        hap, even = statistics.median(times["hap-cal"]), statistics.median(times["dp-even"])
        print(f"median step: synthesized (calibrated) {hap:.4f} s, dp-even {even:.4f} s, "
              f"speed-up {even / hap:.2f}x (ideal 1.75x)")
        self.assertGreater(even / hap, 1.2)
        # The same model and data: the same losses, whatever the plan.
        for a, b in zip(first_losses["hap-cal"], first_losses["dp-even"]):
            self.assertAlmostEqual(float(a), float(b), delta=1e-3 * abs(float(b)))
        # Calibration brings a prediction that is off close to what was
        # measured.
        def off(name):
            return abs(self.predicted[name] / even - 1)
        before, after = off("dp-even-overstated"), off("dp-even-overstated-cal")
        print(f"dp-even predicted {self.predicted['dp-even']:.4f} s on the hand-set profile "
              f"({100 * off('dp-even'):.0f}% off), {self.predicted['dp-even-cal']:.4f} s "
              f"calibrated ({100 * off('dp-even-cal'):.0f}% off); on the 4x overstated profile "
              f"{self.predicted['dp-even-overstated']:.4f} s ({100 * before:.0f}% off), "
              f"calibrated {self.predicted['dp-even-overstated-cal']:.4f} s "
              f"({100 * after:.0f}% off); calibrated HAP predicted "
              f"{self.predicted['hap-cal']:.4f} s, measured {hap:.4f} s")
        self.assertLess(after, before / 2)

    def test_bad_cpu_period_is_refused(self):
        # 0.4 of 2000 us is an 800 us quota, under the kernel's 1000 us.
        for period, why in (("500", "from 1000 to 1000000"),
                            ("2000", "under the kernel's minimum")):
            p = subprocess.Popen([LAUNCH, "--plan", self.plans["hap"], "--steps", "1",
                                  "--cpu-shares", SHARES, "--cpu-period-us", period,
                                  "--executor", EXECUTOR],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _, err = p.communicate(timeout=60)
            self.assertEqual(p.returncode, 2, err)
            self.assertIn(why, err)
            self.assertEqual(groups_of(p.pid), [])

    def test_cgroups_are_removed_after_an_interrupt(self):
        p = subprocess.Popen([LAUNCH, "--plan", self.plans["hap"], "--steps", "100000",
                              "--cpu-shares", SHARES, "--threads", "1", "--executor", EXECUTOR],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.time() + 120
            seen = False
            while time.time() < deadline and not seen:
                line = p.stdout.readline()
                if not line:
                    break
                seen = line.startswith("step 2 ")
            self.assertTrue(seen, "training did not start")
            self.assertEqual(len(groups_of(p.pid)), 2)
            p.send_signal(signal.SIGINT)
            p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.assertEqual(groups_of(p.pid), [])


if __name__ == "__main__":
    util.main("hetero_speedup_test", needs_torch=False)
