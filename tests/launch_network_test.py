"""hap-launch --network (issue 17 item 1): the ranks of a plan for two nodes
of two CPUs each run in two network namespaces joined at 1 Gbit/s, talking
over Gloo on their node's address, and train with the losses of the same
plan on loopback. The launcher removes its namespaces when the ranks end and
on SIGINT; a launcher SIGKILLed mid-run leaves them (its ranks die with it),
and the next hap-launch --network removes them.

Root only: where namespaces cannot be made the tests skip with the reason."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from proc_util import wait_gone

HAPCTL = os.environ["HAPCTL"]
LAUNCH = os.environ["HAP_LAUNCH"]
CLUSTER = os.environ["CPU_CLUSTER"]  # one node of four CPUs: split in two below
NETNS_DIR = "/var/run/netns"
NETWORK = "between=1gbit inside=10gbit"
TMP = os.environ.get("TEST_TMPDIR", tempfile.gettempdir())


def namespaces_of(pid):
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(f"hapnet-{pid}-"))
    except OSError:
        return []


def netns_pids(name):
    out = subprocess.run(["/usr/sbin/ip", "netns", "pids", name], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def losses(text):
    return [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)", text, re.M)]


class LaunchNetworkTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(CLUSTER) as f:
            cluster = json.load(f)
        devices = cluster["nodes"][0]["devices"]
        cluster["nodes"] = [{"name": "node0", "devices": devices[:2]},
                            {"name": "node1", "devices": devices[2:4]}]
        cls.cluster = os.path.join(TMP, "two-nodes.json")
        with open(cls.cluster, "w") as f:
            json.dump(cluster, f)
        cls.plan = os.path.join(TMP, "mlp-4.pb")
        subprocess.run([HAPCTL, "plan", "--cluster", cls.cluster, "--model", "mlp",
                        "--save-plan", cls.plan], check=True, capture_output=True)

    def launch(self, *extra, log="launch.log"):
        """Starts hap-launch with its output in a file (ranks left behind by
        a SIGKILL keep a pipe open)."""
        path = os.path.join(TMP, log)
        out = open(path, "w")
        p = subprocess.Popen([LAUNCH, "--plan", self.plan, "--data", "synthetic", *extra],
                             stdout=out, stderr=subprocess.STDOUT,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        out.close()
        self.addCleanup(lambda: p.poll() is None and p.kill())
        return p, path

    def wait_for(self, path, pattern, p, seconds=60):
        deadline = time.time() + seconds
        while time.time() < deadline:
            with open(path) as f:
                text = f.read()
            m = re.search(pattern, text, re.M)
            if m:
                return text
            if p.poll() is not None:
                self.fail(f"hap-launch ended ({p.returncode}) before '{pattern}':\n{text}")
            time.sleep(0.1)
        self.fail(f"no '{pattern}' within {seconds} s")

    def skip_unless_testbed(self, text):
        for reason in ("needs root", "cannot make network namespaces", "needs 'ip'", "needs 'tc'"):
            if reason in text:
                self.skipTest("no network testbed here: " + text.strip().splitlines()[-1])

    def run_to_end(self, *extra, log):
        p, path = self.launch(*extra, log=log)
        rc = p.wait(timeout=120)
        with open(path) as f:
            text = f.read()
        self.skip_unless_testbed(text)
        self.assertEqual(rc, 0, text)
        return p.pid, text

    def test_trains_across_namespaces_with_the_losses_of_loopback(self):
        pid, text = self.run_to_end("--steps", "3", "--network", NETWORK, log="net.log")
        self.assertIn(f"node 0 = namespace hapnet-{pid}-n0 at 10.213.0.1, ranks 0 1", text)
        self.assertIn(f"node 1 = namespace hapnet-{pid}-n1 at 10.213.0.2, ranks 2 3", text)
        self.assertEqual(namespaces_of(pid), [], "namespaces left after the run")
        _, plain = self.run_to_end("--steps", "3", log="plain.log")
        self.assertEqual(len(losses(text)), 3, text)
        self.assertEqual(losses(text), losses(plain))

    def test_bad_network_specs_are_refused_before_anything_is_made(self):
        for spec, error in [("nodes=1", "nodes=1 but the ranks are on 2 nodes"),
                            ("ranks=0,1", "ranks= places 2 ranks, the plan has 4"),
                            ("between=1gbps", "rate '1gbps'")]:
            p, path = self.launch("--steps", "1", "--network", spec, log="bad.log")
            self.assertEqual(p.wait(timeout=60), 2)
            with open(path) as f:
                self.assertIn(error, f.read())
            self.assertEqual(namespaces_of(p.pid), [])

    def test_sigint_removes_the_namespaces(self):
        p, path = self.launch("--steps", "1000000", "--network", NETWORK, log="sigint.log")
        self.skip_unless_testbed(self.wait_for(path, r"^step 1 |error", p))
        self.assertEqual(len(namespaces_of(p.pid)), 3)  # two nodes and the switch
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
        self.assertEqual(namespaces_of(p.pid), [])

    def test_a_killed_launchers_namespaces_and_ranks_go_at_the_next_start(self):
        p, path = self.launch("--steps", "1000000", "--network", NETWORK, log="killed.log")
        self.skip_unless_testbed(self.wait_for(path, r"^step 1 |error", p))
        ranks = netns_pids(f"hapnet-{p.pid}-n1")
        self.assertEqual(len(ranks), 2, "node 1 should hold ranks 2 and 3")
        p.kill()
        p.wait()
        # Nothing could clean up: the set is still there. The ranks die with
        # their launcher (they ran on until their peers timed out).
        self.assertEqual(len(namespaces_of(p.pid)), 3)
        self.assertEqual(wait_gone(ranks, 30), [], "the killed launcher's ranks still run")
        _, text = self.run_to_end("--steps", "2", "--network", NETWORK, log="next.log")
        self.assertIn(f"removed hapnet-{p.pid}-n1, left by a run that is gone", text)
        self.assertEqual(namespaces_of(p.pid), [])
        # SIGKILLed: gone once the kernel has reaped them.
        self.assertEqual(wait_gone(ranks, 5), [], "the killed run's ranks still run")


if __name__ == "__main__":
    unittest.main(verbosity=2)
