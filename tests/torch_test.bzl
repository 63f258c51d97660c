"""hap_torch_test: a test in Python run against PyTorch."""

def hap_torch_test(name, tools = {}, data = [], size = "small", **kwargs):
    """NAME.py run by tests/torch_test.sh with Debian's /usr/bin/python3.

    torch_test.sh skips (exit 0, saying so) where torch is absent. Each entry
    of `tools` reaches the script as the argument KEY=<the label's path>,
    after the script's own path; `data` is what else the script reads.
    """
    script = name + ".py"
    native.sh_test(
        name = name,
        size = size,
        srcs = ["torch_test.sh"],
        args = ["$(rootpath %s)" % script] +
               ["%s=$(rootpath %s)" % (key, label) for key, label in tools.items()],
        data = [script] + tools.values() + data,
        **kwargs
    )

# What every exporter test reads, and the tools of one that also trains.
_EXPORT_TOOLS = {
    "HAPCTL": "//tools:hapctl",
    "EXPORT_FX": "//tools:export_fx.py",
}
_TRAIN_TOOLS = {
    "HAP_EXECUTOR": "//executor/cli:hap-executor",
    "HAP_LAUNCH": "//executor/cli:hap-launch",
    "CPU_CLUSTER": "//planner/examples:cpu-2rank.json",
}
_EXPORT_DATA = [
    "export_test_case.py",
    "hap_ir_eval.py",
    "torch_test_util.py",
    "//tools:export_fx",
]

def hap_export_test(name, trains = False, tools = {}, data = [], **kwargs):
    """A hap_torch_test of the exporter: hapctl and export_fx.py, and with
    `trains` hap-executor, hap-launch and a 2-rank CPU cluster, besides
    `tools`; the exporter's test helpers besides `data`."""
    all_tools = dict(_EXPORT_TOOLS)
    if trains:
        all_tools.update(_TRAIN_TOOLS)
    all_tools.update(tools)
    hap_torch_test(name = name, tools = all_tools, data = _EXPORT_DATA + data, **kwargs)
