"""hap-launch on every way a launch ends: a rank that fails (named with its
exit code or signal), a rank that will not stop (killed after the grace
period, --grace-seconds), SIGTERM to the launcher, a closed standard error, --deadline, the launcher killed outright (its ranks die
with it; its rendezvous directory and cgroups removed by name at the next
start), standard output or a checkpoint directory that cannot be written,
bad executor flags (named once, before any rank starts),
an executor that is missing or found through PATH, --pin-cores under
taskset, and a stop signal while the testbed is being made.

Most cases run a fake executor (a Python script that records its pid and
then exits, crashes, sleeps or ignores SIGTERM as told), so they take a
second or two each. Cases that need root, cgroup v1 or network namespaces
skip with the reason."""

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

from proc_util import wait_gone

HAPCTL = os.environ["HAPCTL"]
LAUNCH = os.environ["HAP_LAUNCH"]
EXECUTOR = os.environ["HAP_EXECUTOR"]
CLUSTER = os.environ["CPU_CLUSTER"]  # two CPU ranks
TMP = os.environ.get("TEST_TMPDIR", tempfile.gettempdir())
CGROUP_ROOT = "/sys/fs/cgroup/cpu"
NETNS_DIR = "/var/run/netns"

FAKE_EXECUTOR = r'''#!/usr/bin/python3
import os, signal, sys, time
rank = int(sys.argv[sys.argv.index("--rank") + 1])
mode = os.environ.get("FAKE_MODE", "") + ":"
action, who = mode.split(":")[0], mode.split(":")[1]
mine = who in ("", str(rank))
if mine and action == "ignore-term":  # before its pid tells the test it runs
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(os.environ["FAKE_DIR"], "argv%d" % rank), "w") as f:
    f.write(" ".join(sys.argv[1:]))
with open(os.path.join(os.environ["FAKE_DIR"], "rank%d.cores" % rank), "w") as f:
    f.write(",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
with open(os.path.join(os.environ["FAKE_DIR"], "rank%d.pid" % rank), "w") as f:
    f.write(str(os.getpid()))
# Every rank's pid is recorded before any acts (a rank that fails at once
# had its peer stopped before that recorded its pid).
deadline = time.time() + 20
while time.time() < deadline and not all(
        os.path.exists(os.path.join(os.environ["FAKE_DIR"], "rank%d.pid" % r)) for r in (0, 1)):
    time.sleep(0.01)
if mine:
    if action == "exit3":
        sys.exit(3)
    if action == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if action == "ok":
        sys.exit(0)
time.sleep(600)
'''


