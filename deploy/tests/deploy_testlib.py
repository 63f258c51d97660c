"""Helpers shared by the deploy/ tests: binaries from the environment (set by
tests/py_test.sh from Bazel runfiles), skipping, and a planner on 127.0.0.1."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def skip(message):
    """Skips the whole test with a clear message (only for a tool that is really missing)."""
    print(f"SKIPPED: {message}")
    sys.exit(0)


def binary(env_name):
    path = os.environ.get(env_name)
    path = path and os.path.abspath(path)
    if not path or not os.access(path, os.X_OK):
        sys.exit(f"FAIL: {env_name} is not set to an executable (got {path!r})")
    return path


def tool(name, hint):
    path = shutil.which(name)
    if not path:
        skip(f"'{name}' is not installed ({hint})")
    return path


def deploy_dir():
    """The real deploy/ folder (for what git ignores, e.g. tools/node_modules)."""
    marker = os.environ["DEPLOY_MARKER"]
    return os.path.dirname(os.path.dirname(os.path.realpath(marker)))


class Planner:
    """hap-planner on 127.0.0.1 with free ports and a temporary database."""

    def __init__(self, path):
        self.tmp = tempfile.mkdtemp(prefix="hap-deploy-test-")
        self.proc = subprocess.Popen(
            [path, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
             "--database", os.path.join(self.tmp, "planner.db")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=self.tmp)
        self.address = self.metrics_url = None
        deadline = time.time() + 30
        while time.time() < deadline and not (self.address and self.metrics_url):
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.match(r"listening on (\S+)", line)
            if m:
                self.address = m.group(1)
            m = re.match(r"metrics on (http://\S+)", line)
            if m:
                self.metrics_url = m.group(1)
        if not (self.address and self.metrics_url):
            self.stop()
            sys.exit("FAIL: hap-planner did not print its addresses")
        self.metrics_hostport = re.match(r"http://([^/]+)/", self.metrics_url).group(1)

    def scrape(self):
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return r.read().decode()

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def metric_names(exposition):
    """Every series name in a Prometheus text exposition."""
    names = set()
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            names.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    return names


def start_daemon(cmd, pattern, what):
    """Starts cmd, returns (process, the first match of pattern in its output)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(pattern, line)
        if m:
            # Keep reading what it prints so that it never blocks on a full pipe.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, m.group(1)
    stop(proc)
    sys.exit(f"FAIL: {what} did not print {pattern!r}")


def stop(proc):
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def train_a_little(planner, hapctl, agent, executor, steps=3, keep_running=False):
    """One agent and one executor daemon on 127.0.0.1: register, plan a tiny GPT, train a few
    steps on synthetic data, so that every metric family the planner exports has samples.
    keep_running: return while the deployment still runs (it is given many more steps), so
    that the running deployments' families have samples too. Returns the daemons (stop them
    with stop())."""
    ctl = [hapctl]
    os.environ["HAPCTL_SERVER"] = planner.address
    procs = []
    nodes = ["node0", "node1"]  # a plan needs two devices
    for n in nodes:
        a, _ = start_daemon([agent, "--planner", planner.address, "--name", n,
                             "--listen", "127.0.0.1:0", "--probe-seconds", "0.3",
                             "--threads", "1"], r"(registered node)", "hap-agent")
        procs.append(a)
    deadline = time.time() + 60
    while subprocess.run(ctl + ["get", "nodes"], capture_output=True,
                         text=True).stdout.count(" READY ") < len(nodes):
        if time.time() > deadline:
            sys.exit("FAIL: the agent did not register")
        time.sleep(0.3)
    out = subprocess.run(ctl + ["create", "plan", "--timeout", "120", "--model", "gpt",
                                "--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64",
                                "--seq", "16", "--batch", "4", "--id", "deploy-test", "--wait"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"FAIL: hapctl create plan: {out.stdout}{out.stderr}")
    deploy = ["deploy", "plan", "deploy-test", "--steps",
              str(steps * 100000 if keep_running else steps), "--data", "synthetic"]
    for n in nodes:
        e, addr = start_daemon([executor, "--serve", "--planner", planner.address,
                                "--listen", "127.0.0.1:0", "--device-id", f"{n}/cpu0"],
                               r"listening on (\S+)", "hap-executor --serve")
        procs.append(e)
        deploy += ["--executor", f"{n}/cpu0={addr}"]
    out = subprocess.run(ctl + deploy, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"FAIL: hapctl deploy plan: {out.stdout}{out.stderr}")
    deadline = time.time() + 120
    while time.time() < deadline:
        scraped = planner.scrape()
        m = re.search(r"^hap_executor_steps_total (\S+)", scraped, re.M)
        if (m and float(m.group(1)) >= steps and "hap_training_loss{" in scraped
                and (not keep_running or "hap_deployment_step_seconds{" in scraped)):
            return procs
        time.sleep(0.5)
    sys.exit("FAIL: no training steps reached the planner")
