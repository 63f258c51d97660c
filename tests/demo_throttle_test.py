"""scripts/demo.sh --elastic --throttle (issue 19, slowdowns): three ranks at
CPU shares 0.7/1/0.3 train a job; a third of the way in node1's cgroup
quota is lowered to 0.2 of its core. The job sees its step slow down,
recalibrates its devices from the executors' profiles of the slow steps,
re-plans on the same devices and switches at the next checkpoint: the new
plan gives node1 a smaller share of the batch, and its measured step is
better than the old plan's measured after the throttle (both measured in
this run: the slowdown's judgement gives the old plan's median over its
last 20 steps, the demo the new deployment's median).

Skipped where cgroups cannot be written (not root, no cgroup v1 cpu
controller): without a quota there is nothing to throttle."""

import os
import re
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_cleanup_test import processes_mentioning  # noqa: E402

ROOT = os.getcwd()  # the runfiles root: scripts/ and the binaries' packages
CGROUP = "/sys/fs/cgroup/cpu"
CHECKPOINTS = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), "demo-checkpoints")


def cgroups_writable():
    probe = os.path.join(CGROUP, f"hap-throttle-test-{os.getpid()}")
    try:
        os.mkdir(probe)
    except OSError as e:
        return f"cannot make a cgroup under {CGROUP}: {e}"
    try:
        with open(os.path.join(probe, "cpu.cfs_quota_us"), "w") as f:
            f.write("10000\n")
    except OSError as e:
        return f"cannot set a cgroup's cpu.cfs_quota_us: {e}"
    finally:
        os.rmdir(probe)
    return ""


class DemoThrottleTest(unittest.TestCase):
    def test_a_throttled_node_gets_a_smaller_share_and_the_step_improves(self):
        why = cgroups_writable()
        if why:
            self.skipTest(why)
        demo = subprocess.Popen(
            ["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--no-setup", "--bin-dir", ROOT,
             "--elastic", "--throttle", "0.2", "--data", "synthetic", "--steps", "300", "--batch", "64",
             "--checkpoint-every", "40", "--checkpoint-dir", CHECKPOINTS],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self.addCleanup(lambda: demo.poll() is None and demo.kill())
        out, _ = demo.communicate(timeout=600)
        print(out[-6000:], file=sys.stderr)  # the timeline, in the test log
        self.assertEqual(demo.returncode, 0, out)
        self.assertIn("node1 throttled to 0.2 of its core", out)
        last = out.rstrip("\n").split("\n")[-1]
        self.assertRegex(last, r"^elastic: job SUCCEEDED; replans [1-9]", out)
        # The slowdown (the step measured, or node1's agent re-probing it
        # slower), judged on the old plan's last 20 steps after it. On a
        # loaded machine a slowdown of noise may come first (a step median
        # 25% above the expected before any throttle): the throttle's is the
        # switch that moved work off node1 and ran faster than the old plan
        # after it.
        slows = re.findall(r"SLOWDOWN .*?(plans/demo-p\d+) is expected [-0-9.]+% faster "
                           r"\(measured ([0-9.]+) s over the last 20 steps", out)
        self.assertTrue(slows, out)
        ratios = {m.group(1): m.group(2) for m in
                  re.finditer(r"^   (plans/demo-p\d+) ratios: (.*)$", out, re.M)}
        measured = {m.group(1): (m.group(2), float(m.group(3)), float(m.group(4))) for m in
                    re.finditer(r"^   (plans/demo-p\d+) on \d+ devices: (\w+) prediction "
                                r"([0-9.]+) s, measured median ([0-9.]+) s", out, re.M)}
        plans = list(measured)

        def share(plan, device):
            return float(re.search(re.escape(device) + r" ([0-9.]+)", ratios[plan]).group(1))

        found = None
        for new_plan, after in slows:
            self.assertIn(new_plan, plans, out)
            self.assertGreater(plans.index(new_plan), 0, out)
            old_plan = plans[plans.index(new_plan) - 1]
            kind, predicted, new_measured = measured[new_plan]
            self.assertEqual(kind, "calibrated", out)
            if (new_measured < float(after) and
                    share(new_plan, "node1/cpu0") < share(old_plan, "node1/cpu0")):
                found = (old_plan, new_plan, float(after), predicted, new_measured)
        self.assertIsNotNone(found, "no slowdown switch moved work off node1 and ran faster "
                             "than the old plan after the throttle:\n" + out)
        old_plan, new_plan, old_after, predicted, new_measured = found
        print("throttle: old plan after the throttle %.4f s, new plan %.4f s (calibrated "
              "prediction %.4f s, %+.0f%%); node1's share %.3f -> %.3f" % (
                  old_after, new_measured, predicted, 100 * (predicted - new_measured) /
                  new_measured, share(old_plan, "node1/cpu0"), share(new_plan, "node1/cpu0")),
              file=sys.stderr)
        # Nothing left: processes, the state directory, cgroups.
        state = re.search(r"state in (\S+)", out).group(1)
        self.assertEqual(processes_mentioning(state), [], out)
        self.assertFalse(os.path.exists(state), out)
        left = [d for d in os.listdir(CGROUP) if d.startswith(f"hap-demo-{demo.pid}-")]
        self.assertEqual(left, [], out)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
