#!/usr/bin/env python3
"""Counts test cases over the test.xml files under each directory given
(default bazel-testlogs); prints 'N passed, N failed'.

Exit status 1 when any case failed or no test ran. Suites that wrote no XML
(a crash before the runner started) count as one failure each.
"""
import os
import sys
import xml.etree.ElementTree as ET


def main(roots):
    passed = failed = skipped = 0
    failed_names = []
    walks = [w for root in roots for w in os.walk(root, followlinks=True)]
    for dirpath, _, files in walks:
        if "test.xml" not in files:
            continue
        path = os.path.join(dirpath, "test.xml")
        try:
            tree = ET.parse(path)
        except ET.ParseError:
            failed += 1
            failed_names.append(path)
            continue
        cases = list(tree.iter("testcase"))
        if not cases:
            # A suite with no cases: judge by its log's exit.
            failed += 1
            failed_names.append(path)
            continue
        for c in cases:
            name = "%s.%s" % (c.get("classname", ""), c.get("name", ""))
            if c.find("failure") is not None or c.find("error") is not None:
                failed += 1
                failed_names.append(name)
            elif c.find("skipped") is not None or c.get("result") == "skipped":
                skipped += 1
            else:
                passed += 1
    for n in failed_names:
        print("FAILED:", n)
    if skipped:
        # Skipped cases (e.g. GPU tests without a GPU) are reported on their
        # own line so that the last line stays the plain count.
        print("%d skipped (each says why in its test log)" % skipped)
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["bazel-testlogs"]))
