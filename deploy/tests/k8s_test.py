"""deploy/k8s: both overlays render offline with `kubectl kustomize`, every object validates
against the Kubernetes schemas (kubernetes-models), every container is probed, sized and
hardened, and the ports and flags agree with the binaries themselves."""
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

import yaml

import deploy_testlib as lib

OVERLAYS = ["gpu", "cpu"]
PLANNER = lib.binary("HAP_PLANNER_BIN")
AGENT = lib.binary("HAP_AGENT_BIN")
EXECUTOR = lib.binary("HAP_EXECUTOR_BIN")
failures = []


def check(cond, message):
    if not cond:
        failures.append(message)


def render(kubectl, overlay):
    k8s = os.path.dirname(os.path.dirname(os.path.realpath(os.environ["K8S_MARKER"])))
    out = subprocess.run([kubectl, "kustomize", os.path.join(k8s, "overlays", overlay)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"FAIL: kubectl kustomize overlays/{overlay}: {out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate(objects, overlay):
    node = lib.tool("node", "Node.js; scripts/setup.sh installs Debian's nodejs")
    modules = os.path.join(lib.deploy_dir(), "tools", "node_modules")
    if not os.path.isdir(os.path.join(modules, "kubernetes-models")):
        lib.skip(f"kubernetes-models is not installed in {modules} (run scripts/setup.sh)")
    out = subprocess.run([node, os.environ["VALIDATE_JS"], modules], input=json.dumps(objects),
                         capture_output=True, text=True)
    print(f"--- {overlay}: schema validation\n{out.stdout}{out.stderr}", end="")
    check(out.returncode == 0, f"{overlay}: schema validation failed")


def check_help_runs(cmd):
    out = subprocess.run(cmd + ["--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"{cmd} --help: {out.stderr}"


def accepts_flag(cmd, flag):
    """The binary's own parser accepts --flag (an unknown flag exits 2 before --help)."""
    out = subprocess.run(cmd + [f"--{flag}=x", "--help"], capture_output=True, text=True,
                         timeout=30)
    return out.returncode == 0


def planner_defaults():
    """The planner's default gRPC and metrics addresses, from the binary: started with no
    --listen/--metrics-listen in a private network namespace (its defaults bind fixed ports)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            out = subprocess.run(
                ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0" --database ""',
                 PLANNER], capture_output=True, text=True, timeout=5, cwd=tmp)
            text = out.stdout
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        except FileNotFoundError:
            text = ""
    grpc = re.search(r"listening on \S+:(\d+)", text)
    metrics = re.search(r"metrics on http://\S+:(\d+)/", text)
    if not (grpc and metrics):
        return None
    return int(grpc.group(1)), int(metrics.group(1))


def flag_args(container):
    """{flag: value} from a container's args (--flag=value or bare --flag)."""
    flags = {}
    for a in container.get("args", []):
        m = re.match(r"--([a-z0-9-]+)(?:=(.*))?$", a)
        assert m, f"unexpected argument {a!r}"
        flags[m.group(1)] = m.group(2)
    return flags


def port_of(value):
    return int(value.rsplit(":", 1)[1])


def check_container(where, c, binaries):
    for probe in ("livenessProbe", "readinessProbe"):
        check(probe in c, f"{where}: no {probe}")
    res = c.get("resources", {})
    for kind in ("requests", "limits"):
        for r in ("cpu", "memory"):
            check(r in res.get(kind, {}), f"{where}: no resources.{kind}.{r}")
    sc = c.get("securityContext", {})
    check(sc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot is not true")
    check(sc.get("runAsUser", 0) != 0, f"{where}: runs as uid 0")
    check(sc.get("readOnlyRootFilesystem") is True, f"{where}: root filesystem is writable")
    check(sc.get("allowPrivilegeEscalation") is False, f"{where}: privilege escalation allowed")
    check(sc.get("privileged", False) is False, f"{where}: privileged")
    check(sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: capabilities not all dropped")
    check(sc.get("seccompProfile", {}).get("type") == "RuntimeDefault",
          f"{where}: seccomp is not RuntimeDefault")

    # Flags: every flag given is one the binary's own parser knows.
    cmd = binaries[c["name"]]
    flags = flag_args(c)
    if c["name"] == "executor":
        check("serve" in flags, f"{where}: the executor daemon needs --serve")
    check_help_runs(cmd)
    for f in flags:
        if f == "serve":
            continue
        # The parser, not the help text: "--heartbeat" is in the planner's help (as part of
        # --heartbeat-seconds) yet no flag, and the planner would exit 2 on it.
        check(accepts_flag(cmd, f), f"{where}: --{f} is not a flag of {cmd}")
    for e in c.get("env", []):
        if e["name"].startswith("HAP_") and not e["name"].startswith("HAP_TEST"):
            f = e["name"][4:].lower().replace("_", "-")
            check(accepts_flag(cmd, f),
                  f"{where}: env {e['name']} names no flag of {cmd}")
    # Ports: what the binary listens on is what the pod declares and probes.
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    check("listen" in flags, f"{where}: no --listen (the default binds 127.0.0.1 only)")
    if "listen" in flags:
        check(flags["listen"].startswith("0.0.0.0:"), f"{where}: --listen must bind 0.0.0.0")
        check(ports.get("grpc") == port_of(flags["listen"]),
              f"{where}: port grpc {ports.get('grpc')} != --listen {flags['listen']}")
    if "metrics-listen" in flags:
        check(ports.get("metrics") == port_of(flags["metrics-listen"]),
              f"{where}: port metrics != --metrics-listen")
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        p = c.get(probe)
        if not p:
            continue
        if "grpc" in p:
            check(p["grpc"]["port"] == ports.get("grpc"), f"{where}: {probe} not on the grpc port")
        elif "tcpSocket" in p:
            check(p["tcpSocket"]["port"] in ("grpc", ports.get("grpc")),
                  f"{where}: {probe} not on the grpc port")
        else:
            failures.append(f"{where}: {probe} is neither grpc nor tcpSocket")
    token = flags.get("token-file")
    check(token is not None, f"{where}: no --token-file")
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    check(token and os.path.dirname(token) in mounts, f"{where}: token file not mounted")
    # Kubernetes expands $(VAR) in args only from the container's env; an undefined
    # one is passed on literally ("$(POD_IP):7071").
    env = {e["name"]: e for e in c.get("env", [])}
    for a in c.get("args", []):
        for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a):
            check(var in env, f"{where}: {a} uses $({var}), which the container's env lacks")
    return flags, ports


def field_var(container, value, field="status.podIP"):
    """When value is "$(VAR)" or "$(VAR):PORT" with VAR the downward API's `field` (the pod's
    IP by default): (True, PORT or None); else (False, None)."""
    m = re.match(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)(?::(\d+))?$", value or "")
    env = {e["name"]: e for e in container.get("env", [])}
    ref = env.get(m.group(1), {}).get("valueFrom", {}).get("fieldRef", {}) if m else {}
    if ref.get("fieldPath") != field:
        return False, None
    return True, int(m.group(2)) if m.group(2) else None


def pod_ip_var(container, value):
    """True when value is "$(VAR)" or "$(VAR):PORT" with VAR the pod's IP (status.podIP)."""
    return field_var(container, value)[0]


def check_pod(where, pod):
    """What a pod needs around its containers: readable secrets for a non-root user."""
    sc = pod.get("securityContext", {})
    for v in pod.get("volumes", []):
        if "secret" not in v:
            continue
        # Secret files are root-owned; without fsGroup (which makes it their group and a
        # supplemental group of every container) uid 10001 reads them only if 'other' may.
        mode = v["secret"].get("defaultMode", 0o644)
        check(mode & 0o004 or ("fsGroup" in sc and mode & 0o040),
              f"{where}: secret volume {v['name']} (mode {mode:o}) is unreadable by a "
              f"non-root container without pod securityContext.fsGroup")


def check_overlay(overlay, objects, defaults):
    binaries = {"planner": [PLANNER], "agent": [AGENT], "executor": [EXECUTOR, "--serve"]}
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
        labels = o["metadata"].get("labels", {})
        for key in ("name", "instance", "part-of", "managed-by"):
            check(f"app.kubernetes.io/{key}" in labels,
                  f"{overlay} {o['kind']}/{o['metadata']['name']}: no app.kubernetes.io/{key}")
    for kind in ("Deployment", "DaemonSet"):
        for name, w in by_kind.get(kind, {}).items():
            where = f"{overlay} {kind}/{name}"
            sel = w["spec"]["selector"]["matchLabels"]
            check(set(sel) == {"app.kubernetes.io/name", "app.kubernetes.io/instance"},
                  f"{where}: selector {sel} is not name+instance")
            pod = w["spec"]["template"]["spec"]
            check(pod.get("securityContext", {}).get("runAsNonRoot") is True,
                  f"{where}: pod not runAsNonRoot")
            check_pod(where, pod)
            tmpl_labels = w["spec"]["template"]["metadata"]["labels"]
            check(all(tmpl_labels.get(k) == v for k, v in sel.items()),
                  f"{where}: template labels do not match the selector")
            for c in pod["containers"]:
                flags, ports = check_container(f"{where} container {c['name']}", c, binaries)
                # SIGTERM, then --drain-seconds of NOT_SERVING, then the server's own stop
                # (the planner gives calls 5 s, the executor its step report 5 s): the
                # kubelet's SIGKILL must come after all of it.
                if c["name"] in ("planner", "executor"):
                    drain = float(flags.get("drain-seconds") or 1)
                    grace = pod.get("terminationGracePeriodSeconds", 30)
                    check(grace >= drain + 10, f"{where}: terminationGracePeriodSeconds {grace} "
                          f"< --drain-seconds {drain:g} + 10 s of shutdown")
                if c["name"] == "planner":
                    # Nodes come and go with the cluster (autoscaling, node-pool upgrades
                    # with new names): one never seen again stays STALE, and HapNodeStale
                    # fires, forever unless it expires; not before the alert's 5 minutes.
                    expiry = float(flags.get("node-expiry-seconds") or 0)
                    check(expiry >= 600, f"{where}: --node-expiry-seconds {expiry:g}: a node "
                          f"removed from the cluster stays STALE forever (give 600 or more)")
                if c["name"] == "planner" and defaults:
                    check(ports.get("grpc") == defaults[0],
                          f"{where}: grpc port {ports.get('grpc')} != planner default {defaults[0]}")
                    check(ports.get("metrics") == defaults[1],
                          f"{where}: metrics port != planner default {defaults[1]}")
                gpu = any("nvidia.com/gpu" in c.get("resources", {}).get(k, {})
                          for k in ("requests", "limits"))
                if kind == "DaemonSet":
                    tol = [t.get("key") for t in pod.get("tolerations", [])]
                    sel_nodes = pod.get("nodeSelector", {})
                    if overlay == "gpu":
                        check("nvidia.com/gpu" in tol, f"{where}: no nvidia.com/gpu toleration")
                        check(any(k.startswith("nvidia.com/") for k in sel_nodes),
                              f"{where}: no GPU node selector")
                        if c["name"] == "executor":
                            check(gpu, f"{where}: executor requests no nvidia.com/gpu")
                    else:
                        check(not gpu and "nvidia.com/gpu" not in tol and
                              not any(k.startswith("nvidia.com/") for k in sel_nodes),
                              f"{where}: GPU settings in the cpu overlay")
                    if c["name"] == "executor":
                        # The id it serves is the device the agent reports: a GPU
                        # in the gpu overlay, the CPU in the cpu overlay.
                        want = "$(NODE_NAME)/gpu0" if overlay == "gpu" else "$(NODE_NAME)/cpu0"
                        ids = [a for a in c.get("args", []) if a.startswith("--device-id=")]
                        check(ids == ["--device-id=" + want],
                              f"{where}: executor --device-id {ids}, expected {want}")
                        # Gloo listens on --gloo-host (default 127.0.0.1) and the ranks
                        # on other nodes dial it: it must be the pod's own address.
                        check(pod_ip_var(c, flags.get("gloo-host")),
                              f"{where}: executor --gloo-host {flags.get('gloo-host')!r} is not "
                              f"$(VAR) of status.podIP: ranks on other nodes cannot connect")
                    if c["name"] == "agent":
                        check(pod_ip_var(c, flags.get("advertise")),
                              f"{where}: agent --advertise is not the pod's IP")
                    planner_env = [e for e in c.get("env", []) if e["name"] == "HAP_PLANNER"]
                    check(planner_env and "configMapKeyRef" in planner_env[0].get("valueFrom", {}),
                          f"{where}: HAP_PLANNER does not come from the ConfigMap")
    # An executor takes a plan only when the planner's advertised address (the rendezvous
    # address it sends) is the executor's --planner, string for string after normalising:
    # the planner's HAP_ADVERTISE and the executors' HAP_PLANNER are one ConfigMap key.
    def env_source(name, var):
        w = by_kind.get("Deployment", {}).get(name) or by_kind.get("DaemonSet", {}).get(name, {})
        for c in w.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            for e in c.get("env", []):
                if e["name"] == var:
                    return e.get("valueFrom", {}).get("configMapKeyRef") or e.get("value")
        return None
    advertise = env_source("hap-planner", "HAP_ADVERTISE")
    check(advertise is not None, f"{overlay}: the planner has no HAP_ADVERTISE: it advertises "
          f"its --listen (0.0.0.0:7070), which no executor dials or accepts")
    check(env_source("hap-executor", "HAP_PLANNER") == advertise,
          f"{overlay}: the executors' HAP_PLANNER {env_source('hap-executor', 'HAP_PLANNER')} is "
          f"not the planner's HAP_ADVERTISE {advertise}: they would refuse its plans")
    # A rolling update of the executors restarts them node by node, which fails every
    # deployment spanning them (an elastic job re-plans once per node): they are replaced
    # only when their pods are deleted.
    ex = by_kind.get("DaemonSet", {}).get("hap-executor", {})
    strategy = ex.get("spec", {}).get("updateStrategy", {}).get("type", "RollingUpdate")
    check(strategy == "OnDelete",
          f"{overlay}: DaemonSet/hap-executor updateStrategy {strategy}: a rollout kills training")
    # Elastic jobs and deployments without --executor find a device's executor by the
    # node label hap.executor/<device> the agent sets from --executor: in another pod
    # the executor is reached at its node's address (status.hostIP) on a hostPort, which
    # the agent, the planner and the label all dial. Without it no label was ever set.
    agent = by_kind.get("DaemonSet", {}).get("hap-agent", {})
    if ex and agent:
        ex_c = ex["spec"]["template"]["spec"]["containers"][0]
        ag_c = agent["spec"]["template"]["spec"]["containers"][0]
        host_ports = [p.get("hostPort") for p in ex_c.get("ports", []) if p.get("name") == "grpc"]
        listen = flag_args(ex_c).get("listen", "")
        check(host_ports and host_ports[0] == port_of(listen),
              f"{overlay}: executor grpc port has hostPort {host_ports}, not its --listen port: "
              f"the agent on its node cannot name it for the planner")
        on_host, port = field_var(ag_c, flag_args(ag_c).get("executor"), "status.hostIP")
        check(on_host and host_ports and port == host_ports[0],
              f"{overlay}: agent --executor {flag_args(ag_c).get('executor')!r} is not "
              f"$(VAR of status.hostIP):<the executor's hostPort>: no node is labelled with its "
              f"executor, so elastic jobs find none")
    # The agent measures the node's CPU device inside its own cgroup (memory = its memory
    # limit, FLOP/s with its CPU quota's threads): for the planner to price the executor's
    # share, the agent's limits are the executor's.
    ds = by_kind.get("DaemonSet", {})
    limits = {n: ds[n]["spec"]["template"]["spec"]["containers"][0].get("resources", {})
              .get("limits", {}) for n in ("hap-agent", "hap-executor") if n in ds}
    check(len(limits) == 2, f"{overlay}: expected DaemonSets hap-agent and hap-executor")
    if len(limits) == 2:
        # ... and the executor's kernel threads (for deployments that name none) are the
        # threads the agent measured with: its CPU limit.
        ex_c = ds["hap-executor"]["spec"]["template"]["spec"]["containers"][0]
        check(flag_args(ex_c).get("threads") == str(limits["hap-executor"].get("cpu")),
              f"{overlay}: executor --threads {flag_args(ex_c).get('threads')} is not its CPU "
              f"limit {limits['hap-executor'].get('cpu')}, the threads the agent measures with")
        for r in ("cpu", "memory"):
            check(limits["hap-agent"].get(r) == limits["hap-executor"].get(r),
                  f"{overlay}: agent limits.{r} {limits['hap-agent'].get(r)} != the executor's "
                  f"{limits['hap-executor'].get(r)}: the agent reports its own cgroup's share "
                  f"as the device the executor trains on")
    # The Service exposes named grpc and metrics ports onto the planner's container ports.
    svc = by_kind.get("Service", {}).get("hap-planner")
    check(svc is not None, f"{overlay}: no Service hap-planner")
    if svc:
        names = {p["name"]: p for p in svc["spec"]["ports"]}
        check(set(names) == {"grpc", "metrics"}, f"{overlay}: Service ports {set(names)}")
        if defaults:
            check(names.get("grpc", {}).get("port") == defaults[0], f"{overlay}: Service grpc port")
            check(names.get("metrics", {}).get("port") == defaults[1], f"{overlay}: Service metrics port")
        check(set(svc["spec"]["selector"]) == {"app.kubernetes.io/name", "app.kubernetes.io/instance"},
              f"{overlay}: Service selector is not name+instance")
        cm = by_kind.get("ConfigMap", {}).get("hap-config", {})
        addr = cm.get("data", {}).get("planner-address", "")
        check(addr == f"hap-planner:{names.get('grpc', {}).get('port')}",
              f"{overlay}: ConfigMap planner-address {addr!r} is not the Service's grpc port")
    sm = by_kind.get("ServiceMonitor", {}).get("hap-planner")
    check(sm is not None and sm["spec"]["endpoints"][0]["port"] == "metrics",
          f"{overlay}: no ServiceMonitor on the planner's metrics port")
    # The PrometheusRule holds hap-rules.yml's rules, which promtool tests
    # (observability_test): a copy that drifted would alert on other terms.
    rule = by_kind.get("PrometheusRule", {}).get("hap-rules")
    check(rule is not None, f"{overlay}: no PrometheusRule hap-rules")
    if rule:
        want = yaml.safe_load(open(os.environ["HAP_RULES"]))["groups"]
        check(rule["spec"]["groups"] == want,
              f"{overlay}: PrometheusRule hap-rules is not deploy/prometheus/hap-rules.yml's "
              f"rules: run deploy/tools/sync_prometheus_rule.py")
    pvc = by_kind.get("PersistentVolumeClaim", {})
    check(len(pvc) == 1, f"{overlay}: expected one PVC for the planner's store")


# What the downward API gives a pod, here (starts_with_its_args).
FIELD_VALUES = {"status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1",
                "spec.nodeName": "node-a"}


def starts_with_its_args(overlay, objects):
    """Every container's binary starts serving with the container's own arguments and
    environment as the kubelet gives them: $(VAR) expanded, the downward API's fields
    (FIELD_VALUES), the ConfigMap's values, each volume a temporary directory at the mount's
    path (a secret's files a token). --flag=x --help proves that a flag exists, not that the
    value it is given parses (--drain-seconds=5s, --threads=0, --listen=:7100 would pass it).
    Each runs in a private network namespace, on the manifests' own ports."""
    cms = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    binaries = {"planner": PLANNER, "agent": AGENT, "executor": EXECUTOR}
    for o in objects:
        if o["kind"] not in ("Deployment", "DaemonSet"):
            continue
        pod = o["spec"]["template"]["spec"]
        secret_volumes = {v["name"] for v in pod.get("volumes", []) if "secret" in v}
        for c in pod["containers"]:
            where = f"{overlay} {o['kind']}/{o['metadata']['name']} container {c['name']}"
            env = {}
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "value" in e:
                    env[e["name"]] = e["value"]
                elif "fieldRef" in ref:
                    env[e["name"]] = FIELD_VALUES[ref["fieldRef"]["fieldPath"]]
                elif "configMapKeyRef" in ref:
                    k = ref["configMapKeyRef"]
                    env[e["name"]] = cms.get(k["name"], {}).get(k["key"], "")
            with tempfile.TemporaryDirectory() as tmp:
                mounts = c.get("volumeMounts", [])
                for m in mounts:
                    os.makedirs(tmp + m["mountPath"], exist_ok=True)

                def local(value):
                    for m in sorted(mounts, key=lambda m: -len(m["mountPath"])):
                        path = m["mountPath"]
                        if value == path or value.startswith(path.rstrip("/") + "/"):
                            if m["name"] in secret_volumes and value != path:
                                with open(tmp + value, "w") as f:
                                    f.write("deploy-test-token\n")
                                os.chmod(tmp + value, 0o600)
                            return tmp + value
                    return value

                args = []
                for a in c.get("args", []):
                    a = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                               lambda m: env.get(m.group(1), m.group(0)), a)
                    flag, eq, value = a.partition("=")
                    args.append(flag + eq + local(value) if eq else a)
                run_env = {k: v for k, v in os.environ.items() if not k.startswith("HAP_")}
                run_env.update({k: local(v) for k, v in env.items()})
                cmd = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                       binaries[c["name"]]] + args
                try:
                    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, env=run_env, cwd=tmp)
                except FileNotFoundError:
                    print("NOTE: no unshare: the containers' arguments are not run")
                    return
                out, deadline = b"", time.time() + 30
                while time.time() < deadline and b"listening on" not in out:
                    ready, _, _ = select.select([proc.stdout], [], [], 0.5)
                    if ready:
                        chunk = os.read(proc.stdout.fileno(), 65536)
                        if not chunk:
                            break
                        out += chunk
                serving = b"listening on" in out
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                text = out.decode(errors="replace").strip()
                if not serving and (("unshare" in text and "Operation not permitted" in text)
                                    or re.search(r"\bip: (not found|command not found)", text)):
                    print(f"NOTE: no private network namespace here (unshare -rn, ip): {text}; "
                          f"the containers' arguments are not run")
                    return
                print(f"{where}: {'serves' if serving else 'DOES NOT SERVE'} with "
                      f"{' '.join(c.get('args', []))}")
                check(serving, f"{where}: does not start with its own arguments and environment "
                      f"(rc {proc.returncode}): {text[-600:]}")


def main():
    kubectl = lib.tool("kubectl", "kubectl 1.32 with Kustomize; Debian 12 ships only 1.20, "
                                  "too old for these kustomizations, so set-up does not install it")
    defaults = planner_defaults()
    if defaults is None:
        print("NOTE: could not start the planner in a private network namespace (unshare); "
              "its default ports are not compared")
    else:
        print(f"planner defaults from the binary: grpc {defaults[0]}, metrics {defaults[1]}")
    rendered = {}
    for overlay in OVERLAYS:
        objects = render(kubectl, overlay)
        kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
        print(f"--- {overlay}: {len(objects)} objects: {', '.join(kinds)}")
        validate(objects, overlay)
        check_overlay(overlay, objects, defaults)
        starts_with_its_args(overlay, objects)
        rendered[overlay] = objects
    # The gpu overlay restates the executor's whole argument list (a strategic merge replaces
    # a list): it must stay the base's (the cpu overlay's) but for the device it serves, or a
    # flag added to the base silently never reaches the GPU executors.
    def executor_args(overlay):
        return [c.get("args", []) for o in rendered[overlay] if o["kind"] == "DaemonSet"
                and o["metadata"]["name"] == "hap-executor"
                for c in o["spec"]["template"]["spec"]["containers"]]
    gpu_args = [[a.replace("/gpu0", "/cpu0") for a in args] for args in executor_args("gpu")]
    check(gpu_args == executor_args("cpu"),
          f"gpu overlay: the executor's args {executor_args('gpu')} are not the base's "
          f"{executor_args('cpu')} with NODE/gpu0 for NODE/cpu0")
    if failures:
        print("\n".join("FAIL: " + f for f in failures))
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
