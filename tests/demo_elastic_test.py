"""scripts/demo.sh --elastic (issue 19): three ranks at different CPU shares
train a job; a third of the way in one node's agent and executor are
SIGKILLed, the job re-plans onto the other two and goes on; the node is
started again, rejoins, and the job re-plans onto all three when its
calibrated prediction clears min_gain (else the demo prints why). It ends
with one line, `elastic: job SUCCEEDED; replans N; recovery S s (max);
steps lost K`, and leaves no process, cgroup or state directory behind.

Run with the already built binaries (--no-setup --bin-dir) on synthetic
data, 600 steps, a checkpoint every 50, --join-stable 2: about 90 s here.
Where cgroups cannot be written the demo runs its fallback (unthrottled
ranks); the job's re-plans are checked all the same."""

import os
import re
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_cleanup_test import processes_mentioning  # noqa: E402

ROOT = os.getcwd()  # the runfiles root: scripts/ and the binaries' packages
CGROUP = "/sys/fs/cgroup/cpu"
EVERY = 50
CHECKPOINTS = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), "demo-checkpoints")


class DemoElasticTest(unittest.TestCase):
    def test_loses_a_node_goes_on_and_takes_it_back(self):
        demo = subprocess.Popen(
            ["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--no-setup", "--bin-dir", ROOT,
             "--elastic", "--data", "synthetic", "--steps", "600", "--checkpoint-every",
             str(EVERY), "--join-stable", "2", "--checkpoint-dir", CHECKPOINTS],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self.addCleanup(lambda: demo.poll() is None and demo.kill())
        out, _ = demo.communicate(timeout=600)
        print(out[-4000:], file=sys.stderr)  # the timeline, in the test log
        self.assertEqual(demo.returncode, 0, out)
        lines = out.rstrip("\n").split("\n")
        last = re.fullmatch(r"elastic: job (\w+); replans (\d+); recovery ([0-9.]+) s \(max\); "
                            r"steps lost (\d+)", lines[-1])
        self.assertTrue(last, out)
        self.assertEqual(last.group(1), "SUCCEEDED", out)
        # The loss, then the return: two re-plans, nothing else. The return
        # is the planner's judgement (its calibrated prediction must clear
        # min_gain 10%): where it did not, the demo says why.
        # A slowdown re-plan (the machine's load changing under the ranks)
        # that paid by the calibrated model adds one each.
        slowdowns = len(re.findall(r" SLOWDOWN ", out))
        rejoined = "node1 rejoined: training on 3 devices" in out
        if rejoined:
            self.assertEqual(int(last.group(2)), 2 + slowdowns, out)
            self.assertIn("NODE_JOINED", out)
            self.assertRegex(out, r"step  600/600  SUCCEEDED  generation %d on 3 devices"
                             % (3 + slowdowns))
        else:
            self.assertEqual(int(last.group(2)), 1 + slowdowns, out)
            self.assertRegex(out, r"node1 did not rejoin before the job ended; the job's last "
                                  r"judgement of a join:\n   staying: plans/demo-p\d+ on 3 devices "
                                  r"is (predicted|expected) -?[0-9.]+% faster .*below min_gain")
            print("note: the planner judged the return not worth it", file=sys.stderr)
        # Failure seen -> training again, each time.
        self.assertLess(float(last.group(3)), 10, out)
        self.assertGreater(float(last.group(3)), 0, out)
        # Each re-plan loses at most the steps since the last checkpoint
        # (and those trained while the failure was being detected).
        self.assertLessEqual(int(last.group(4)), 2 * (EVERY + 60), out)
        self.assertRegex(out, r"SIGKILL node1's agent \(pid \d+\) and executor")
        self.assertRegex(out, r"training again on 2 devices, [0-9.]+ s after the SIGKILL")
        # The loss is an event of its own, a slowdown switch under way when
        # node1 died too (its recovery met the loss: seen once in CI, the
        # SLOWDOWN event then ends there, cut short, and the loss follows).
        self.assertRegex(out, r"EXECUTOR_LOST|NODE_STALE")
        self.assertNotRegex(out, r" SLOWDOWN .*then, while recovering")
        # Nothing left: processes, cgroups, the state directory.
        state = re.search(r"state in (\S+)", out).group(1)
        for _ in range(50):
            if not processes_mentioning(state):
                break
            time.sleep(0.1)
        self.assertEqual(processes_mentioning(state), [], out)
        self.assertFalse(os.path.exists(state), out)
        try:
            left = [d for d in os.listdir(CGROUP) if d.startswith(f"hap-demo-{demo.pid}-")]
        except OSError:
            left = []
        self.assertEqual(left, [], out)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
