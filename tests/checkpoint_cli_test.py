"""Checkpoints through the real binaries (hap-executor, hap-launch,
hapctl): a rank SIGKILLed while a checkpoint is being written leaves the
previous checkpoint intact, and a run resumed from it, on another plan with
another world size, continues with the losses of an uninterrupted run;
`hapctl checkpoint inspect` and `export` read what the ranks wrote; bad
checkpoints are refused before step 1 with the file or tensor named, and
`hapctl checkpoint verify` finds each of them damaged before a run does."""

import json
import os
import re
import shutil
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
CLUSTER2 = os.path.abspath(os.environ.get("CPU_CLUSTER2", ""))
CLUSTER4 = os.path.abspath(os.environ.get("CPU_CLUSTER4", ""))

# Big enough that a checkpoint takes a while to write (~50 MB with Adam).
GPT = ["--model", "gpt", "--layers", "2", "--hidden", "128", "--heads", "4", "--ffn", "256",
       "--seq", "16", "--batch", "8", "--optimizer", "adam", "--lr", "1e-3", "--seed", "3"]


def plan(path, cluster, *extra, seed="3"):
    """GPT planned on `cluster`; `extra` (FLAG VALUE pairs) replace GPT's
    values of the same flags, or are added (hapctl refuses a zoo parameter
    given twice)."""
    model = GPT[:GPT.index("--seed")] + ["--seed", seed]
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in model:
            model[model.index(flag) + 1] = value
        else:
            model += [flag, value]
    util.run([HAPCTL, "plan", "--cluster", cluster, *model, "--save-plan", path])
    return path


def losses(out):
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"^step (\d+) loss (\S+)", out, re.M)}


def write_npy(path, n, s, high, seed, poison=None):
    """An int64 (n, s) .npy, version 1.0, written from the format's spec;
    `poison` = (row, value) puts a value in column 0 of that row."""
    import random
    rng = random.Random(seed)
    values = [rng.randrange(high) for _ in range(n * s)]
    if poison:
        values[poison[0] * s] = poison[1]
    header = "{'descr': '<i8', 'fortran_order': False, 'shape': (%d, %d), }" % (n, s)
    header += " " * (64 - (10 + len(header) + 1) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode())
        f.write(b"".join(v.to_bytes(8, "little", signed=True) for v in values))


def launch(*args, timeout=600):
    return subprocess.run([LAUNCH, "--executor", EXECUTOR, *args], capture_output=True,
                          text=True, timeout=timeout)


class CheckpointCliTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = util.tmpdir()
        cls.plan2 = plan(os.path.join(cls.dir, "p2.pb"), CLUSTER2)
        cls.plan4 = plan(os.path.join(cls.dir, "p4.pb"), CLUSTER4)
        p = launch("--plan", cls.plan2, "--steps", "12")
        assert p.returncode == 0, p.stderr
        cls.reference = losses(p.stdout)
        assert len(cls.reference) == 12, p.stdout

    def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(self):
        ckpt = os.path.join(util.tmpdir(), "ckpt")
        rdv = util.tmpdir()
        common = ["--plan", self.plan2, "--world", "2", "--rendezvous", rdv, "--steps", "100000",
                  "--checkpoint-dir", ckpt, "--checkpoint-every", "2", "--timeout", "10"]
        ranks = [subprocess.Popen([EXECUTOR, "--rank", str(r), *common],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        for p in ranks:
            self.addCleanup(lambda p=p: p.poll() is None and p.kill())
        # Wait for a committed checkpoint, then for the next write to be in
        # progress (its temporary directory holding a file), and kill rank 1.
        deadline = time.time() + 240
        killed_during = None
        while time.time() < deadline and killed_during is None:
            names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
            committed = [n for n in names if n.startswith("step-") and
                         os.path.exists(os.path.join(ckpt, n, "COMMITTED"))]
            for n in names:
                tmp = os.path.join(ckpt, n)
                if committed and n.startswith(".tmp-step-") and os.path.isdir(tmp):
                    try:
                        busy = bool(os.listdir(tmp))
                    except OSError:
                        busy = False
                    if busy:
                        ranks[1].send_signal(signal.SIGKILL)
                        killed_during = n
                        break
            time.sleep(0.0005)
        self.assertIsNotNone(killed_during, "no checkpoint write was caught in progress")
        ranks[1].wait(timeout=30)
        out0, err0 = ranks[0].communicate(timeout=120)
        self.assertNotEqual(ranks[0].returncode, 0, out0)  # its peer died: a clear error
        in_progress = int(killed_during[len(".tmp-step-"):])
        complete = sorted(int(n[5:]) for n in os.listdir(ckpt) if n.startswith("step-") and
                          os.path.exists(os.path.join(ckpt, n, "COMMITTED")))
        self.assertTrue(complete, os.listdir(ckpt))
        last = complete[-1]
        self.assertLess(last, in_progress + 1)
        # The previous checkpoint resumes, on 4 ranks, to two steps past it,
        # with the losses of the uninterrupted 2-rank run (where it has them).
        target = last + 2
        p = launch("--plan", self.plan4, "--resume", ckpt, "--steps", str(target))
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn(f"resuming from {ckpt}/step-{last:08d} (step {last}", p.stdout)
        got = losses(p.stdout)
        self.assertEqual(sorted(got), [last, last + 1], p.stdout)
        for step, loss in got.items():
            if step in self.reference:
                self.assertAlmostEqual(loss, self.reference[step], delta=1e-4 * abs(loss) + 1e-5)

    def test_resume_on_another_world_size_equals_the_uninterrupted_run(self):
        ckpt = os.path.join(util.tmpdir(), "ckpt")
        p = launch("--plan", self.plan4, "--steps", "6", "--checkpoint-dir", ckpt)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn(f"checkpoint: 6 steps done -> {ckpt}/step-00000006", p.stdout)
        p = launch("--plan", self.plan2, "--steps", "12", "--resume", ckpt)
        self.assertEqual(p.returncode, 0, p.stderr)
        got = losses(p.stdout)
        self.assertEqual(sorted(got), list(range(6, 12)), p.stdout)
        for step, loss in got.items():
            self.assertAlmostEqual(loss, self.reference[step], delta=1e-4 * abs(loss) + 1e-5)
        # A plan made with another seed continues the same run: the
        # synthetic batches and dropout masks of the checkpoint's seed.
        other_seed = plan(os.path.join(util.tmpdir(), "p2-seed4.pb"), CLUSTER2, seed="4")
        p = launch("--plan", other_seed, "--steps", "12", "--resume", ckpt)
        self.assertEqual(p.returncode, 0, p.stderr)
        for step, loss in losses(p.stdout).items():
            self.assertAlmostEqual(loss, self.reference[step], delta=1e-4 * abs(loss) + 1e-5)
        # Nothing left to do past the end.
        p = launch("--plan", self.plan2, "--steps", "6", "--resume", ckpt)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("nothing to do: the checkpoint is at step 6", p.stdout)

        # inspect and export read it.
        info = json.loads(util.run([HAPCTL, "checkpoint", "inspect", ckpt, "-o", "json"]).stdout)
        self.assertEqual(int(info["trainer"]["step"]), 6)
        self.assertEqual(info["trainer"]["world_size"], 4)
        names = {t["name"] for t in info["index"]["tensors"]}
        self.assertIn("decoder/weight#adam_m", names)
        table = util.run([HAPCTL, "checkpoint", "inspect", ckpt]).stdout
        self.assertRegex(table, r"step +6 \(48 samples seen, global batch 8\)")
        out = os.path.join(util.tmpdir(), "model.safetensors")
        util.run([HAPCTL, "checkpoint", "export", ckpt, "-o", out])
        with open(out, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        self.assertIn("decoder/weight", header)
        self.assertNotIn("decoder/weight#adam_m", header)

        # --init-weights from the export starts from the trained weights: the
        # loss of step 0's batch is not a fresh start's.
        p = launch("--plan", self.plan2, "--steps", "1", "--init-weights", out)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertNotAlmostEqual(losses(p.stdout)[0], self.reference[0], places=3)

    def test_npy_data_shuffled_continues_its_sequence_across_a_resume(self):
        data = os.path.join(util.tmpdir(), "data")
        os.makedirs(data)
        # GPT inputs tokens[8, 16] and labels[8*16]: files (N, 16), N = 20.
        write_npy(os.path.join(data, "tokens.npy"), 20, 16, 18328, seed=1)
        write_npy(os.path.join(data, "labels.npy"), 20, 16, 18328, seed=2)
        spec = ["--data", "npy:" + data, "--shuffle", "7"]
        whole = launch("--plan", self.plan2, "--steps", "8", *spec)
        self.assertEqual(whole.returncode, 0, whole.stderr)
        ckpt = os.path.join(util.tmpdir(), "ckpt")
        first = launch("--plan", self.plan4, "--steps", "4", "--checkpoint-dir", ckpt, *spec)
        self.assertEqual(first.returncode, 0, first.stderr)
        # The checkpoint records the data's size, which a resume checks.
        table = util.run([HAPCTL, "checkpoint", "inspect", ckpt]).stdout
        self.assertRegex(table, r"data +npy:\S+ \(20 samples\), shuffled \(seed 7\)")
        rest = launch("--plan", self.plan2, "--steps", "8", "--resume", ckpt, *spec)
        self.assertEqual(rest.returncode, 0, rest.stderr)
        want, got = losses(whole.stdout), {**losses(first.stdout), **losses(rest.stdout)}
        self.assertEqual(sorted(got), list(range(8)))
        for step in range(8):
            self.assertAlmostEqual(got[step], want[step], delta=1e-4 * abs(want[step]) + 1e-5)
        # The same spec over data regenerated with more samples: each step
        # would read other samples (some skipped, some twice), and the resume
        # went on silently. It is refused before step 1, naming both sizes.
        write_npy(os.path.join(data, "tokens.npy"), 24, 16, 18328, seed=1)
        write_npy(os.path.join(data, "labels.npy"), 24, 16, 18328, seed=2)
        grown = launch("--plan", self.plan2, "--steps", "8", "--resume", ckpt, *spec)
        self.assertEqual(grown.returncode, 1, grown.stdout)
        self.assertIn("holding 20, this run has 24 (the data changed since)", grown.stderr)
        self.assertNotIn("loss", grown.stdout)
        write_npy(os.path.join(data, "tokens.npy"), 20, 16, 18328, seed=1)
        write_npy(os.path.join(data, "labels.npy"), 20, 16, 18328, seed=2)
        # Another shuffle seed is another sequence.
        other = launch("--plan", self.plan2, "--steps", "2", "--data", "npy:" + data,
                       "--shuffle", "8")
        self.assertNotAlmostEqual(losses(other.stdout)[1], want[1], places=4)
        # Bad data stops before step 1, naming file, row and value.
        write_npy(os.path.join(data, "labels.npy"), 20, 16, 18328, seed=2, poison=(13, 99999))
        bad = launch("--plan", self.plan2, "--steps", "2", "--data", "npy:" + data)
        self.assertEqual(bad.returncode, 1, bad.stdout)
        self.assertRegex(bad.stderr, r"labels\.npy.*13.*99999")
        self.assertNotIn("step 0 loss", bad.stdout)

    def test_ranks_that_find_different_checkpoints_refuse_to_train(self):
        # Each rank resolves --resume DIR itself, to the newest complete
        # checkpoint it sees there. Node-local directories that differ (a
        # save that reached one node only) gave ranks different steps, and
        # they trained on from different states without a word. Now they
        # compare before step 1: a copy of the same checkpoint agrees, an
        # older one is named on both sides.
        ckpt = os.path.join(util.tmpdir(), "ckpt")
        p = launch("--plan", self.plan2, "--steps", "4", "--checkpoint-dir", ckpt,
                   "--checkpoint-every", "2")
        self.assertEqual(p.returncode, 0, p.stderr)
        copy = os.path.join(util.tmpdir(), "copy")
        shutil.copytree(ckpt, copy)
        older = os.path.join(util.tmpdir(), "older")
        shutil.copytree(ckpt, older)
        shutil.rmtree(os.path.join(older, "step-00000004"))

        def run_ranks(dir0, dir1):
            rdv = util.tmpdir()
            common = ["--plan", self.plan2, "--world", "2", "--rendezvous", rdv, "--steps", "6",
                      "--timeout", "60"]
            ranks = [subprocess.Popen([EXECUTOR, "--rank", str(r), *common, "--resume", d],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for r, d in enumerate([dir0, dir1])]
            for p in ranks:
                self.addCleanup(lambda p=p: p.poll() is None and p.kill())
            return [(p.wait(timeout=300),) + p.communicate() for p in ranks]

        (rc0, out0, err0), (rc1, out1, err1) = run_ranks(ckpt, copy)
        self.assertEqual((rc0, rc1), (0, 0), err0 + err1)
        self.assertEqual(sorted(losses(out0)), [4, 5], out0)
        for step, loss in losses(out0).items():
            self.assertAlmostEqual(loss, self.reference[step], delta=1e-4 * abs(loss) + 1e-5)

        (rc0, out0, err0), (rc1, out1, err1) = run_ranks(ckpt, older)
        self.assertNotEqual(rc0, 0, out0)
        self.assertNotEqual(rc1, 0, out1)
        self.assertIn(f"rank 0 starts from checkpoint {ckpt}/step-00000004 (step 4) but rank 1 "
                      f"from checkpoint {older}/step-00000002 (step 2)", err0)
        self.assertIn(f"rank 1 starts from checkpoint {older}/step-00000002 (step 2) but rank 0 "
                      f"from checkpoint {ckpt}/step-00000004 (step 4)", err1)
        self.assertEqual(losses(out0), {})
        self.assertEqual(losses(out1), {})

    def test_a_fresh_run_sets_aside_the_checkpoints_of_the_run_it_replaces(self):
        # The same command twice, without --resume: the second run trained to
        # step 2 and then failed (a complete checkpoint of step 2 existed), and
        # could never save. It replaces the first run as a run resumed from
        # step 0 would: the first run's checkpoints are set aside, not lost.
        ckpt = os.path.join(util.tmpdir(), "ckpt")
        args = ["--plan", self.plan2, "--steps", "4", "--checkpoint-dir", ckpt,
                "--checkpoint-every", "2"]
        p = launch(*args)
        self.assertEqual(p.returncode, 0, p.stderr)
        again = launch(*args)
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertIn("checkpoint: 4 steps done", again.stdout)
        self.assertEqual(sorted(os.listdir(ckpt)),
                         ["step-00000002", "step-00000004", "superseded-step-00000002",
                          "superseded-step-00000004"])

    def test_bad_checkpoints_are_refused_before_step_1(self):
        ckpt = os.path.join(util.tmpdir(), "ckpt")
        p = launch("--plan", self.plan2, "--steps", "2", "--checkpoint-dir", ckpt)
        self.assertEqual(p.returncode, 0, p.stderr)
        step = os.path.join(ckpt, "step-00000002")

        sound = util.run([HAPCTL, "checkpoint", "verify", ckpt])
        self.assertRegex(sound.stdout, r"step-00000002 \(step 2\): (\d+) of \1 tensor slices "
                                       r"read whole, .* (\d+) checked against their CRC-32C: "
                                       r"sound")

        def refused(damage, message, *extra):
            bad = os.path.join(util.tmpdir(), "bad")
            shutil.copytree(ckpt, bad)
            damage(os.path.join(bad, "step-00000002"))
            # verify finds it (exit 1, the same file or tensor named), and
            # changes nothing.
            v = util.run([HAPCTL, "checkpoint", "verify", bad], check=False)
            self.assertEqual(v.returncode, 1, v.stdout + v.stderr)
            self.assertIn(message, v.stdout + v.stderr)
            before = {n: open(os.path.join(bad, "step-00000002", n), "rb").read()
                      for n in os.listdir(os.path.join(bad, "step-00000002"))}
            r = launch("--plan", self.plan2, "--steps", "4", "--resume", bad, *extra)
            self.assertEqual(r.returncode, 1, r.stdout)
            self.assertIn(message, r.stderr)
            # Damage says what to do about it.
            self.assertIn("(the checkpoint is damaged: `hapctl checkpoint verify " + bad, r.stderr)
            self.assertNotIn("step 2 loss", r.stdout)
            after = {n: open(os.path.join(bad, "step-00000002", n), "rb").read()
                     for n in os.listdir(os.path.join(bad, "step-00000002"))}
            self.assertEqual(before, after)  # nothing overwritten

        def truncate(d):
            with open(os.path.join(d, "rank-00001-of-00002.safetensors"), "r+b") as f:
                f.truncate(1000)

        def flip_a_bit(d):  # in the last tensor's last byte: size and header intact
            with open(os.path.join(d, "rank-00000-of-00002.safetensors"), "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)[0]
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last ^ 0x10]))

        refused(truncate, "rank-00001-of-00002.safetensors is not a valid safetensors file")
        refused(flip_a_bit, "rank-00000-of-00002.safetensors is damaged: the bytes of tensor")
        refused(lambda d: os.remove(os.path.join(d, "rank-00000-of-00002.safetensors")),
                "rank-00000-of-00002.safetensors")
        refused(lambda d: open(os.path.join(d, "index.json"), "w").write("{oops"),
                "index.json is corrupted")
        other = plan(os.path.join(self.dir, "other.pb"), CLUSTER2, "--hidden", "64")
        r = launch("--plan", other, "--steps", "4", "--resume", ckpt)
        self.assertEqual(r.returncode, 1)
        self.assertRegex(r.stderr, r"is of another graph: parameter '[^']+' is F32\[[0-9,]+\] "
                                   r"there and F32\[[0-9,]+\] in the model")
        r = launch("--plan", self.plan2, "--steps", "4", "--resume", step + "-nope")
        self.assertEqual(r.returncode, 1)
        self.assertIn("no checkpoint directory", r.stderr)


if __name__ == "__main__":
    util.main("checkpoint_cli_test", needs_torch=False)
