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
