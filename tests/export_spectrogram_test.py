"""Audio front ends through the exporter: torchaudio's Spectrogram,
MelSpectrogram and AmplitudeToDB (torchaudio 0.13 from Debian's
python3-torchaudio) and the IR's log op behind torch.log/log10/log2/log1p.

torchaudio.functional.spectrogram is recorded as one call and exported as
real ops (tools/fx_export/ops_audio.py): the centered, padded waveform's
frames times the window and the DFT as one conv1d per real and imaginary
part, then re * re + im * im. A learned Conv1d before it (a pre-emphasis)
makes the spectrogram's backward matter: its weight's gradient passes
through the framing, the padding and the DFT. Each case against PyTorch's
loss and every parameter's gradient in float64 (the reference evaluator,
tests/hap_ir_eval.py); the refusals name what they refuse; a log-mel conv
classifier trains 3 SGD steps on 2 ranks with the dp-even and the
synthesized plan as PyTorch does."""

import os
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402

try:
    import torchaudio.transforms as T
except ImportError:  # no torchaudio: the tests skip
    T = None

LAUNCH = os.environ.get("HAP_LAUNCH")
EXECUTOR = os.environ.get("HAP_EXECUTOR")
CPU_CLUSTER = os.environ.get("CPU_CLUSTER")
BATCH, STEPS, LR = 4, 3, 0.05
SAMPLES = 96


def labels(n, classes, seed=0):
    return torch.randint(0, classes, (n,),
                         generator=torch.Generator().manual_seed(seed))


class Classifier(nn.Module):
    """A learned pre-emphasis (Conv1d) on the waveform [n, 1, samples], the
    front end `front` ([n, 1, samples] -> [n, 1, freq, frames]), then a
    small conv classifier."""

    def __init__(self, front, classes=3):
        super().__init__()
        self.pre = nn.Conv1d(1, 1, 3, padding=1)
        self.front = front
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4, classes)

    def forward(self, x, labels):
        h = self.front(self.pre(x))  # [n, 1, freq, frames]
        h = F.relu(self.conv(h)).mean((2, 3))
        return F.cross_entropy(self.fc(h), labels)


class LogMel(nn.Module):
    """MelSpectrogram then AmplitudeToDB(stype='power', top_db=None)."""

    def __init__(self, **kw):
        super().__init__()
        self.mel = T.MelSpectrogram(sample_rate=8000, n_fft=32, hop_length=8,
                                    n_mels=8, **kw)
        self.db = T.AmplitudeToDB(stype="power")

    def forward(self, x):
        return self.db(self.mel(x))


class Magnitude(nn.Module):
    def forward(self, z):
        return z.abs()


@unittest.skipIf(T is None, "torchaudio is not installed")
class ExportSpectrogramTest(ExportTestCase):
    def test_spectrogram_gives_pytorchs_loss_and_gradients(self):
        configs = [
            dict(n_fft=16),
            dict(n_fft=16, center=False),
            dict(n_fft=16, pad_mode="constant"),
            dict(n_fft=16, pad_mode="replicate"),
            dict(n_fft=20, hop_length=7, win_length=14),
            dict(n_fft=15, hop_length=3, win_length=15, center=False),
            dict(n_fft=16, hop_length=5, pad=3, onesided=False),
            dict(n_fft=16, window_fn=torch.ones),
        ]
        x = torch.randn(2, 1, SAMPLES, dtype=torch.float64)
        for kw in configs:
            with self.subTest(**{k: getattr(v, "__name__", v)
                                 for k, v in kw.items()}):
                torch.manual_seed(0)
                m = Classifier(T.Spectrogram(**kw)).double()
                g, _ = self.assert_loss_and_gradients(
                    m, {"x": x, "labels": labels(2, 3)})
                types = [op["type"] for op in g["ops"]]
                # One conv per DFT part besides the model's two.
                self.assertEqual(types.count("conv2d"), 4, types)

    def test_log_mel_spectrogram_classifier(self):
        for kw in (dict(), dict(center=False),
                   dict(pad_mode="constant", win_length=24)):
            with self.subTest(**kw):
                torch.manual_seed(0)
                m = Classifier(LogMel(**kw)).double()
                x = torch.randn(3, 1, SAMPLES, dtype=torch.float64)
                g, _ = self.assert_loss_and_gradients(
                    m, {"x": x, "labels": labels(3, 3)})
                types = {op["type"] for op in g["ops"]}
                self.assertTrue({"log", "matmul", "conv2d"} <= types, types)

    def test_log_functions_and_methods(self):
        class Logs(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x, labels):
                h = self.fc(x)
                p = h * h + 0.5  # positive
                h = (torch.log(p) + p.log10() * 0.5 - torch.log2(p) +
                     torch.log1p(p) * 2 + p.log() + torch.log10(p))
                return F.cross_entropy(h, labels)

        g, _ = self.assert_loss_and_gradients(
            Logs().double(), {"x": torch.randn(5, 4, dtype=torch.float64),
                              "labels": labels(5, 4)})
        types = [op["type"] for op in g["ops"]]
        self.assertEqual(types.count("log"), 6, types)

    def test_refusals_name_what_they_refuse(self):
        x = torch.randn(2, 1, SAMPLES)
        cases = [
            # The complex spectrum's magnitude, so that PyTorch runs it.
            (nn.Sequential(T.Spectrogram(n_fft=16, power=None), Magnitude()),
             "power=None"),
            (T.Spectrogram(n_fft=16, power=1.0), "power=1.0"),
            (T.Spectrogram(n_fft=16, normalized=True), "normalized=True"),
            (nn.Sequential(T.Spectrogram(n_fft=16),
                           T.AmplitudeToDB(top_db=80.0)), "top_db=80.0"),
        ]
        for front, needle in cases:
            with self.subTest(needle):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(Classifier(front),
                                     {"x": x, "labels": labels(2, 3)})
                self.assertIn(needle, str(cm.exception))
                self.assertIn("is not supported", str(cm.exception))

    def test_log_mel_classifier_trains_like_pytorch_on_two_ranks(self):
        if not (LAUNCH and EXECUTOR and CPU_CLUSTER):
            self.skipTest("HAP_LAUNCH, HAP_EXECUTOR, CPU_CLUSTER not given")
        torch.manual_seed(0)
        m = Classifier(LogMel()).double()
        gen = torch.Generator().manual_seed(7)
        xs = torch.randn(STEPS * BATCH, 1, SAMPLES, generator=gen,
                         dtype=torch.float64)
        ys = torch.randint(0, 3, (STEPS * BATCH,), generator=gen)
        start = {k: v.detach().clone() for k, v in m.named_parameters()}
        final = U.assert_trains_like_pytorch(self, m, xs, ys, BATCH, STEPS,
                                             LR, LAUNCH, EXECUTOR,
                                             CPU_CLUSTER)
        for k in ("pre.weight", "conv.weight", "fc.weight"):
            self.assertFalse(torch.equal(start[k], final[k]), k)


if __name__ == "__main__":
    U.main("export_spectrogram_test")
