"""bench/step_bench.py refuses bad options and a missing worker up front, with
a message and exit status 2, before it starts any worker (no traceback, no
empty table reported as a run)."""

import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_bench.py")


class StepBenchArgsTest(unittest.TestCase):
    def test_bad_options_are_refused(self):
        with tempfile.TemporaryDirectory() as d:
            # A worker that notes it was started, and fails.
            worker = os.path.join(d, "worker")
            started = os.path.join(d, "started")
            with open(worker, "w") as f:
                f.write("#!/bin/sh\ntouch %s\nexit 1\n" % started)
            os.chmod(worker, 0o755)
            for args, message in (
                    (["--rounds", "0"], "--rounds must be at least 1"),
                    (["--steps", "0"], "--steps must be at least 1"),
                    (["--threads", "1,x"], "--threads needs positive integers"),
                    (["--threads", "0"], "--threads needs positive integers"),
                    (["--models", "resnet"], "--models: no configuration of resnet"),
                    (["--pause", "-1"], "--pause must not be negative"),
                    (["--worker", os.path.join(d, "none")], "no step_worker at")):
                argv = ["--worker", worker] + args
                p = subprocess.run([sys.executable, SCRIPT] + argv, capture_output=True,
                                   text=True)
                self.assertEqual(p.returncode, 2, (args, p.stderr))
                self.assertIn(message, p.stderr, args)
                self.assertNotIn("Traceback", p.stderr, args)
                self.assertFalse(os.path.exists(started), args)


if __name__ == "__main__":
    unittest.main()
