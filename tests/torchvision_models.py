"""torchvision classifiers with a cross-entropy loss, for the corpus test:
`make(name, double=False, deterministic=False)` -> a module whose
forward(x, labels) returns the loss (weights=None: nothing is downloaded)."""

import torch.nn as nn
import torch.nn.functional as F
import torchvision.models as tm
import torchvision.ops


class WithLoss(nn.Module):
    def __init__(self, name, double=False, deterministic=False, classes=10):
        super().__init__()
        kw = {}
        if name == "googlenet":
            kw = {"aux_logits": False, "init_weights": False}
        self.net = getattr(tm, name)(num_classes=classes, **kw)
        # Training steps that compare plans: no dropout; stochastic depth
        # (efficientnet, convnext) too when `deterministic`.
        off = (nn.Dropout, torchvision.ops.StochasticDepth) if deterministic \
            else nn.Dropout
        for m in self.net.modules():
            if isinstance(m, off):
                m.p = 0.0
        if double:
            self.net = self.net.double()

    def forward(self, x, labels):
        return F.cross_entropy(self.net(x), labels)


def make(name="resnet18", double=False, deterministic=False):
    return WithLoss(name, double, deterministic)
