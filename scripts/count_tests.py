#!/usr/bin/env python3
"""Counts test cases and prints 'N passed, N failed' (scripts/test.sh's last
line).

    count_tests.py [--bep BEP.json] [DIR ...]

--bep: the test results of one `bazel test` invocation, from its build event
file (--build_event_json_file): every test target's test.xml it names, the
cached results included, and only those. bazel-testlogs also keeps the XML of
targets since deleted and of shards of an earlier shard_count, which a walk
would count again. DIRs: test.xml files found under them (the fuzz smoke's
JUnit file); a DIR with none is a failure. Without either, bazel-testlogs is
walked.

A test that wrote no XML counts as one case by its status; one whose status is
not PASSED is a failure even where its XML shows none (it crashed or timed out
after writing it); a target that did not build counts as one failure; so does
a build event file that cannot be read to its end (bazel killed while writing
it, or never started), the results before the break counted, or that has no
buildFinished event; and so does a build whose exit code is not SUCCESS while
the file shows no failure (a BUILD file that does not load: no target ran).
Exit status 1 when any case failed or no case passed.
"""
import json
import os
import sys
import xml.etree.ElementTree as ET
from urllib.parse import unquote, urlparse

# The statuses of a test attempt that passed (FLAKY: passed on a retry).
PASSED = ("PASSED", "FLAKY")


class Count:
    def __init__(self):
        self.passed = self.failed = self.skipped = 0
        self.failed_names = []

    def fail(self, name):
        self.failed += 1
        self.failed_names.append(name)

    def xml(self, path):
        """Counts the cases of one test.xml; returns how many failed."""
        failed = self.failed
        try:
            tree = ET.parse(path)
        except (ET.ParseError, OSError):
            self.fail(path)
            return 1
        cases = list(tree.iter("testcase"))
        if not cases:
            self.fail(path)  # a suite with no cases
            return 1
        for c in cases:
            name = "%s.%s" % (c.get("classname", ""), c.get("name", ""))
            if c.find("failure") is not None or c.find("error") is not None:
                self.fail(name)
            elif (c.find("skipped") is not None or c.get("result") == "skipped" or
                  c.get("status") == "notrun"):
                # googletest: a GTEST_SKIP()ped case has result="skipped"; a
                # DISABLED_ one status="notrun" (result="suppressed") and no
                # <skipped/>. Neither ran, so neither passed.
                self.skipped += 1
            else:
                self.passed += 1
        return self.failed - failed


class Bep:
    """What one build event file says: `results`, (label, xml path or None,
    status) of each test run and shard, the last attempt of each; `broken`,
    the labels of targets that did not build; `exit`, the name of bazel's
    exit code (None when the file has no buildFinished event: bazel did not
    finish); `unreadable`, why the file could not be read to its end (None
    when it could): bazel killed while writing it, or never started."""

    def __init__(self, path):
        self.broken = []
        self.exit = None
        self.unreadable = None
        self._last = {}
        try:
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    try:
                        event = json.loads(line)
                    except ValueError as e:
                        self.unreadable = "line %d is not JSON: %s" % (number, e)
                        break
                    self._add(event)
        except OSError as e:
            self.unreadable = "cannot read it: %s" % (e.strerror or e)
        self.results = [(k[0], xml, status)
                        for k, (_, xml, status) in sorted(self._last.items())]

    def _add(self, event):
        ident = event.get("id", {})
        if "buildFinished" in ident:
            code = event.get("finished", {}).get("exitCode", {})
            # JSON leaves out proto3 defaults: SUCCESS is code 0.
            self.exit = code.get("name") or ("exit code %s" % code["code"]
                                             if code.get("code") else "SUCCESS")
        elif "testResult" in event:
            i = ident["testResult"]
            key = (i["label"], i.get("run", 1), i.get("shard", 1))
            attempt = i.get("attempt", 1)
            result = event["testResult"]
            xml = None
            for out in result.get("testActionOutput", []):
                if out.get("name") == "test.xml":
                    xml = unquote(urlparse(out["uri"]).path)
            if key not in self._last or attempt >= self._last[key][0]:
                self._last[key] = (attempt, xml, result.get("status", "NO_STATUS"))
        elif "targetCompleted" in ident:
            done = event.get("completed")
            aborted = event.get("aborted")
            # SKIPPED: incompatible with this configuration (CUDA-only
            # targets without --config=cuda), not a failure.
            if (done is not None and not done.get("success", False)) or (
                    aborted is not None and aborted.get("reason") != "SKIPPED"):
                self.broken.append(ident["targetCompleted"]["label"])


def main(argv):
    count = Count()
    bep = None
    if argv[:1] == ["--bep"]:
        if len(argv) < 2:
            print("count_tests.py: --bep needs a file", file=sys.stderr)
            return 2
        bep, argv = argv[1], argv[2:]
    for a in argv:
        if a.startswith("-"):
            # Not a DIR: walking a directory of that name would find nothing.
            print("count_tests.py: unknown option %s (usage: count_tests.py "
                  "[--bep BEP.json] [DIR ...])" % a, file=sys.stderr)
            return 2
    # A DIR named on the command line must hold results (the fuzz smoke's
    # JUnit file is missing when scripts/fuzz.sh stopped early); the default
    # bazel-testlogs may be empty.
    named = bool(argv)
    roots = argv if argv or bep else ["bazel-testlogs"]
    if bep is not None:
        b = Bep(bep)
        if b.unreadable:
            count.fail("%s (%s)" % (bep, b.unreadable))
        for label, xml, status in b.results:
            if xml is not None and os.path.exists(xml):
                # A target bazel says failed is a failure even when its XML
                # shows none: a gtest binary that wrote its XML and then
                # crashed on exit, a timeout after the XML was written.
                if count.xml(xml) == 0 and status not in PASSED:
                    count.fail("%s (%s, though its test.xml shows no failure)" % (label, status))
            elif status in PASSED:
                count.passed += 1
            else:
                count.fail("%s (%s, no test.xml)" % (label, status))
        for label in b.broken:
            count.fail("%s (did not build)" % label)
        if b.unreadable is None and b.exit is None:
            count.fail("%s (no buildFinished event: bazel did not finish)" % bep)
        elif b.exit not in (None, "SUCCESS") and count.failed == 0:
            # A failure that names no target (a BUILD file that does not
            # load, a bad target pattern): the file holds no result that
            # failed, maybe none at all.
            count.fail("bazel test (%s; see its output)" % b.exit)
    for root in roots:
        found = False
        for dirpath, _, files in os.walk(root, followlinks=True):
            if "test.xml" in files:
                count.xml(os.path.join(dirpath, "test.xml"))
                found = True
        if named and not found:
            count.fail("%s (no test.xml under it)" % root)
    for n in count.failed_names:
        print("FAILED:", n)
    if count.skipped:
        # Skipped cases (e.g. GPU tests without a GPU) are reported on their
        # own line so that the last line stays the plain count.
        print("%d skipped (each says why in its test log)" % count.skipped)
    print("%d passed, %d failed" % (count.passed, count.failed))
    return 1 if count.failed or count.passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
