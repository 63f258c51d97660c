#!/usr/bin/env python3
"""Which torchvision classifiers export: every classification model builder
of the installed torchvision (0.14 from Debian's python3-torchvision: 80),
built with weights=None and 10 classes, wrapped with a cross-entropy loss,
exported by tools/export_fx.py at batch 2 and its smallest usual input, and
its graph's trainable parameters compared with PyTorch's.

    /usr/bin/python3 scripts/torchvision_coverage.py [NAME ...] [--markdown]
        [--video]

--video checks the video classifiers (torchvision.models.video: r3d_18,
mc3_18, r2plus1d_18, s3d, mvit_v1_b, mvit_v2_s in 0.14) on clips of their
smallest usual size instead. Prints one line per model (ok / FAIL and why, seconds, parameters, ops) and
a summary; exits 1 when any model fails. The largest (vit_h_14, regnet_y_128gf)
need a few GiB of memory and a minute or two each. Training is checked by
tests/torchvision_corpus_test.py (13 models), tests/swin_test.py and
tests/maxvit_test.py; this only exports."""

import inspect
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision.models as tm  # noqa: E402
import torchvision.models.video as tv_video  # noqa: E402

import export_fx  # noqa: E402

NOT_MODELS = {"get_model", "get_model_builder", "get_model_weights",
              "get_weight", "list_models"}


def builders(family=tm):
    """The model builders of `family`: torchvision.models' own functions
    (the image classifiers; detection, segmentation, video and optical flow
    live in submodules) or torchvision.models.video's."""
    return sorted(n for n, f in vars(family).items()
                  if inspect.isfunction(f) and not n.startswith("_")
                  and n not in NOT_MODELS
                  and f.__module__.startswith(family.__name__))


def clip_shape(name):
    """[frames, height, width] of a video classifier's input: s3d's final
    AvgPool3d (2, 7, 7) needs 13 frames and 224x224 at least, mvit's
    position embeddings 16 frames of 224x224; the ResNets take small
    clips."""
    if name == "s3d" or name.startswith("mvit"):
        return [16, 224, 224]
    return [8, 64, 64]


def image_size(name):
    if name == "inception_v3":
        return 299
    if name.startswith("swin_v2"):
        return 256
    if name.startswith(("vit_", "swin_", "maxvit")):
        return 224
    return 64  # the convolutional ones take smaller images (alexnet's least)


class WithLoss(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, labels):
        out = self.net(x)
        if isinstance(out, tuple):  # inception_v3, googlenet: aux logits
            return F.cross_entropy(out[0], labels) + sum(
                0.4 * F.cross_entropy(o, labels) for o in out[1:])
        return F.cross_entropy(out, labels)


def check(name, family=tm):
    """(ok, message) for one model."""
    kw = {"num_classes": 10}
    if name in ("googlenet", "inception_v3"):
        kw["init_weights"] = False
    torch.manual_seed(0)
    m = WithLoss(getattr(family, name)(**kw))
    want = sum(p.numel() for p in m.parameters())
    if family is tv_video:
        shape = clip_shape(name)
    else:
        shape = [image_size(name)] * 2
    size = "x".join(str(d) for d in shape)
    g = export_fx.export(m, {"x": torch.randn(2, 3, *shape),
                             "labels": torch.tensor([1, 2])})
    got = sum(math.prod(p["tensor"]["shape"]) for p in g["parameters"]
              if not p.get("frozen"))
    if got != want:
        return False, f"{got} trainable parameters in the graph, PyTorch has {want}"
    return True, f"{want} parameters, {len(g['ops'])} ops, {size}"


def main(argv):
    markdown = "--markdown" in argv
    family = tv_video if "--video" in argv else tm
    names = [a for a in argv if not a.startswith("--")] or builders(family)
    failed = []
    for name in names:
        start = time.time()
        try:
            ok, msg = check(name, family)
        except Exception as e:  # noqa: BLE001  (the report names it)
            ok, msg = False, f"{type(e).__name__}: " + str(e).splitlines()[0][:300]
        secs = time.time() - start
        if not ok:
            failed.append(name)
        if markdown:
            print(f"| {name} | {'ok' if ok else 'FAIL'} | {msg} | {secs:.1f} |")
        else:
            print(f"{name:24s} {'ok  ' if ok else 'FAIL'} {secs:6.1f} s  {msg}",
                  flush=True)
    print(f"{len(names) - len(failed)} of {len(names)} export"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
