"""count_tests.py counts one bazel invocation's results from its build event
file: last attempts only, XML-less results by status, targets that did not
build as failures, incompatible (skipped) targets not at all, and no stale
XML that bazel-testlogs still holds."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

COUNT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "count_tests.py")


def suite(path, cases):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    body = []
    for name, kind in cases:
        inner = {"pass": "", "fail": "<failure message='x'/>",
                 "skip": "<skipped/>"}[kind]
        body.append("<testcase classname='S' name='%s'>%s</testcase>" % (name, inner))
    with open(path, "w") as f:
        f.write("<testsuites><testsuite>%s</testsuite></testsuites>" % "".join(body))


def result(label, xml, status, shard=1, attempt=1):
    outputs = [{"name": "test.log", "uri": "file:///dev/null"}]
    if xml:
        outputs.append({"name": "test.xml", "uri": "file://" + xml})
    return {"id": {"testResult": {"label": label, "run": 1, "shard": shard,
                                  "attempt": attempt}},
            "testResult": {"testActionOutput": outputs, "status": status}}


def finished(name="SUCCESS", code=0):
    """bazel's last event: its exit code (JSON leaves out a code of 0)."""
    exit_code = {"name": name}
    if code:
        exit_code["code"] = code
    return {"id": {"buildFinished": {}}, "finished": {"exitCode": exit_code}}


def completed(label, success=None, aborted=None):
    e = {"id": {"targetCompleted": {"label": label}}}
    if success is not None:
        e["completed"] = {"success": success}
    if aborted is not None:
        e["aborted"] = {"reason": aborted}
    return e


