"""deploy/prometheus and deploy/grafana: promtool accepts the configuration and the rules, and
the rules' unit tests (prometheus/hap-rules_test.yml) pass;
the dashboard is well formed and every query names a metric that a live planner exports
(after an agent, a plan and a few training steps); a real Prometheus with the local
configuration scrapes that planner and answers hap_executor_step_seconds through its API."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

import deploy_testlib as lib

DEPLOY = lib.deploy_dir()
CONFIG = os.path.join(DEPLOY, "prometheus", "prometheus.yml")
RULES = os.path.join(DEPLOY, "prometheus", "hap-rules.yml")
# promtool's unit tests of the alerts: each fires where it should and only there.
RULES_TEST = os.path.join(DEPLOY, "prometheus", "hap-rules_test.yml")
DASHBOARD = os.path.join(DEPLOY, "grafana", "dashboards", "hap-overview.json")
DASHBOARD_UID = "hap-overview"  # links and provisioning rely on it: never change it
METRIC = re.compile(r"\b((?:hap|grpc)_[a-z0-9_]+)\b")
# Label lists and matchers, which hold label names (grpc_code, ...), not metrics.
LABELS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)|\{[^}]*\}")


def promtool_checks(promtool):
    for args in (["check", "config", CONFIG], ["check", "rules", RULES],
                 ["test", "rules", RULES_TEST]):
        out = subprocess.run([promtool] + args, capture_output=True, text=True)
        print(f"promtool {' '.join(args[:2])}: rc {out.returncode}\n{out.stdout}{out.stderr}", end="")
        assert out.returncode == 0, f"promtool {args} failed"
    config = yaml.safe_load(open(CONFIG))
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]]
    return config, targets


def dashboard_panels():
    return json.load(open(DASHBOARD))["panels"]


def dashboard_queries():
    dash = json.load(open(DASHBOARD))
    assert dash.get("uid") == DASHBOARD_UID, f"dashboard uid {dash.get('uid')!r}"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables.get("datasource", {}).get("type") == "datasource", "no datasource variable"
    assert variables["datasource"].get("query") == "prometheus"
    queries = []
    for p in dash["panels"]:
        assert p.get("datasource", {}).get("uid") == "${datasource}", f"panel {p['title']}"
        assert p.get("targets"), f"panel {p['title']} has no queries"
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), "panel ids repeat"
        field = p.get("fieldConfig", {})
        units = {o["matcher"]["options"]: prop["value"] for o in field.get("overrides", [])
                 if o["matcher"]["id"] == "byName" for prop in o["properties"]
                 if prop["id"] == "unit"}
        for t in p["targets"]:
            assert t.get("datasource", {}).get("uid") == "${datasource}", f"query in {p['title']}"
            queries.append((p["title"], t["expr"]))
            # A series drawn in seconds is a time: steps/s on a seconds axis reads as a
            # duration ("2 s") next to the step times.
            unit = units.get(t.get("legendFormat"), field.get("defaults", {}).get("unit"))
            if unit in ("s", "ms"):
                assert re.search(r"_seconds(_bucket|_sum|_count)?\b", t["expr"]), (
                    f"panel {p['title']!r}: {t.get('legendFormat')!r} ({t['expr']}) is drawn "
                    f"in unit {unit!r} but is not a time; give it an override")
    # The provisioning files name the folder the dashboard is loaded from.
    prov = yaml.safe_load(open(os.path.join(DEPLOY, "grafana", "provisioning", "dashboards",
                                            "hap.yml")))
    assert prov["providers"][0]["type"] == "file"
    ds = yaml.safe_load(open(os.path.join(DEPLOY, "grafana", "provisioning", "datasources",
                                          "prometheus.yml")))
    assert ds["datasources"][0]["type"] == "prometheus"
    print(f"dashboard {DASHBOARD_UID}: {len(dash['panels'])} panels, {len(queries)} queries")
    return queries


def rules_of(path):
    return [r for g in yaml.safe_load(open(path))["groups"] for r in g["rules"]]


def rule_queries():
    return [(r.get("alert") or r.get("record"), r["expr"]) for r in rules_of(RULES)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(base, promql):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def prometheus_scrapes(prometheus, config, planner):
    tmp = tempfile.mkdtemp(prefix="hap-prometheus-test-")
    try:
        # The local configuration with its target moved to this planner's metrics port.
        text = open(CONFIG).read()
        target = config["scrape_configs"][0]["static_configs"][0]["targets"][0]
        text = text.replace(f'"{target}"', f'"{planner.metrics_hostport}"')
        open(os.path.join(tmp, "prometheus.yml"), "w").write(text)
        shutil.copy(RULES, tmp)
        port = free_port()
        proc = subprocess.Popen(
            [prometheus, f"--config.file={tmp}/prometheus.yml",
             f"--storage.tsdb.path={tmp}/data", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=open(os.path.join(tmp, "log"), "w"), stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.time() + 90
            result = []
            while time.time() < deadline:
                try:
                    result = query(base, "hap_executor_step_seconds_count")
                    if result:
                        break
                except OSError:
                    pass
                time.sleep(1)
            if not result:
                print(open(os.path.join(tmp, "log")).read()[-3000:])
                sys.exit("FAIL: Prometheus returned no hap_executor_step_seconds samples")
            print(f"Prometheus on {base}: hap_executor_step_seconds_count = {result}")
            buckets = query(base, "hap_executor_step_seconds_bucket")
            assert buckets, "no hap_executor_step_seconds_bucket samples"
            with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10) as r:
                groups = json.load(r)["data"]["groups"]
            names = {rule["name"] for g in groups for rule in g["rules"]}
            print(f"rules loaded: {sorted(names)}")
            for alert in (
                "HapPlannerDown", "HapNodeStale", "HapStepTimeAbovePrediction",
                "HapDeploymentFailed", "HapJobReplanningRepeatedly", "HapCheckpointDamaged"):
                assert alert in names, f"alert {alert} not loaded"
            # The planner-down alert's expression is empty while this planner is scraped
            # (its up{job=...} matcher is the job this configuration gives it).
            down = [r["expr"] for r in rules_of(RULES) if r.get("alert") == "HapPlannerDown"]
            assert down and query(base, down[0]) == [], f"{down}: not empty while scraped"
            return float(result[0]["value"][1])
        finally:
            lib.stop(proc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def hapctl_json(hapctl, *args):
    out = subprocess.run([hapctl, *args, "-o", "json"], capture_output=True, text=True)
    assert out.returncode == 0, f"hapctl {' '.join(args)}: {out.stdout}{out.stderr}"
    return json.loads(out.stdout)


def described_values(planner, hapctl, tmp_plans):
    """Every label value a panel's description lists ("by result (a, b, c)") is one the planner
    gives that label: a legend reader looks for them. Plans are made to fail (a model that fits
    no device) and to be cancelled (queued behind others on the planner's one worker) first,
    so that each result the planner has is in the scrape."""
    gpt = ["create", "plan", "--model", "gpt", "--heads", "2", "--seq", "16"]
    out = subprocess.run([hapctl] + gpt + ["--layers", "96", "--hidden", "65536", "--ffn",
                                           "262144", "--batch", "4", "--id", "too-big"],
                         capture_output=True, text=True)
    assert out.returncode == 0, f"hapctl create plan too-big: {out.stdout}{out.stderr}"
    for i in range(tmp_plans):
        out = subprocess.run([hapctl] + gpt + ["--layers", "12", "--hidden", "64", "--ffn", "128",
                                               "--batch", str(64 + 2 * i), "--id", f"queued-{i}"],
                             capture_output=True, text=True)
        assert out.returncode == 0, f"hapctl create plan queued-{i}: {out.stdout}{out.stderr}"
    for i in reversed(range(tmp_plans)):  # the last one first: it has not started
        subprocess.run([hapctl, "cancel", "plan", f"queued-{i}"], capture_output=True, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        plans = hapctl_json(hapctl, "get", "plans").get("plans", [])
        if all(p.get("state") in ("SUCCEEDED", "FAILED", "CANCELLED") for p in plans):
            break
        time.sleep(0.5)
    states = {p["name"]: p.get("state") for p in plans}
    assert states.get("plans/too-big") == "FAILED", states
    assert "CANCELLED" in states.values(), states
    values = {}
    for line in planner.scrape().splitlines():
        m = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*\{(.*)\} ", line)
        for k, v in re.findall(r'(\w+)="([^"]*)"', m.group(1) if m else ""):
            values.setdefault(k, set()).add(v)
    wrong = []
    for p in dashboard_panels():
        for label, listed in re.findall(r"\bby (\w+) \(([^)]*)\)", p.get("description", "")):
            for v in filter(None, re.split(r",\s*|\s+or\s+|\s+and\s+", listed.strip())):
                if v not in values.get(label, ()):
                    wrong.append(f"panel {p['title']!r}: its description lists {label} {v!r}, "
                                 f"which the planner never gives (it gives "
                                 f"{sorted(values.get(label, ()))})")
    return wrong


def rank_reports(planner, hapctl):
    """hap_executor_steps_total counts every rank's report of a step: the test's deployment
    (stopped here) completed fewer steps than the counter holds. A panel drawing its rate as
    "steps/s" then shows the ranks' reports per second (a deployment of N ranks at one step
    per second draws N): its legend must say it counts ranks."""
    deps = hapctl_json(hapctl, "get", "deployments").get("deployments", [])
    assert len(deps) == 1, deps
    name = deps[0]["name"]
    out = subprocess.run([hapctl, "stop", "deployment", name], capture_output=True, text=True)
    assert out.returncode == 0, f"hapctl stop deployment: {out.stdout}{out.stderr}"
    deadline = time.time() + 60
    while time.time() < deadline:
        d = hapctl_json(hapctl, "describe", "deployment", name)
        if d.get("state") in ("STOPPED", "SUCCEEDED", "FAILED"):
            break
        time.sleep(0.5)
    steps = int(d.get("stepsCompleted", d.get("steps_completed", 0)))
    m = re.search(r"^hap_executor_steps_total (\S+)$", planner.scrape(), re.M)
    reports = float(m.group(1)) if m else 0
    print(f"deployment {name}: {steps} steps completed on {len(d.get('ranks', []))} ranks; "
          f"hap_executor_steps_total {reports:g}")
    assert steps > 0, d
    if reports <= steps:
        return []  # the counter counts training steps: "steps/s" is right
    return [f"panel {p['title']!r}: {t['expr']} drawn as {t.get('legendFormat')!r}: the counter "
            f"counts each rank's report ({reports:g} for {steps} steps), not steps"
            for p in dashboard_panels() for t in p["targets"]
            if "hap_executor_steps_total" in t["expr"]
            and "rank" not in (t.get("legendFormat") or "")]


def main():
    promtool = lib.tool("promtool", "Debian package prometheus; run scripts/setup.sh")
    prometheus = lib.tool("prometheus", "Debian package prometheus; run scripts/setup.sh")
    config, targets = promtool_checks(promtool)
    queries = dashboard_queries()
    rules = rule_queries()

    with lib.Planner(lib.binary("HAP_PLANNER_BIN")) as planner:
        # The local configuration scrapes the planner's default metrics address.
        assert targets == ["127.0.0.1:9464"], f"local scrape targets {targets}"
        procs = lib.train_a_little(planner, lib.binary("HAPCTL_BIN"),
                                   lib.binary("HAP_AGENT_BIN"), lib.binary("HAP_EXECUTOR_BIN"),
                                   keep_running=True)
        try:
            scraped = planner.scrape()
            exported = lib.metric_names(scraped)
            # The exposition itself, as Prometheus' own linter reads it (names,
            # HELP/TYPE, units and suffixes), with nodes, plans and a deployment in it.
            lint = subprocess.run([promtool, "check", "metrics"], input=scraped,
                                  capture_output=True, text=True)
            print(f"promtool check metrics: rc {lint.returncode}\n{lint.stdout}{lint.stderr}",
                  end="")
            if lint.returncode != 0 or lint.stdout.strip() or lint.stderr.strip():
                sys.exit("FAIL: promtool check metrics found problems in the planner's /metrics")
            print(f"planner exports: {' '.join(sorted(exported))}")
            # The running deployment's step-time alert compares its own plan's prediction
            # (the only plan here) with its measured step.
            planned = re.findall(r"^hap_plan_predicted_step_seconds\{[^}]*\} (\S+)$", scraped, re.M)
            deployed = re.findall(r"^hap_deployment_predicted_step_seconds\{[^}]*\} (\S+)$",
                                  scraped, re.M)
            measured = re.findall(r"^hap_deployment_step_seconds\{[^}]*\} (\S+)$", scraped, re.M)
            assert len(planned) == 1 and deployed == planned, (planned, deployed)
            assert len(measured) == 1 and float(measured[0]) > 0, measured
            missing = []
            for where, expr in queries + rules:
                names = METRIC.findall(LABELS.sub(" ", expr))
                if not names and re.match(r"absent\(up\{", expr.strip()):
                    continue  # Prometheus' own series of the scrape (checked below)
                if not names:
                    missing.append(f"{where}: {expr!r} names no hap_/grpc_ metric")
                for n in names:
                    if n not in exported:
                        missing.append(f"{where}: {n} is not in the live /metrics scrape")
            # Label matchers too: hap_nodes{state="STALE"} would name a real metric and never
            # match (the planner spells states in lower case), and its alert never fire. Every
            # series a rule or panel selects with name="value" is in the scrape (the planner
            # exports each state and reason from the start, at 0).
            series = []
            for line in scraped.splitlines():
                m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
                if m and not line.startswith("#"):
                    series.append((m.group(1), dict(re.findall(r'(\w+)="([^"]*)"',
                                                                m.group(2) or ""))))
            for where, expr in queries + rules:
                for name, matchers in re.findall(r"\b((?:hap|grpc)_[a-z0-9_]+)\{([^}]*)\}", expr):
                    want = {k: v for k, v in re.findall(r'(\w+)\s*=\s*"([^"]*)"', matchers)
                            if k not in ("job", "instance")}
                    if not any(n == name and all(l.get(k) == v for k, v in want.items())
                               for n, l in series):
                        missing.append(f"{where}: {name}{{{matchers}}} selects no series of "
                                       f"the live /metrics scrape")
            if missing:
                sys.exit("FAIL:\n" + "\n".join(missing))
            steps = prometheus_scrapes(prometheus, config, planner)
            assert steps > 0, "Prometheus saw no steps"
            wrong = described_values(planner, lib.binary("HAPCTL_BIN"), 8)
            wrong += rank_reports(planner, lib.binary("HAPCTL_BIN"))
            if wrong:
                sys.exit("FAIL:\n" + "\n".join(wrong))
        finally:
            for p in procs:
                lib.stop(p)
    print("PASS")


if __name__ == "__main__":
    main()
