"""Audio front ends: torchaudio.functional.spectrogram (what
torchaudio.transforms.Spectrogram and MelSpectrogram call) and
amplitude_to_DB (AmplitudeToDB), each recorded as one call by HapTracer
(tracing.audio_functions) and written here as real ops.

The spectrogram is torch.stft's, without complex numbers: the (centered,
padded) waveform's frames times the window and the DFT are one conv1d per
part, stride hop_length, with the constant weights window * cos and
window * -sin (a conv2d over a height of 1, as ops_convolution.conv1d), and
the power 2 spectrum re * re + im * im. MelScale's matmul by its filterbank
buffer then traces as a matmul.
"""

import math

import torch

from . import registry
from .ops_elementwise import clamp, log
from .ops_shape import pad
from .tracing import audio_function_name

_SPECTROGRAM_ARGS = ["waveform", "pad", "window", "n_fft", "hop_length",
                     "win_length", "power", "normalized", "center",
                     "pad_mode", "onesided", "return_complex"]


def dft_weights(window, n_fft, win_length, onesided):
    """The [freqs, n_fft] float64 weights whose products with a frame give
    torch.stft's real and imaginary parts: the window (win_length long,
    centered in n_fft as torch.stft pads it) times cos and -sin of
    2 pi k n / n_fft (the angle's k * n taken mod n_fft, exact)."""
    w = torch.zeros(n_fft, dtype=torch.float64)
    left = (n_fft - win_length) // 2
    w[left:left + win_length] = window.detach().double().flatten()
    freqs = n_fft // 2 + 1 if onesided else n_fft
    k = torch.arange(freqs, dtype=torch.int64).unsqueeze(1)
    n = torch.arange(n_fft, dtype=torch.int64).unsqueeze(0)
    angle = (k * n % n_fft).double() * (2.0 * math.pi / n_fft)
    return w * torch.cos(angle), -w * torch.sin(angle)


@registry.functions_matching(lambda f: audio_function_name(f) ==
                             "spectrogram")
def _spectrogram(ex, call):
    """torchaudio.functional.spectrogram with power 2 (the default of
    Spectrogram and MelSpectrogram)."""
    a = call.named(_SPECTROGRAM_ARGS,
                   {"center": True, "pad_mode": "reflect", "onesided": True,
                    "return_complex": None})
    what = "torchaudio's spectrogram (transforms.Spectrogram, MelSpectrogram)"
    power, normalized = ex.v(a["power"]), ex.v(a["normalized"])
    if power is None:
        ex.fail(f"{what} with power=None (a complex spectrum, which the HAP "
                f"IR cannot hold) is not supported: power=2 only")
    if power != 2:
        ex.fail(f"{what} with power={power} is not supported: power=2 only")
    if normalized:
        ex.fail(f"{what} with normalized={normalized!r} is not supported")
    x = ex.t(a["waveform"])
    window = ex.v(a["window"])
    n_fft, hop = int(ex.v(a["n_fft"])), int(ex.v(a["hop_length"]))
    win_length, extra = int(ex.v(a["win_length"])), int(ex.v(a["pad"]))
    center, pad_mode = bool(ex.v(a["center"])), ex.v(a["pad_mode"])
    onesided = bool(ex.v(a["onesided"]))
    if not isinstance(window, torch.Tensor) or \
            window.numel() != win_length or win_length > n_fft:
        ex.fail(f"{what} needs a constant window of win_length "
                f"{win_length} <= n_fft {n_fft}")
    name, scope = ex.base_name(call.node), ex.scope_of(call.node)
    lead = tuple(x.shape[:-1])
    if extra > 0:
        x = pad(ex, x, [extra, extra], "constant", 0.0, name, scope)
    rows = math.prod(lead)
    # [rows, 1, length]: one channel for conv1d.
    x = ex.reshape(name, x, (rows, 1, x.shape[-1]), scope)
    if center:
        x = pad(ex, x, [n_fft // 2, n_fft // 2], pad_mode, 0.0, name, scope)
    length = x.shape[-1]
    if length < n_fft:
        ex.fail(f"{what}: the padded waveform's {length} samples are fewer "
                f"than n_fft {n_fft}")
    frames = 1 + (length - n_fft) // hop
    cos_w, sin_w = dft_weights(window, n_fft, win_length, onesided)
    freqs = cos_w.shape[0]
    x = ex.reshape(name, x, (rows, 1, 1, length), scope)
    parts = []
    for w, part in ((cos_w, "real"), (sin_w, "imaginary")):
        k = ex.const(w.reshape(freqs, 1, 1, n_fft), x,
                     f"the window times the DFT's {part} part")
        y = ex.emit("conv2d", name, [x, k],
                    {"stride": [1, hop], "padding": [0, 0]},
                    shape=(rows, freqs, 1, frames), scope=scope)
        parts.append(ex.emit("mul", name, [y, y], shape=y.shape,
                             scope=scope))
    power2 = ex.emit("add", name, parts, shape=parts[0].shape, scope=scope)
    return ex.reshape(name, power2, lead + (freqs, frames), scope)


@registry.functions_matching(lambda f: audio_function_name(f) ==
                             "amplitude_to_DB")
def _amplitude_to_db(ex, call):
    """torchaudio.functional.amplitude_to_DB without top_db:
    multiplier * log10(clamp(x, min=amin)) - multiplier * db_multiplier."""
    a = call.named(["x", "multiplier", "amin", "db_multiplier", "top_db"],
                   {"top_db": None})
    top_db = ex.v(a["top_db"])
    if top_db is not None:
        ex.fail(f"torchaudio's amplitude_to_DB (transforms.AmplitudeToDB) "
                f"with top_db={top_db} is not supported (its cut-off is "
                f"below the tensor's maximum, and the HAP IR has no max "
                f"reduction): top_db=None only")
    multiplier = float(ex.v(a["multiplier"]))
    amin = float(ex.v(a["amin"]))
    db_multiplier = float(ex.v(a["db_multiplier"]))
    name, scope = ex.base_name(call.node), ex.scope_of(call.node)
    x = ex.t(a["x"])
    y = log(ex, clamp(ex, x, amin, None, name, scope), "log", name, scope)
    y = ex.emit("scale", name, [y], {"factor": multiplier / math.log(10.0)},
                shape=x.shape, scope=scope)
    if multiplier * db_multiplier != 0:
        y = ex.emit("sub", name, [y, ex.const(multiplier * db_multiplier, y)],
                    shape=x.shape, scope=scope)
    return y