def free_pid():
    """A pid that no process has now (a process started and reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


class LaunchReliabilityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(dir=TMP)
        cls.plan = os.path.join(cls.dir, "mlp-2.pb")
        subprocess.run([HAPCTL, "plan", "--cluster", CLUSTER, "--model", "mlp",
                        "--save-plan", cls.plan], check=True, capture_output=True)
        cls.fake = os.path.join(cls.dir, "fake-executor")
        with open(cls.fake, "w") as f:
            f.write(FAKE_EXECUTOR)
        os.chmod(cls.fake, 0o755)

    def setUp(self):
        self.fake_dir = tempfile.mkdtemp(dir=self.dir)

    def rank_pids(self, n=2, seconds=30):
        deadline = time.time() + seconds
        paths = [os.path.join(self.fake_dir, f"rank{r}.pid") for r in range(n)]
        while time.time() < deadline:
            try:
                pids = []
                for path in paths:
                    with open(path) as f:
                        pids.append(int(f.read()))
                return pids
            except (OSError, ValueError):
                time.sleep(0.02)
        self.fail(f"the ranks did not start within {seconds} s")

    def start(self, mode, *extra, executor=None, new_group=False, ignore_sigchld=False):
        env = dict(os.environ, FAKE_DIR=self.fake_dir, FAKE_MODE=mode)
        out = open(os.path.join(self.fake_dir, "launch.log"), "w+")

        def child():
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if ignore_sigchld:
                signal.signal(signal.SIGCHLD, signal.SIG_IGN)
            if new_group:
                os.setpgid(0, 0)
        p = subprocess.Popen([LAUNCH, "--plan", self.plan, "--executor", executor or self.fake,
                              *extra], stdout=out, stderr=subprocess.STDOUT, env=env,
                             preexec_fn=child)
        self.addCleanup(out.close)
        self.addCleanup(lambda: p.poll() is None and p.kill())

        def cleanup_ranks():
            for path in glob.glob(os.path.join(self.fake_dir, "rank*.pid")):
                try:
                    with open(path) as f:
                        os.kill(int(f.read()), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
        self.addCleanup(cleanup_ranks)
        return p, out

    def finish(self, p, out, seconds=60):
        rc = p.wait(timeout=seconds)
        out.seek(0)
        return rc, out.read()

    def test_a_failing_rank_is_named_with_its_exit_code_or_signal(self):
        """It said 'rank 1 failed' for both, without the code or signal."""
        for mode, needle in (("exit3:1", "rank 1 exited with code 3; stopping the others"),
                             ("segv:1", "rank 1 was killed by SIGSEGV (Segmentation fault); "
                                        "stopping the others")):
            with self.subTest(mode=mode):
                self.setUp()
                p, out = self.start(mode)
                rc, text = self.finish(p, out)
                self.assertEqual(rc, 1, text)
                self.assertIn(needle, text)
                self.assertEqual(wait_gone(self.rank_pids()), [])

    def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(self):
        """Rank 1 fails; rank 0 ignores the SIGTERM that should stop it. The
        launcher waited for it forever. The grace period was a fixed 5 s: now
        --grace-seconds (a deployment whose ranks need longer to stop, or a
        test that wants it shorter)."""
        for extra, grace in (((), "5"), (("--grace-seconds", "0.5"), "0.5")):
            with self.subTest(grace=grace):
                self.setUp()
                p, out = self.start("ignore-term:0", "--steps", "1", *extra)
                pids = self.rank_pids()
                os.kill(pids[1], signal.SIGKILL)
                rc, text = self.finish(p, out)
                self.assertEqual(rc, 1, text)
                self.assertIn("rank 1 was killed by SIGKILL", text)
                self.assertIn(f"rank 0 did not stop within {grace} s of SIGTERM; killing it", text)
                self.assertEqual(wait_gone(pids), [])
                # hap-launch's own flag: not passed on to the executor.
                with open(os.path.join(self.fake_dir, "argv0")) as f:
                    self.assertNotIn("--grace-seconds", f.read())
        for bad in ("0", "0.05", "3601", "x", "nan"):
            r = subprocess.run([LAUNCH, "--plan", self.plan, "--executor", self.fake,
                                "--grace-seconds", bad], capture_output=True, text=True,
                               timeout=30)
            self.assertEqual(r.returncode, 2, (bad, r.stderr))
            self.assertIn("--grace-seconds must be seconds in [0.1, 3600]", r.stderr)

    def test_a_closed_standard_error_does_not_kill_the_launcher(self):
        """`hap-launch ... 2>&1 | head -1`: the launcher's first message to a
        closed pipe killed it with SIGPIPE before it had stopped the ranks or
        removed its rendezvous directory (left to the next start). Now the
        write fails, and the launch ends as it would have, cleaned up."""
        read_end, write_end = os.pipe()
        os.close(read_end)  # nobody reads: every write is EPIPE
        env = dict(os.environ, FAKE_DIR=self.fake_dir, FAKE_MODE="exit3:1")
        p = subprocess.Popen([LAUNCH, "--plan", self.plan, "--executor", self.fake],
                             stdout=write_end, stderr=write_end, env=env)
        os.close(write_end)
        self.addCleanup(lambda: p.poll() is None and p.kill())
        pids = self.rank_pids()
        rc = p.wait(timeout=60)
        self.assertEqual(rc, 1, "killed by SIGPIPE" if rc == -signal.SIGPIPE else rc)
        self.assertEqual(wait_gone(pids), [])
        self.assertEqual(glob.glob(f"/tmp/hap-rendezvous-{p.pid}-*"), [])

    def test_sigterm_to_the_launcher_stops_every_rank_and_says_so(self):
        """SIGTERM to the launcher: ranks that ignore it are killed after the
        grace period and the launcher exits 128 + 15 naming the signal (it
        hung; a rank that did stop was reported as a failed rank, exit 1)."""
        for mode in ("sleep", "ignore-term"):
            with self.subTest(mode=mode):
                self.setUp()
                p, out = self.start(mode)
                pids = self.rank_pids()
                p.send_signal(signal.SIGTERM)
                rc, text = self.finish(p, out)
                self.assertEqual(rc, 128 + signal.SIGTERM, text)
                self.assertIn("hap-launch: SIGTERM (Terminated): stopping the ranks", text)
                self.assertNotIn("stopping the others", text)
                self.assertEqual(wait_gone(pids), [])

    def test_a_deadline_stops_every_rank_and_exits_124(self):
        """--deadline bounds the whole run (there was none: a rank stuck in
        compute, with no peer to wait for, ran forever); ranks that ignore
        SIGTERM are killed after the grace period."""
        for mode in ("sleep", "ignore-term"):
            with self.subTest(mode=mode):
                self.setUp()
                p, out = self.start(mode, "--deadline", "1.5")
                pids = self.rank_pids()
                rc, text = self.finish(p, out)
                self.assertEqual(rc, 124, text)
                self.assertIn("hap-launch: the --deadline of 1.5 s passed; stopping the ranks", text)
                self.assertNotIn("stopping the others", text)
                self.assertEqual(wait_gone(pids), [])
                # hap-launch's own flag: not passed on to the executor.
                self.assertNotIn("--deadline", open(os.path.join(self.fake_dir, "argv0")).read())
        for bad in ("0", "-1", "x", "nan"):
            r = subprocess.run([LAUNCH, "--plan", self.plan, "--executor", self.fake,
                                "--deadline", bad], capture_output=True, text=True, timeout=30)
            self.assertEqual(r.returncode, 2, (bad, r.stderr))
            self.assertIn("--deadline must be seconds in [0.001, 1e9]", r.stderr)

    def test_a_killed_launchers_ranks_die_with_it(self):
        """A launcher killed outright left its ranks running (a one-rank
        plan to its last step, the others until their peers timed out)."""
        p, out = self.start("sleep")
        pids = self.rank_pids()
        p.kill()
        p.wait()
        self.assertEqual(wait_gone(pids), [], "the killed launcher's ranks still run")

    def test_a_killed_launchers_rendezvous_directory_goes_at_the_next_start(self):
        """Every launcher killed outright left a /tmp/hap-rendezvous-XXXXXX
        behind, with no owner to tell whose. Now it is named after its
        launcher and removed once that is gone; other directories stay."""
        p, out = self.start("sleep")
        self.rank_pids()
        made = glob.glob(f"/tmp/hap-rendezvous-{p.pid}-*")
        self.assertEqual(len(made), 1, made)
        p.kill()
        p.wait()
        self.assertTrue(os.path.isdir(made[0]))
        # Not ours: a directory of a launcher still running (this test) and
        # one without an owner.
        running = tempfile.mkdtemp(prefix=f"hap-rendezvous-{os.getpid()}-", dir="/tmp")
        ownerless = tempfile.mkdtemp(prefix="hap-rendezvous-", dir="/tmp")
        self.addCleanup(shutil.rmtree, running, True)
        self.addCleanup(shutil.rmtree, ownerless, True)
        self.setUp()
        q, out = self.start("ok")
        rc, text = self.finish(q, out)
        self.assertEqual(rc, 0, text)
        # Removed by this start (or by another launcher's meanwhile: tests
        # run side by side).
        self.assertFalse(os.path.exists(made[0]), text)
        self.assertTrue(os.path.isdir(running))
        self.assertTrue(os.path.isdir(ownerless))
        self.assertEqual(glob.glob(f"/tmp/hap-rendezvous-{q.pid}-*"), [])

    def test_a_parent_that_ignores_sigchld_does_not_hang_the_launcher(self):
        """Started with SIGCHLD ignored (a supervisor's signal(SIGCHLD,
        SIG_IGN) survives exec), hap-launch found no rank to reap, as the
        kernel reaped them, and waited for ever."""
        p, out = self.start("exit3:1", ignore_sigchld=True)
        rc, text = self.finish(p, out, seconds=30)
        self.assertEqual(rc, 1, text)
        self.assertIn("rank 1 exited with code 3", text)

    def test_its_own_flags_with_one_dash_stay_with_the_launcher(self):
        """-pin-cores (the flag parser takes one dash too) was passed on to
        the ranks, and hap-executor refused it: every rank failed."""
        p, out = self.start("ok", "-pin-cores", "-grace-seconds", "2")
        rc, text = self.finish(p, out)
        self.assertEqual(rc, 0, text)
        for r in range(2):
            with open(os.path.join(self.fake_dir, f"argv{r}")) as f:
                argv = f.read().split()
            self.assertNotIn("-pin-cores", argv)
            self.assertNotIn("-grace-seconds", argv)

    def test_a_killed_launchers_cgroups_go_at_the_next_start(self):
        """--cpu-shares groups of a launcher killed outright stayed forever."""
        if os.geteuid() != 0 or not os.access(CGROUP_ROOT, os.W_OK):
            self.skipTest(f"needs root and cgroup v1 cpu at {CGROUP_ROOT}")
        p, out = self.start("sleep", "--cpu-shares", "1,0.5")
        pids = self.rank_pids()
        groups = [f"{CGROUP_ROOT}/hap-launch-{p.pid}-r{r}" for r in range(2)]
        self.assertTrue(all(os.path.isdir(g) for g in groups), groups)
        p.kill()
        p.wait()
        self.assertEqual(wait_gone(pids), [])
        # A group of a pid now free that is not a launcher's stays (not
        # hap-demo-PID-r0: the demo tests running beside this one remove
        # those of dead pids at their start).
        other = f"{CGROUP_ROOT}/hap-launcher-{free_pid()}-r0"
        os.mkdir(other)
        self.addCleanup(lambda: os.path.isdir(other) and os.rmdir(other))
        self.setUp()
        q, out = self.start("ok", "--cpu-shares", "1,0.5")
        rc, text = self.finish(q, out)
        self.assertEqual(rc, 0, text)
        for g in groups:  # by this start, or another launcher's meanwhile
            self.assertFalse(os.path.exists(g), text)
        self.assertTrue(os.path.isdir(other))
        self.assertEqual(glob.glob(f"{CGROUP_ROOT}/hap-launch-{q.pid}-*"), [])

    def test_pin_cores_uses_the_cores_the_launcher_was_given(self):
        """Under `taskset -c LAST`, --pin-cores put rank 0 on core 0 anyway
        (rank i went to core i of the machine): two launchers given their
        own cores shared cores 0 and 1."""
        given = sorted(os.sched_getaffinity(0))
        if len(given) < 2:
            self.skipTest("needs 2 cores to tell them apart")
        last = given[-1]
        env = dict(os.environ, FAKE_DIR=self.fake_dir, FAKE_MODE="ok")
        p = subprocess.run(["taskset", "-c", str(last), LAUNCH, "--plan", self.plan,
                            "--executor", self.fake, "--pin-cores"], env=env,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        for r in range(2):
            with open(os.path.join(self.fake_dir, f"rank{r}.cores")) as f:
                self.assertEqual(f.read(), str(last), f"rank {r}")

    def test_a_checkpoint_directory_that_cannot_be_made_fails_before_training(self):
        """--checkpoint-dir under a file (/dev/full/ck) failed only at the
        first save, after training; now the rank fails at start naming it,
        before it waits for its peer (world 2, no peer: it would wait out
        --timeout)."""
        p = subprocess.run([EXECUTOR, "--plan", self.plan, "--rank", "0", "--world", "2",
                            "--rendezvous", self.fake_dir, "--timeout", "60", "--steps", "3",
                            "--checkpoint-dir", "/dev/full/ck"],
                           capture_output=True, text=True, timeout=50)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("--checkpoint-dir /dev/full/ck: '/dev/full' is not a directory", p.stderr)

    def test_bad_executor_flags_are_named_once_before_any_rank_starts(self):
        """hap-launch passed a bad executor flag on to every rank: each
        printed the error and exited (one --overlap after connecting to its
        peers), and the launcher reported 'rank 1 exited with code 1'."""
        for flags, error in ((["--overlap", "maybe"], "--overlap must be on or off, not 'maybe'"),
                             (["--steps", "0"], "steps"),
                             (["--data", "imagenet"], "--data must be synthetic, wikitext"),
                             (["--shuffle", "7"], "--shuffle applies to npy: and tokens: data"),
                             (["--checkpoint-dir", "/dev/full/ck"],
                              "--checkpoint-dir /dev/full/ck: '/dev/full' is not a directory")):
            with self.subTest(flags=flags):
                self.setUp()
                env = dict(os.environ, FAKE_DIR=self.fake_dir, FAKE_MODE="ok")
                r = subprocess.run([LAUNCH, "--plan", self.plan, "--executor", self.fake,
                                    *flags], capture_output=True, text=True, env=env,
                                   timeout=30)
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertEqual(r.stderr.count(error), 1, r.stderr)
                self.assertNotIn("rank", r.stderr)
                self.assertFalse(os.path.exists(os.path.join(self.fake_dir, "rank0.pid")),
                                 "a rank started")

    def test_a_missing_executor_is_named_before_anything_starts(self):
        """Each rank failed to exec and the launcher said 'rank 0 failed'."""
        missing = os.path.join(self.fake_dir, "no-such-executor")
        p, out = self.start("ok", executor=missing)
        rc, text = self.finish(p, out)
        self.assertEqual(rc, 1, text)
        self.assertIn(f"error: cannot run the executor '{missing}': No such file or directory",
                      text)
        self.assertNotIn("rank 0", text)
        self.assertEqual(glob.glob(f"/tmp/hap-rendezvous-{p.pid}-*"), [])

    def test_the_executor_is_found_next_to_a_launcher_run_through_path(self):
        """`hap-launch` found through PATH looked for ./hap-executor in the
        working directory."""
        env = dict(os.environ, PATH=os.path.dirname(os.path.realpath(LAUNCH)) + ":" +
                   os.environ.get("PATH", ""))
        p = subprocess.run(["hap-launch", "--plan", self.plan, "--steps", "1"], cwd=self.fake_dir,
                           env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("final loss", p.stdout)

    def test_standard_output_that_cannot_be_written_fails_the_run(self):
        """Rank 0's losses written to a full device: the run exited 0."""
        with open("/dev/full", "w") as full:
            p = subprocess.run([LAUNCH, "--plan", self.plan, "--steps", "2", "--executor",
                                EXECUTOR], stdout=full, stderr=subprocess.PIPE, text=True,
                               timeout=120)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("error: cannot write to standard output", p.stderr)
        self.assertIn("rank 0 exited with code 1", p.stderr)

    def test_a_stop_signal_while_the_testbed_is_made_removes_it(self):
        """SIGTERM while the namespaces were being made killed the launcher
        before it had a handler: the set stayed until the next start."""
        if os.geteuid() != 0 or not shutil.which("ip", path="/usr/sbin:/sbin:/usr/bin:/bin"):
            self.skipTest("needs root and iproute2 for network namespaces")
        for sig in (signal.SIGTERM, signal.SIGINT):
            with self.subTest(signal=sig.name):
                self.setUp()
                self.stop_while_the_testbed_is_made(sig)

    def stop_while_the_testbed_is_made(self, sig):
        # SIGINT as Ctrl-C sends it: to the launcher's process group, the ip
        # and tc commands included (they inherit the launcher's blocked stop
        # signals, so the testbed is finished, then removed).
        p, out = self.start("sleep", "--network", "nodes=2 between=1gbit", new_group=True)
        switch = os.path.join(NETNS_DIR, f"hapnet-{p.pid}-sw")
        deadline = time.time() + 30
        while not os.path.exists(switch) and p.poll() is None and time.time() < deadline:
            time.sleep(0.001)
        if p.poll() is not None:
            rc, text = self.finish(p, out)
            self.skipTest("no network testbed here: " + text.strip().splitlines()[-1])
        if sig == signal.SIGINT:
            # While one of the launcher's ip or tc commands runs.
            children = f"/proc/{p.pid}/task/{p.pid}/children"
            while p.poll() is None and time.time() < deadline:
                try:
                    with open(children) as f:
                        kids = f.read().split()
                except OSError:
                    kids = []
                if kids:
                    break
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
        rc, text = self.finish(p, out)
        left = sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(f"hapnet-{p.pid}-"))
        for n in left:
            subprocess.run(["ip", "netns", "del", n], env=dict(os.environ, PATH="/usr/sbin:/sbin:"
                                                                       "/usr/bin:/bin"))
        self.assertEqual(left, [], text)
        self.assertEqual(rc, 128 + sig, text)
        self.assertIn(f"{sig.name} ({signal.strsignal(sig)})", text)


if __name__ == "__main__":
    unittest.main(verbosity=2)
