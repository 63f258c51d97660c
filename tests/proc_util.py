"""Processes as the launcher tests see them (launch_reliability_test,
launch_network_test): alive or gone, by pid."""

import time


def alive(pid):
    """True while process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, seconds=30):
    """Waits up to `seconds` for every pid to be gone; those still alive."""
    deadline = time.time() + seconds
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
