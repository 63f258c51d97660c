#!/usr/bin/env python3
"""Writes deploy/k8s/base/prometheus-rule.yaml, the Prometheus Operator's PrometheusRule
holding deploy/prometheus/hap-rules.yml (the one file of rules, which a plain Prometheus and
promtool load). Kustomize cannot put a file's text into an object, so the rule object is a
copy: run this after editing hap-rules.yml. deploy:k8s_test fails while the two differ.

    python3 deploy/tools/sync_prometheus_rule.py          # rewrite the object
    python3 deploy/tools/sync_prometheus_rule.py --check  # exit 1 when it is out of date
"""
import os
import sys

DEPLOY = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
RULES = os.path.join(DEPLOY, "prometheus", "hap-rules.yml")
OBJECT = os.path.join(DEPLOY, "k8s", "base", "prometheus-rule.yaml")

HEADER = """\
# Prometheus Operator: HAP's recording rule and alerts, for a Prometheus that selects
# PrometheusRules (label it as your Prometheus's ruleSelector asks). Generated from
# deploy/prometheus/hap-rules.yml by deploy/tools/sync_prometheus_rule.py; edit that file,
# then run the script (deploy:k8s_test fails while they differ).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: hap-rules
  labels:
    app.kubernetes.io/name: hap-planner
    app.kubernetes.io/instance: hap
    app.kubernetes.io/component: planner
spec:
"""


def render(rules_text):
    body = "".join(("  " + line if line.strip() else line)
                   for line in rules_text.splitlines(keepends=True))
    return HEADER + body


def main(argv):
    want = render(open(RULES).read())
    if "--check" in argv:
        have = open(OBJECT).read() if os.path.exists(OBJECT) else ""
        if have != want:
            print(f"{OBJECT} is not {RULES}'s rules: run {sys.argv[0]}", file=sys.stderr)
            return 1
        return 0
    with open(OBJECT, "w") as f:
        f.write(want)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
