"""deploy_py_test: a deploy/ test script run by Debian's /usr/bin/python3 (tests/python3.sh),
with the shared helpers and the HAP binaries it names reachable through the environment
(paths relative to the runfiles root, the test's working directory)."""

_BINARIES = {
    "HAP_PLANNER_BIN": "//planner/service:hap-planner",
    "HAP_AGENT_BIN": "//profiler_agent:hap-agent",
    "HAP_EXECUTOR_BIN": "//executor/cli:hap-executor",
    "HAPCTL_BIN": "//tools:hapctl",
}

def deploy_py_test(name, binaries = [], env = {}, data = [], size = "medium"):
    """name: tests/<name>.py; binaries: keys of _BINARIES; env, data: extra ones."""
    script = "tests/%s.py" % name
    test_env = {"DEPLOY_MARKER": "$(rootpath tools/package.json)"}
    test_env.update(env)
    for b in binaries:
        test_env[b] = "$(rootpath %s)" % _BINARIES[b]
    native.sh_test(
        name = name,
        size = size,
        srcs = ["tests/python3.sh"],
        args = ["$(rootpath %s)" % script],
        env = test_env,
        data = [script, "tests/deploy_testlib.py", "tools/package.json"] + data +
               [_BINARIES[b] for b in binaries],
        # Reads the real deploy/ folder (git-ignored tools/node_modules) and binds 127.0.0.1.
        tags = ["no-sandbox"],
    )
