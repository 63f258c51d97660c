"""scripts/demo.sh --network: each rank a node of the network testbed. The
demo trains through the services with its agents and executors inside the
nodes' namespaces (their addresses are the nodes', 10.213.0.x) and the
planner in the switch namespace; after it ends, normally or on SIGINT, no
namespace of its pid remains. A set left by a demo killed outright (a stale
set made here with hap-netns for a process that is gone) is removed when the
next demo starts. A bad spec is refused (exit 2) before anything starts.

Root only: where namespaces cannot be made the demo falls back to loopback,
and the test skips with the demo's reason."""

import os
import re
import signal
import subprocess
import time
import unittest

ROOT = os.getcwd()  # the runfiles root: scripts/ and the binaries' packages
NETNS = os.path.join(ROOT, "executor", "cli", "hap-netns")
NETNS_DIR = "/var/run/netns"
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--seq", "16",
        "--batch", "8", "--data", "synthetic", "--no-paper-scale", "--shares", "1,0.5"]
CHECKPOINTS = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), "demo-net-checkpoints")
NETWORK = "between=1gbit pair=0-1:300mbit"


def namespaces_of(pid):
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(f"hapnet-{pid}-"))
    except OSError:
        return []


class DemoNetworkTest(unittest.TestCase):
    def start(self, steps, network=NETWORK):
        demo = subprocess.Popen(
            ["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--no-setup", "--bin-dir", ROOT,
             "--steps", str(steps), "--checkpoint-dir", CHECKPOINTS, "--network", network] + TINY,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.addCleanup(lambda: demo.poll() is None and demo.kill())
        return demo

    def read_until(self, demo, pattern, log, seconds=120):
        deadline = time.time() + seconds
        while time.time() < deadline:
            line = demo.stdout.readline()
            if not line:
                self.fail(f"demo ended before '{pattern}':\n{''.join(log)}")
            log.append(line)
            if "network testbed unavailable" in line:
                demo.kill()
                self.skipTest("no network testbed here: " + line.strip())
            m = re.search(pattern, line)
            if m:
                return m
        self.fail(f"no '{pattern}' within {seconds} s:\n{''.join(log)}")

    def stale_set(self):
        """The namespaces of a demo killed outright: made for a process that
        is gone."""
        gone = subprocess.Popen(["sleep", "60"])
        out = subprocess.run([NETNS, "up", "--owner", str(gone.pid), "--network", "nodes=2"],
                             capture_output=True, text=True)
        gone.kill()
        gone.wait()
        if out.returncode != 0:
            self.skipTest("no network testbed here: " + out.stderr.strip())
        self.addCleanup(lambda: subprocess.run([NETNS, "down", "--owner", str(gone.pid)]))
        self.assertEqual(len(namespaces_of(gone.pid)), 3)
        return gone.pid

    def test_trains_on_the_testbed_and_leaves_nothing(self):
        stale = self.stale_set()
        demo = self.start(steps=4)
        log = []
        self.read_until(demo, r"network testbed nodes=2 ", log)
        self.read_until(demo, r"rank 1: .*executor 10\.213\.0\.2:\d+", log)
        self.assertEqual(len(namespaces_of(demo.pid)), 3, "".join(log))
        # The stale set went when this demo made its own.
        self.assertEqual(namespaces_of(stale), [], "".join(log))
        rest, _ = demo.communicate(timeout=300)
        log.append(rest)
        self.assertEqual(demo.returncode, 0, "".join(log))
        self.assertRegex("".join(log), r"step +4/4 +loss")
        # node0's executor daemon logged its rank's last step and end.
        self.assertRegex("".join(log), r"hap-executor: deployments/\S+ generation \d+ rank \d: step 3 loss ")
        self.assertRegex("".join(log), r"hap-executor: deployments/\S+ generation \d+ rank \d: FINISHED, "
                         r"4 of 4 steps done")
        self.assertIn("metrics http://10.213.0.254:9464/metrics", "".join(log))
        self.assertEqual(namespaces_of(demo.pid), [], "".join(log))

    def test_sigint_removes_the_namespaces(self):
        demo = self.start(steps=100000)
        log = []
        self.read_until(demo, r"step +\d+/100000", log, seconds=180)
        self.assertEqual(len(namespaces_of(demo.pid)), 3, "".join(log))
        demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=60)
        log.append(rest)
        self.assertEqual(demo.returncode, 130, "".join(log))
        self.assertEqual(namespaces_of(demo.pid), [], "".join(log))

    def test_a_bad_spec_is_refused(self):
        demo = self.start(steps=4, network="between=1gbps")
        out, _ = demo.communicate(timeout=60)
        self.assertEqual(demo.returncode, 2, out)
        self.assertIn("demo: --network: network: between: rate '1gbps'", out)
        self.assertEqual(namespaces_of(demo.pid), [])


if __name__ == "__main__":
    unittest.main(verbosity=2)
