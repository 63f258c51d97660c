"""The local runner end to end: `hapctl plan --save-plan` writes a plan,
hap-launch forks one hap-executor per rank on 127.0.0.1, and the ranks
train. Bad input: a plan for another world size, a rank out of range, a
corrupted or truncated plan file, a peer that dies mid-step (the survivor
times out with a clear error, no hang), a NaN loss (reported, clean stop).
Also: the GPT-style LM on WikiText-2 (valid split), 2 ranks, 200 steps,
must lose at least 25% of its initial loss."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_test_util as util  # noqa: E402

HAPCTL = util.HAPCTL
EXECUTOR = os.path.abspath(os.environ.get("HAP_EXECUTOR", ""))
LAUNCH = os.path.abspath(os.environ.get("HAP_LAUNCH", ""))
CLUSTER = os.path.abspath(os.environ.get("CPU_CLUSTER", ""))
DATA_DIR = os.environ.get("HAP_DATA_DIR", os.path.join(HERE, "..", "..", "shared", "data"))

SMALL_GPT = ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4",
             "--ffn", "64", "--seq", "16", "--batch", "8", "--vocab", "64"]


def plan(path, *extra, model=SMALL_GPT):
    util.run([HAPCTL, "plan", "--cluster", CLUSTER, *model, "--save-plan", path,
              *extra])
    return path


def losses(out):
    return [float(m.group(1)) for m in re.finditer(r"^step \d+ loss (\S+)", out, re.M)]


class ExecutorCliTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = util.tmpdir()
        cls.plan2 = plan(os.path.join(cls.dir, "gpt2.pb"), "--seed", "7")

    def run_rank(self, *args, timeout=120):
        return subprocess.run([EXECUTOR, *args], capture_output=True, text=True,
                              timeout=timeout)

    def test_launch_trains_and_ranks_agree_with_loss_falling(self):
        p = subprocess.run([LAUNCH, "--plan", self.plan2, "--steps", "30",
                            "--executor", EXECUTOR],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr)
        ls = losses(p.stdout)
        self.assertEqual(len(ls), 30, p.stdout)
        self.assertLess(sum(ls[-5:]) / 5, sum(ls[:5]) / 5, p.stdout)
        self.assertIn("mean step time", p.stdout)

    def test_a_spent_budget_is_noted_in_the_plan(self):
        """A state budget that cuts the search still gives a plan (saved), and
        says so in the table and in -o json; an uncut search has no notes."""
        path = os.path.join(util.tmpdir(), "cut.pb")
        args = ["plan", "--cluster", CLUSTER, *SMALL_GPT, "--max-states", "1"]
        table = util.run([HAPCTL, *args, "--save-plan", path]).stdout
        self.assertIn("note: the state budget (1 states) cut a search", table)
        self.assertGreater(os.path.getsize(path), 0)
        cut = util.hapctl_json(*args)
        self.assertTrue(any("state budget" in n for n in cut["notes"]), cut["notes"])
        self.assertFalse(cut["optimal"])
        whole = util.hapctl_json("plan", "--cluster", CLUSTER, *SMALL_GPT)
        self.assertEqual(whole["notes"], [])

    def test_plan_integer_flags_out_of_range(self):
        """hapctl plan --max-states 1e30 (cast out of range: a negative
        budget) planned a budget-cut plan; --seed 2.5 or 1e30 saved another
        seed. Each is refused naming the flag and value."""
        for flag, value in (("--max-states", "1e30"), ("--max-states", "0"),
                            ("--seed", "2.5"), ("--seed", "1e30"), ("--seed", "-1")):
            with self.subTest(flag=flag, value=value):
                path = os.path.join(util.tmpdir(), "p.pb")
                p = util.run([HAPCTL, "plan", "--cluster", CLUSTER, *SMALL_GPT, flag, value,
                              "--save-plan", path], check=False)
                self.assertEqual(p.returncode, 1, p.stdout)
                self.assertRegex(p.stderr, rf"flag {flag} must be an integer from \d+ "
                                           rf"to \d+, got '{value}'")
                self.assertFalse(os.path.exists(path))

    def test_client_number_flags_out_of_range(self):
        """hapctl create/deploy cast --steps 1e30, --threads 1e10, --seed -1,
        --join-stable 1e30 ... to integers out of range (UB) and truncated
        fractions (--seed 2.5), and sent them; each is now refused naming the
        flag and value, before anything is sent (no planner runs here)."""
        job = ["create", "job", "--id", "j", "--checkpoint-dir", "/tmp/j"]
        deploy = ["deploy", "plan", "p", "--executor", "cpu0=127.0.0.1:1"]
        for cmd, flag, value in (
                (["create", "plan"], "--seed", "-1"),
                (["create", "plan"], "--seed", "2.5"),
                (["create", "plan"], "--microbatches", "1e30"),
                (deploy, "--steps", "1e30"),
                (deploy, "--threads", "1e10"),
                (deploy, "--checkpoint-every", "-3"),
                (deploy, "--shuffle", "2.5"),
                (job, "--checkpoint-keep", "2.5"),
                (job, "--global-batch", "1e30"),
                (job, "--min-devices", "1e10"),
                (job, "--max-replans", "-1"),
                (job, "--join-stable", "1e30")):
            with self.subTest(cmd=cmd[0], flag=flag, value=value):
                p = util.run([HAPCTL, *cmd, "--server", "127.0.0.1:1", "--timeout", "5",
                              flag, value], check=False)
                self.assertEqual(p.returncode, 1, p.stdout)
                self.assertRegex(p.stderr, rf"INVALID_ARGUMENT: flag {flag} must be "
                                           rf"(an integer )?from -?\d+ to \d+.*, got '{value}'")

    def test_plan_with_a_bad_output_format_writes_nothing(self):
        """hapctl plan --save-plan P -o yml planned, wrote P and then refused
        -o; now -o is refused first and nothing is written."""
        path = os.path.join(util.tmpdir(), "p.pb")
        p = util.run([HAPCTL, "plan", "--cluster", CLUSTER, *SMALL_GPT, "--save-plan", path,
                      "-o", "yml"], check=False)
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertIn("-o must be table or json, got 'yml'", p.stderr)
        self.assertFalse(os.path.exists(path))

    def test_client_executor_flags_need_a_device_and_an_address_once(self):
        """--executor =HOST:PORT (no device) was sent as device ''; a device
        named twice kept the last address silently."""
        for cmd in (["deploy", "plan", "p"], ["create", "job", "--id", "j",
                                               "--checkpoint-dir", "/tmp/j"]):
            for flags, needle in (
                    (["--executor", "=127.0.0.1:1"], "--executor =127.0.0.1:1: expected "
                                                     "DEVICE=HOST:PORT"),
                    (["--executor", "cpu0=127.0.0.1:1", "--executor", "cpu0=127.0.0.1:2"],
                     "--executor names device cpu0 twice (127.0.0.1:1, 127.0.0.1:2)")):
                with self.subTest(cmd=cmd[0], flags=flags):
                    p = util.run([HAPCTL, *cmd, "--server", "127.0.0.1:1", "--timeout", "5",
                                  *flags], check=False)
                    self.assertEqual(p.returncode, 1, p.stdout)
                    self.assertIn(needle, p.stderr)

    def test_hapctl_input_file_is_a_directory_or_empty(self):
        """hapctl validate DIR said "graph '' names no loss tensor" and
        --cluster DIR "Unexpected end of string"; a directory or an empty
        file is now named as such."""
        d = util.tmpdir()
        empty = os.path.join(d, "empty.json")
        open(empty, "w").close()
        for path, what in ((d, "is a directory"), (empty, "is empty")):
            for args in (["validate", path],
                         ["plan", "--cluster", CLUSTER, "--graph", path],
                         ["plan", "--cluster", path, *SMALL_GPT],
                         ["calibrate", "--cluster", CLUSTER, "--plan", path, "--profile",
                          os.path.join(d, "prof"), "--out", os.path.join(d, "cal.json")]):
                with self.subTest(args=args):
                    p = util.run([HAPCTL, *args], check=False)
                    self.assertEqual(p.returncode, 1, p.stdout)
                    self.assertIn(f"'{path}' {what}", p.stderr)

    def test_plan_for_another_world_size(self):
        p = self.run_rank("--plan", self.plan2, "--rank", "0", "--world", "3",
                          "--rendezvous", util.tmpdir())
        self.assertEqual(p.returncode, 1)
        self.assertIn("the plan is for a world of 2 ranks, not 3", p.stderr)

    def test_rank_out_of_range(self):
        p = self.run_rank("--plan", self.plan2, "--rank", "2", "--world", "2",
                          "--rendezvous", util.tmpdir())
        self.assertEqual(p.returncode, 1)
        self.assertIn("rank 2 is out of range for a world of 2", p.stderr)

    def test_integer_flags_out_of_range(self):
        """--rank 4294967296 ran as rank 0 (cut to an int) and --steps 1e30
        was called not positive; each is refused naming the flag and value."""
        for flag, value in (("--rank", "4294967296"), ("--world", "4294967298"),
                            ("--steps", "1e30"), ("--steps", "2.5"),
                            ("--log-every", "nan"), ("--checkpoint-keep", "-1")):
            with self.subTest(flag=flag, value=value):
                args = {"--rank": "0", "--world": "2", "--timeout": "3", flag: value}
                p = self.run_rank("--plan", self.plan2, "--rendezvous", util.tmpdir(),
                                  *[x for kv in args.items() for x in kv])
                self.assertEqual(p.returncode, 1, p.stderr)
                self.assertRegex(p.stderr, rf"flag {flag} must be an integer from -?\d+ "
                                           rf"to \d+, got '{value}'")
        p = subprocess.run([LAUNCH, "--plan", self.plan2, "--cpu-period-us", "1e30",
                            "--executor", EXECUTOR],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--cpu-period-us must be an integer from 1000 to 1000000, got '1e30'",
                      p.stderr)

    def test_corrupted_and_truncated_plans(self):
        data = open(self.plan2, "rb").read()
        bad = os.path.join(self.dir, "corrupt.pb")
        with open(bad, "wb") as f:
            f.write(b"\xff\xfe garbage" * 50)
        p = self.run_rank("--plan", bad, "--rank", "0", "--world", "2",
                          "--rendezvous", util.tmpdir())
        self.assertEqual(p.returncode, 1)
        self.assertIn("is not a hap.v1.Plan", p.stderr)
        # A cut in the middle either fails to parse or fails the content hash.
        cut = os.path.join(self.dir, "truncated.pb")
        with open(cut, "wb") as f:
            f.write(data[: len(data) * 2 // 3])
        p = self.run_rank("--plan", cut, "--rank", "0", "--world", "2",
                          "--rendezvous", util.tmpdir())
        self.assertEqual(p.returncode, 1)
        self.assertRegex(p.stderr, r"is not a hap.v1.Plan|content hash|not lowered|world of")
        missing = self.run_rank("--plan", os.path.join(self.dir, "nope.pb"), "--rank",
                                "0", "--world", "2", "--rendezvous", util.tmpdir())
        self.assertEqual(missing.returncode, 1)
        self.assertIn("cannot open plan", missing.stderr)

    def test_launch_refuses_an_empty_plan_and_a_directory(self):
        """An empty file or a directory as --plan fails naming it; it
        launched no rank and exited 0 before."""
        empty = os.path.join(self.dir, "empty.pb")
        open(empty, "wb").close()
        for path, needle in ((empty, "is empty"), (util.tmpdir(), "is a directory")):
            with self.subTest(plan=path):
                p = subprocess.run([LAUNCH, "--plan", path, "--steps", "3",
                                    "--executor", EXECUTOR],
                                   capture_output=True, text=True, timeout=120)
                self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
                self.assertIn(f"plan '{path}' {needle}", p.stderr)
                r = self.run_rank("--plan", path, "--rank", "0", "--world", "1",
                                  "--rendezvous", util.tmpdir())
                self.assertEqual(r.returncode, 1, r.stderr)
                self.assertIn(f"plan '{path}' {needle}", r.stderr)

    def test_launch_refuses_the_flags_it_sets_per_rank(self):
        """hap-launch --rank 1 passed it to every rank (the last --rank wins):
        all ranks were rank 1 and waited out --timeout for a rank 0."""
        for flag, value in (("--rank", "1"), ("--world", "2"), ("--rendezvous", "/tmp")):
            with self.subTest(flag=flag):
                p = subprocess.run([LAUNCH, "--plan", self.plan2, "--steps", "2",
                                    "--timeout", "60", flag, value, "--executor", EXECUTOR],
                                   capture_output=True, text=True, timeout=120)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(f"hap-launch sets {flag} for each rank itself, got {flag} "
                              f"'{value}'", p.stderr)

    def test_a_profile_prefix_that_cannot_be_written_fails_before_training(self):
        """--profile into a missing directory failed only after the last
        step; now the rank fails at start naming the directory, before it
        waits for its peer (world 2, no peer: it would wait out --timeout)."""
        missing = os.path.join(util.tmpdir(), "no-such-dir")
        p = self.run_rank("--plan", self.plan2, "--rank", "0", "--world", "2",
                          "--rendezvous", util.tmpdir(), "--timeout", "60", "--steps", "5",
                          "--profile", os.path.join(missing, "prof"), timeout=50)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn(f"--profile {missing}/prof: the directory '{missing}' does not exist",
                      p.stderr)

    def test_a_profile_of_a_gpu_rank_run_on_the_cpu_is_refused(self):
        """The profile names the plan's device, which hapctl calibrate fits:
        a GPU rank run with --device cpu wrote CPU times as that GPU's, and
        the GPU was priced as a CPU in every later plan. Refused at start."""
        d = util.tmpdir()
        dev = lambda i: {"id": f"gpu{i}", "kind": "GPU", "model": "H100",
                         "flops": [{"dtype": "FLOAT32", "flops": 5e13}],
                         "memoryBytes": "80000000000", "node": "n", "localIndex": i}
        cluster = os.path.join(d, "two-gpus.json")
        with open(cluster, "w") as f:
            json.dump({"nodes": [{"name": "n", "devices": [dev(0), dev(1)]}],
                       "defaults": {"intraNodeBandwidthBytesPerSecond": 1e11,
                                    "intraNodeLatencySeconds": 1e-05}}, f)
        path = os.path.join(d, "gpu.pb")
        util.run([HAPCTL, "plan", "--cluster", cluster, *SMALL_GPT, "--save-plan", path])
        p = self.run_rank("--plan", path, "--rank", "0", "--world", "2", "--device", "cpu",
                          "--rendezvous", util.tmpdir(), "--timeout", "60", "--steps", "5",
                          "--profile", os.path.join(d, "prof"), timeout=50)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("--profile: rank 0's plan device gpu0 is a GPU, but the rank runs on "
                      "the CPU", p.stderr)

    def test_peer_dies_mid_training(self):
        rdv = util.tmpdir()
        common = ["--plan", self.plan2, "--world", "2", "--rendezvous", rdv,
                  "--steps", "100000", "--timeout", "3"]
        r0 = subprocess.Popen([EXECUTOR, "--rank", "0", *common],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        r1 = subprocess.Popen([EXECUTOR, "--rank", "1", *common],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            # Wait for rank 0 to report a few steps, then kill rank 1.
            seen = 0
            deadline = time.time() + 120
            while seen < 3 and time.time() < deadline:
                line = r0.stdout.readline()
                if not line:
                    break
                seen += line.startswith("step ")
            self.assertEqual(seen, 3, "rank 0 did not train")
            os.kill(r1.pid, signal.SIGKILL)
            _, err = r0.communicate(timeout=60)
        finally:
            for p in (r0, r1):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        self.assertEqual(r0.returncode, 1, err)
        # The killed peer's connection closed, and rank 0 says so at once,
        # rather than waiting out --timeout (this was a regex any timeout
        # matched, and a wall-clock limit of 30 s).
        self.assertRegex(err, r"error: .*training step.*connection to a peer failed")

    def test_nan_loss_stops_training_cleanly(self):
        nan_plan = plan(os.path.join(self.dir, "nan.pb"), "--lr", "1e30",
                        "--optimizer", "sgd")
        p = subprocess.run([LAUNCH, "--plan", nan_plan, "--steps", "50",
                            "--executor", EXECUTOR],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertRegex(p.stderr, r"training stopped: the loss is -?(nan|inf) at step \d+")

    @unittest.skipUnless(os.path.isdir(os.path.join(DATA_DIR, "wikitext-2")),
                         "WikiText-2 not found (set HAP_DATA_DIR)")
    def test_gpt_learns_wikitext2_on_two_ranks(self):
        model = ["--model", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4",
                 "--ffn", "128", "--seq", "32", "--batch", "16"]
        lm = plan(os.path.join(self.dir, "lm.pb"), "--optimizer", "adam", "--lr", "3e-3",
                  "--clip-norm", "1.0", "--seed", "1", model=model)
        p = subprocess.run([LAUNCH, "--plan", lm, "--steps", "200", "--data", "wikitext",
                            "--data-dir", DATA_DIR, "--log-every", "20",
                            "--executor", EXECUTOR],
                           capture_output=True, text=True, timeout=1200)
        self.assertEqual(p.returncode, 0, p.stderr)
        print(p.stdout)
        ls = losses(p.stdout)
        self.assertGreaterEqual(len(ls), 10)
        # From ~ln(18328) = 9.8 at initialisation: at least 25% lower.
        self.assertLess(ls[-1], 0.75 * ls[0], p.stdout)
        self.assertRegex(p.stdout, r"perplexity \d+")


if __name__ == "__main__":
    util.main("executor_cli_test", needs_torch=False)