class CountTestsTest(unittest.TestCase):
    def run_count(self, args):
        p = subprocess.run([sys.executable, COUNT] + args, capture_output=True, text=True)
        return p.returncode, p.stdout.strip().splitlines()

    def test_counts_this_invocation_only(self):
        with tempfile.TemporaryDirectory() as d:
            a = os.path.join(d, "logs/a/test.xml")
            suite(a, [("one", "pass"), ("two", "pass"), ("gpu", "skip")])
            s1 = os.path.join(d, "logs/b/shard_1_of_2/test.xml")
            s2 = os.path.join(d, "logs/b/shard_2_of_2/test.xml")
            suite(s1, [("x", "pass")])
            suite(s2, [("y", "pass")])
            # Stale: a shard of an earlier shard_count, and a deleted target.
            suite(os.path.join(d, "logs/b/shard_1_of_4/test.xml"), [("old", "fail")])
            suite(os.path.join(d, "logs/gone/test.xml"), [("old", "fail")] * 50)
            flaky_1 = os.path.join(d, "logs/c/attempt_1.xml")
            flaky_2 = os.path.join(d, "logs/c/test.xml")
            suite(flaky_1, [("f", "fail")])
            suite(flaky_2, [("f", "pass")])
            events = [
                completed("//:a", success=True), result("//:a", a, "PASSED"),
                result("//:b", s1, "PASSED", shard=1), result("//:b", s2, "PASSED", shard=2),
                result("//:c", flaky_1, "FAILED", attempt=1),
                result("//:c", flaky_2, "PASSED", attempt=2),
                result("//:sh", None, "PASSED"),        # a test that wrote no XML
                completed("//:gpu_only", aborted="SKIPPED"),  # incompatible here
                finished(),
            ]
            bep = os.path.join(d, "bep.json")
            with open(bep, "w") as f:
                f.write("\n".join(json.dumps(e) for e in events) + "\n")
            rc, out = self.run_count(["--bep", bep])
            self.assertEqual(out[-1], "6 passed, 0 failed", out)
            self.assertEqual(out[-2], "1 skipped (each says why in its test log)")
            self.assertEqual(rc, 0)
            # The old walk over the log directory counts the stale XML too.
            rc, out = self.run_count([os.path.join(d, "logs")])
            self.assertEqual(out[-1], "5 passed, 51 failed", out)
            self.assertEqual(rc, 1)

    def test_failures_and_broken_builds(self):
        with tempfile.TemporaryDirectory() as d:
            x = os.path.join(d, "x/test.xml")
            suite(x, [("ok", "pass"), ("bad", "fail")])
            fuzz = os.path.join(d, "fuzz/test.xml")
            suite(fuzz, [("graph", "pass")])
            events = [
                result("//:x", x, "FAILED"),
                result("//:crash", None, "FAILED"),    # died before writing XML
                completed("//:broken", success=False),  # did not compile
                completed("//:stopped", aborted="INCOMPLETE"),
                finished("BUILD_FAILURE", 1),  # explained by the above: not counted again
            ]
            bep = os.path.join(d, "bep.json")
            with open(bep, "w") as f:
                f.write("\n".join(json.dumps(e) for e in events) + "\n")
            rc, out = self.run_count(["--bep", bep, os.path.join(d, "fuzz")])
            self.assertEqual(out[-1], "2 passed, 4 failed", out)
            self.assertIn("FAILED: S.bad", out)
            self.assertIn("FAILED: //:crash (FAILED, no test.xml)", out)
            self.assertIn("FAILED: //:broken (did not build)", out)
            self.assertEqual(rc, 1)
            # Nothing ran, bazel did not even start: a failure too.
            empty = os.path.join(d, "empty.json")
            open(empty, "w").close()
            rc, out = self.run_count(["--bep", empty])
            self.assertEqual((rc, out[-1]), (1, "0 passed, 1 failed"))

    def test_a_failed_status_is_a_failure_whatever_its_xml_says(self):
        # A gtest binary that wrote its XML (every case passed) and then
        # crashed on exit, or a timeout after the XML: bazel says FAILED.
        with tempfile.TemporaryDirectory() as d:
            x = os.path.join(d, "x/test.xml")
            suite(x, [("a", "pass"), ("b", "pass")])
            t = os.path.join(d, "t/test.xml")
            suite(t, [("c", "pass")])
            bep = os.path.join(d, "bep.json")
            with open(bep, "w") as f:
                f.write(json.dumps(result("//:x", x, "FAILED")) + "\n" +
                        json.dumps(result("//:t", t, "TIMEOUT")) + "\n" +
                        json.dumps(finished("TESTS_FAILED", 3)) + "\n")
            rc, out = self.run_count(["--bep", bep])
            self.assertEqual(out[-1], "3 passed, 2 failed", out)
            self.assertIn("FAILED: //:x (FAILED, though its test.xml shows no failure)", out)
            self.assertIn("FAILED: //:t (TIMEOUT, though its test.xml shows no failure)", out)
            self.assertEqual(rc, 1)

    def test_disabled_gtest_cases_are_not_passes(self):
        # googletest writes a DISABLED_ test as status="notrun"
        # result="suppressed", with no <skipped> element.
        with tempfile.TemporaryDirectory() as d:
            x = os.path.join(d, "x/test.xml")
            os.makedirs(os.path.dirname(x))
            with open(x, "w") as f:
                f.write("<testsuites><testsuite name='S'>"
                        "<testcase name='Runs' status='run' result='completed' classname='S'/>"
                        "<testcase name='DISABLED_Off' status='notrun' result='suppressed'"
                        " classname='S'/>"
                        "</testsuite></testsuites>")
            rc, out = self.run_count([os.path.join(d, "x")])
            self.assertEqual(out[-1], "1 passed, 0 failed", out)
            self.assertEqual(out[-2], "1 skipped (each says why in its test log)")
            self.assertEqual(rc, 0)

    def test_an_unreadable_build_event_file_still_ends_with_the_count(self):
        # bazel killed mid-write (a truncated last line), or never started
        # (no file): a clear message and the plain last line, no traceback.
        with tempfile.TemporaryDirectory() as d:
            x = os.path.join(d, "x/test.xml")
            suite(x, [("a", "pass")])
            bep = os.path.join(d, "bep.json")
            with open(bep, "w") as f:
                f.write(json.dumps(result("//:x", x, "PASSED")) + '\n{"id": {"testRes')
            rc, out = self.run_count(["--bep", bep])
            self.assertEqual(out[-1], "1 passed, 1 failed", out)
            self.assertTrue(any(l.startswith("FAILED: %s (line 2 is not JSON" % bep)
                                for l in out), out)
            self.assertEqual(rc, 1)
            missing = os.path.join(d, "none.json")
            rc, out = self.run_count(["--bep", missing])
            self.assertEqual(out[-1], "0 passed, 1 failed", out)
            self.assertTrue(any(l.startswith("FAILED: %s (cannot read it" % missing)
                                for l in out), out)
            self.assertEqual(rc, 1)

    def test_a_named_directory_without_results_is_a_failure(self):
        # scripts/fuzz.sh stopped before it wrote its JUnit file: its
        # cases must not vanish from the count.
        with tempfile.TemporaryDirectory() as d:
            x = os.path.join(d, "x/test.xml")
            suite(x, [("a", "pass")])
            empty = os.path.join(d, "fuzz-results")
            rc, out = self.run_count([os.path.join(d, "x"), empty])
            self.assertEqual(out[-1], "1 passed, 1 failed", out)
            self.assertIn("FAILED: %s (no test.xml under it)" % empty, out)
            self.assertEqual(rc, 1)

    def test_an_unknown_option_is_refused(self):
        rc, out = self.run_count(["--junit", "x"])
        self.assertEqual(rc, 2)
        p = subprocess.run([sys.executable, COUNT, "--bep"], capture_output=True, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--bep needs a file", p.stderr)

    def test_a_failed_build_with_no_failed_target_is_a_failure(self):
        # A BUILD file that does not load stops `bazel test //...` before
        # any target: no result in the file, only the exit code. Joined by
        # the fuzz smoke's passes, that was "6 passed, 0 failed".
        with tempfile.TemporaryDirectory() as d:
            fuzz = os.path.join(d, "fuzz/test.xml")
            suite(fuzz, [("graph", "pass"), ("plan", "pass")])
            bep = os.path.join(d, "bep.json")
            with open(bep, "w") as f:
                f.write(json.dumps({"id": {"started": {}}}) + "\n" +
                        json.dumps(finished("BUILD_FAILURE", 1)) + "\n")
            rc, out = self.run_count(["--bep", bep, os.path.join(d, "fuzz")])
            self.assertEqual(out[-1], "2 passed, 1 failed", out)
            self.assertIn("FAILED: bazel test (BUILD_FAILURE; see its output)", out)
            self.assertEqual(rc, 1)
            # A file that ends before bazel did (killed between two events).
            x = os.path.join(d, "x/test.xml")
            suite(x, [("a", "pass")])
            with open(bep, "w") as f:
                f.write(json.dumps(result("//:x", x, "PASSED")) + "\n")
            rc, out = self.run_count(["--bep", bep])
            self.assertEqual(out[-1], "1 passed, 1 failed", out)
            self.assertIn("FAILED: %s (no buildFinished event: bazel did not finish)" % bep, out)
            self.assertEqual(rc, 1)


if __name__ == "__main__":
    unittest.main()
