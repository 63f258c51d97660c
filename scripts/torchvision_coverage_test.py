"""scripts/torchvision_coverage.py: a model that exports is reported ok with
PyTorch's parameter count, one that cannot be built or exported is a FAIL
line naming why, and the exit status says whether any failed."""

import os
import subprocess
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "torchvision_coverage.py")


def run(*names):
    p = subprocess.run(["/usr/bin/python3", SCRIPT, *names],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=600)
    return p.returncode, p.stdout


class TorchvisionCoverageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        try:
            import torchvision  # noqa: F401
        except ImportError:
            raise unittest.SkipTest("python3-torchvision is not installed "
                                    "(scripts/setup.sh installs it)")

    def test_models_that_export_are_ok_with_pytorchs_parameter_count(self):
        rc, out = run("squeezenet1_1", "googlenet")
        self.assertEqual(rc, 0, out)
        lines = out.splitlines()
        # googlenet's two auxiliary classifiers are trained too: all of
        # PyTorch's 9,960,638 parameters are in the graph.
        self.assertRegex(lines[0], r"^squeezenet1_1 +ok .* 727626 parameters")
        self.assertRegex(lines[1], r"^googlenet +ok .* 9960638 parameters")
        self.assertEqual(lines[-1], "2 of 2 export")

    def test_a_model_that_fails_is_named_with_why_and_exits_1(self):
        rc, out = run("squeezenet1_1", "no_such_net")
        self.assertEqual(rc, 1, out)
        self.assertRegex(out, r"no_such_net +FAIL .*AttributeError")
        self.assertIn("1 of 2 export; failed: no_such_net", out)

    def test_every_classifier_builder_is_listed(self):
        import sys
        sys.path.insert(0, os.path.dirname(SCRIPT))
        import torchvision_coverage as C
        names = C.builders()
        self.assertIn("resnet18", names)
        self.assertIn("swin_v2_t", names)
        self.assertNotIn("list_models", names)
        self.assertNotIn("get_model", names)
        # Debian's torchvision 0.14 has 80 classification builders.
        self.assertGreaterEqual(len(names), 80)


if __name__ == "__main__":
    unittest.main()
