"""bench/checkpoint_bench.py works in a fresh folder of its own under --dir:
it never deletes what --dir already holds, and a worker that fails stops it
with the worker's message and nothing left behind."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_bench.py")


class CheckpointBenchTest(unittest.TestCase):
    def setUp(self):
        # The script in a tree of its own, whose bazel-bin holds a worker that
        # writes some of a checkpoint and fails.
        self.tree = tempfile.TemporaryDirectory()
        self.addCleanup(self.tree.cleanup)
        d = self.tree.name
        os.makedirs(os.path.join(d, "bench"))
        self.script = os.path.join(d, "bench", "checkpoint_bench.py")
        shutil.copy(SCRIPT, self.script)
        os.makedirs(os.path.join(d, "bazel-bin", "bench"))
        worker = os.path.join(d, "bazel-bin", "bench", "checkpoint_worker")
        with open(worker, "w") as f:
            f.write('#!/bin/sh\n'
                    'while [ $# -gt 0 ]; do [ "$1" = --dir ] && mkdir -p "$2" && '
                    'echo x >"$2/shard"; shift; done\n'
                    'echo "checkpoint_worker: disk full" >&2\nexit 1\n')
        os.chmod(worker, 0o755)
        self.scratch = os.path.join(d, "scratch")
        os.mkdir(self.scratch)
        with open(os.path.join(self.scratch, "keep.txt"), "w") as f:
            f.write("someone's file\n")

    def run_bench(self, *args):
        return subprocess.run([sys.executable, self.script, "--dir", self.scratch, *args],
                              capture_output=True, text=True)

    def test_a_failing_worker_keeps_the_dir_and_leaves_nothing(self):
        p = self.run_bench()
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("checkpoint_worker: disk full", p.stderr)
        self.assertNotIn("Traceback", p.stderr)
        self.assertEqual(os.listdir(self.scratch), ["keep.txt"])

    def test_bad_rounds_are_refused(self):
        p = self.run_bench("--rounds", "0")
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--rounds must be at least 1", p.stderr)
        self.assertEqual(os.listdir(self.scratch), ["keep.txt"])

if __name__ == "__main__":
    unittest.main()
