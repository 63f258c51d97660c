"""The cluster benchmarks (bench/e2e/e2e_bench.py,
bench/pipeline_testbed_bench.py, bench/elastic_bench.py) leave no state
folder behind when they stop before they start anything: a refused option, or
no writable cgroups; a bad option is refused with a message, not a
traceback."""

import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
E2E = os.path.join(HERE, "e2e", "e2e_bench.py")
PIPEBED = os.path.join(HERE, "pipeline_testbed_bench.py")
ELASTIC = os.path.join(HERE, "elastic_bench.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "e2e"))
import e2e_bench  # noqa: E402
import pipeline_testbed_bench  # noqa: E402

BINARIES = ("tools/hapctl", "executor/cli/hap-launch", "executor/cli/hap-executor",
            "planner/service/hap-planner", "profiler_agent/hap-agent")


class StateTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        # Stand-ins for the programs: they are checked, never run here.
        self.bin = os.path.join(self.dir.name, "bin")
        for b in BINARIES:
            path = os.path.join(self.bin, b)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write("#!/bin/sh\nexit 1\n")
            os.chmod(path, 0o755)
        self.tmp = os.path.join(self.dir.name, "tmp")
        os.mkdir(self.tmp)

    def test_a_refused_weight_leaves_no_state(self):
        env = dict(os.environ, TMPDIR=self.tmp)
        p = subprocess.run([sys.executable, E2E, "--bin-dir", self.bin, "--weight", "1"],
                           capture_output=True, text=True, env=env)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--weight must be 0 or within 2..262144", p.stderr)
        self.assertEqual(os.listdir(self.tmp), [])

    def run_without_cgroups(self, module, argv):
        """module.main() with argv and no cgroup controller: it must stop
        with a message and leave TMPDIR empty."""
        saved = (e2e_bench.CGROUP_ROOT, tempfile.tempdir, sys.argv)
        e2e_bench.CGROUP_ROOT = os.path.join(self.dir.name, "no-cgroups")
        tempfile.tempdir = self.tmp
        sys.argv = argv
        try:
            with self.assertRaises(SystemExit) as e:
                module.main()
        finally:
            e2e_bench.CGROUP_ROOT, tempfile.tempdir, sys.argv = saved
        self.assertIn("cannot write cgroups", str(e.exception.code))
        self.assertEqual(os.listdir(self.tmp), [])

    def test_e2e_bench_without_cgroups_leaves_no_state(self):
        self.run_without_cgroups(e2e_bench, [E2E, "--bin-dir", self.bin])

    def test_pipeline_testbed_bench_without_cgroups_leaves_no_state(self):
        self.run_without_cgroups(pipeline_testbed_bench, [PIPEBED, "--bin-dir", self.bin])

    def test_pipeline_testbed_bench_refuses_bad_counts_up_front(self):
        saved = (e2e_bench.CGROUP_ROOT, tempfile.tempdir, sys.argv)
        e2e_bench.CGROUP_ROOT = os.path.join(self.dir.name, "no-cgroups")
        tempfile.tempdir = self.tmp
        try:
            for args in (["--rounds", "0"], ["--steps", "0"], ["--warmup", "-1"],
                         ["--configs", "spmd,spmd,dp-prop"]):
                sys.argv = [PIPEBED, "--bin-dir", self.bin, *args]
                with self.assertRaises(SystemExit) as e:
                    pipeline_testbed_bench.main()
                # argparse's error: exit status 2, before the cgroup check.
                self.assertEqual(e.exception.code, 2, args)
        finally:
            e2e_bench.CGROUP_ROOT, tempfile.tempdir, sys.argv = saved
        self.assertEqual(os.listdir(self.tmp), [])

    def test_pipeline_testbed_bench_models_are_flags_hapctl_plan_takes(self):
        # The default was passed as 'gpt --layers 4 ...', and hapctl plan
        # refuses a bare word: every run died at its first plan.
        self.assertEqual(pipeline_testbed_bench.model_flags("gpt --layers 2")[:2],
                         ["--model", "gpt"])
        self.assertEqual(pipeline_testbed_bench.model_flags("--graph g.json"),
                         ["--graph", "g.json"])
        hapctl = os.environ.get("HAPCTL")
        cluster = os.environ.get("CLUSTER")
        if not hapctl or not cluster:
            self.skipTest("HAPCTL and CLUSTER name the real hapctl and a cluster (bazel test)")
        p = subprocess.run([hapctl, "plan", "--cluster", cluster,
                            *pipeline_testbed_bench.model_flags(
                                pipeline_testbed_bench.DEFAULT_MODEL),
                            "--pipeline", "auto", "-o", "table"],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("predicted step", p.stdout)

    def test_e2e_bench_refuses_a_configuration_named_twice(self):
        # Named twice, a configuration had two medians per round, and its
        # per-round ratios paired round r of the baseline with its r-th run.
        saved = (e2e_bench.CGROUP_ROOT, tempfile.tempdir, sys.argv)
        e2e_bench.CGROUP_ROOT = os.path.join(self.dir.name, "no-cgroups")
        tempfile.tempdir = self.tmp
        sys.argv = [E2E, "--bin-dir", self.bin, "--configs", "hap,dp-even,hap"]
        try:
            with self.assertRaises(SystemExit) as e:
                e2e_bench.main()
        finally:
            e2e_bench.CGROUP_ROOT, tempfile.tempdir, sys.argv = saved
        self.assertEqual(e.exception.code, 2)
        self.assertEqual(os.listdir(self.tmp), [])

    def test_elastic_bench_refuses_bad_options_and_leaves_no_state(self):
        env = dict(os.environ, TMPDIR=self.tmp)
        for args, message in ((["--shares", "a,b,c"], "--shares needs three numbers"),
                              (["--shares", "0.5,0,1"], "--shares needs three numbers"),
                              (["--rounds", "0"], "--rounds must be at least 1"),
                              (["--bin-dir", os.path.join(self.dir.name, "none")],
                               "missing binary")):
            p = subprocess.run([sys.executable, ELASTIC, "--bin-dir", self.bin, *args],
                               capture_output=True, text=True, env=env)
            self.assertEqual(p.returncode, 2, (args, p.stderr))
            self.assertIn(message, p.stderr, args)
            self.assertNotIn("Traceback", p.stderr, args)
            self.assertEqual(os.listdir(self.tmp), [], args)


if __name__ == "__main__":
    unittest.main()
