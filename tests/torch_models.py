"""PyTorch modules shared by the torch tests (tests/*_test.py).

The Zoo* classes are written by hand to mirror planner/graph/zoo.cc layer by
layer (separate q/k/v/out linears, pre-norm blocks, ...), so that their
parameter counts, and the FLOPs of their exported graphs, can be compared
with `hapctl zoo`. The Torch* classes use PyTorch's own nn.Transformer*
modules; the exporter decomposes those the way the zoo does. Every module
takes its inputs by name and returns the scalar training loss.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def num_params(m):
    return sum(p.numel() for p in m.parameters())


# ---------------------------------------------------------------------------
# Hand-written mirrors of the zoo


class ZooMlp(nn.Module):
    """zoo mlp: `layers` x (Linear + ReLU), Linear head, cross-entropy."""

    def __init__(self, layers=12, hidden=768, input=768, classes=10,
                 device=None):
        super().__init__()
        dims = [input] + [hidden] * layers
        self.layers = nn.ModuleList(
            nn.Linear(dims[i], dims[i + 1], device=device)
            for i in range(layers))
        self.head = nn.Linear(dims[-1], classes, device=device)

    def forward(self, x, labels):
        for fc in self.layers:
            x = F.relu(fc(x))
        return F.cross_entropy(self.head(x), labels)


class ZooAttention(nn.Module):
    """zoo Layers::Attention: q/k/v linears, heads, scaled dot product with an
    optional causal mask, dropout on the probabilities, output linear."""

    def __init__(self, hidden, heads, dropout, causal, seq, device=None):
        super().__init__()
        self.heads, self.dh = heads, hidden // heads
        self.q = nn.Linear(hidden, hidden, device=device)
        self.k = nn.Linear(hidden, hidden, device=device)
        self.v = nn.Linear(hidden, hidden, device=device)
        self.out = nn.Linear(hidden, hidden, device=device)
        self.drop = nn.Dropout(dropout)
        self.causal = causal
        if causal:
            self.register_buffer(
                "future", torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1),
                persistent=False)

    def forward(self, x):
        B, S, E = x.shape
        q = self.q(x).view(B, S, self.heads, self.dh).transpose(1, 2)
        k = self.k(x).view(B, S, self.heads, self.dh).permute(0, 2, 3, 1)
        v = self.v(x).view(B, S, self.heads, self.dh).transpose(1, 2)
        s = (q @ k) * (1.0 / math.sqrt(self.dh))
        if self.causal:
            s = s.masked_fill(self.future[:S, :S], float("-inf"))
        p = self.drop(F.softmax(s, dim=-1))
        ctx = (p @ v).transpose(1, 2).reshape(B, S, E)
        return self.out(ctx)


class ZooPreNormBlock(nn.Module):
    """zoo PreNormBlock (dense MLP, gelu)."""

    def __init__(self, hidden, heads, ffn, dropout, causal, seq, device=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, device=device)
        self.attn = ZooAttention(hidden, heads, dropout, causal, seq, device)
        self.attn_drop = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(hidden, device=device)
        self.fc1 = nn.Linear(hidden, ffn, device=device)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(ffn, hidden, device=device)
        self.mlp_drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attn_drop(self.attn(self.ln1(x)))
        h = self.fc2(self.drop(F.gelu(self.fc1(self.ln2(x)))))
        return x + self.mlp_drop(h)


class ZooGpt(nn.Module):
    """zoo gpt: token embedding + position table, causal pre-norm blocks,
    final LayerNorm, untied Linear(hidden, vocab, bias=False), cross-entropy
    (log_softmax and nll_loss fused, as the zoo) over [batch * seq] labels."""

    def __init__(self, layers=12, hidden=768, heads=12, ffn=3072, seq=128,
                 vocab=18328, dropout=0.1, device=None):
        super().__init__()
        self.vocab = vocab
        self.tokens = nn.Embedding(vocab, hidden, device=device)
        self.positions = nn.Parameter(torch.empty(seq, hidden, device=device))
        if device != "meta":
            nn.init.normal_(self.tokens.weight, std=0.02)
            nn.init.normal_(self.positions, std=0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            ZooPreNormBlock(hidden, heads, ffn, dropout, True, seq, device)
            for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, device=device)
        self.decoder = nn.Linear(hidden, vocab, bias=False, device=device)

    def forward(self, tokens, labels):
        x = self.drop(self.tokens(tokens) + self.positions)
        for b in self.blocks:
            x = b(x)
        logits = self.decoder(self.ln_f(x)).view(-1, self.vocab)
        return F.cross_entropy(logits, labels)


class ZooVit(nn.Module):
    """zoo vit: Conv2d patch embedding (kernel = stride = patch), class token,
    position embedding, pre-norm blocks, final LayerNorm, head on the class
    token, cross-entropy."""

    def __init__(self, layers=12, hidden=768, heads=12, ffn=3072, image=32,
                 patch=4, channels=3, classes=10, dropout=0.1, device=None):
        super().__init__()
        seq = (image // patch) ** 2 + 1
        self.patch_embed = nn.Conv2d(channels, hidden, patch, stride=patch,
                                     device=device)
        self.cls_token = nn.Parameter(torch.empty(1, 1, hidden, device=device))
        self.pos_embed = nn.Parameter(torch.empty(1, seq, hidden, device=device))
        if device != "meta":
            nn.init.normal_(self.cls_token, std=0.02)
            nn.init.normal_(self.pos_embed, std=0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[
            ZooPreNormBlock(hidden, heads, ffn, dropout, False, seq, device)
            for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden, device=device)
        self.head = nn.Linear(hidden, classes, device=device)

    def forward(self, images, labels):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = self.drop(torch.cat([cls, x], dim=1) + self.pos_embed)
        x = self.ln_f(self.blocks(x))
        return F.cross_entropy(self.head(x[:, 0]), labels)


class ZooVgg(nn.Module):
    """zoo vgg: stages of conv3x3(pad 1)+ReLU, 2x2 max-pool, fc1+ReLU, head."""

    def __init__(self, width=64, stages=5, convs_per_stage=2, image=32,
                 channels=3, classes=10, hidden=512):
        super().__init__()
        layers, c = [], channels
        for s in range(stages):
            out = min(width << s, width * 8)
            for _ in range(convs_per_stage):
                layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU()]
                c = out
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        size = image >> stages
        self.fc1 = nn.Linear(c * size * size, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, images, labels):
        x = torch.flatten(self.features(images), 1)
        return F.cross_entropy(self.head(F.relu(self.fc1(x))), labels)


# ---------------------------------------------------------------------------
# Models built from PyTorch's own modules


class TorchTransformerClassifier(nn.Module):
    """nn.TransformerEncoder (post-norm, relu, batch_first) + mean-pool +
    Linear classifier + CrossEntropyLoss: the zoo's `transformer`."""

    def __init__(self, layers=2, hidden=64, heads=4, ffn=128, classes=10,
                 dropout=0.1, batch_first=True, norm_first=False,
                 activation="relu", device=None):
        super().__init__()
        self.batch_first = batch_first
        layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=dropout,
                                           activation=activation,
                                           batch_first=batch_first,
                                           norm_first=norm_first,
                                           device=device)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(hidden, classes, device=device)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        pooled = self.encoder(x).mean(dim=1 if self.batch_first else 0)
        return self.loss(self.head(pooled), labels)


class TorchGpt(nn.Module):
    """A GPT-style LM from nn.TransformerEncoderLayer(norm_first=True,
    activation='gelu') with a causal mask: token and position nn.Embedding,
    final LayerNorm (the encoder's norm), untied decoder, cross-entropy
    (F.cross_entropy). Structurally the zoo's `gpt`."""

    def __init__(self, layers=2, hidden=64, heads=4, ffn=128, seq=16,
                 vocab=100, dropout=0.1, device=None):
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, hidden, device=device)
        self.pos = nn.Embedding(seq, hidden, device=device)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=dropout,
                                           activation="gelu", batch_first=True,
                                           norm_first=True, device=device)
        self.blocks = nn.TransformerEncoder(
            layer, layers, norm=nn.LayerNorm(hidden, device=device))
        self.decoder = nn.Linear(hidden, vocab, bias=False, device=device)

    def forward(self, tokens, labels):
        B, S = tokens.shape
        pos = torch.arange(S, device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(pos))
        mask = nn.Transformer.generate_square_subsequent_mask(S)
        x = self.blocks(x, mask=mask)
        logits = self.decoder(x).view(-1, self.vocab)
        return F.cross_entropy(logits, labels.view(-1))


class SmallCnn(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, stride=1, padding=1), nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(32, 32, 3), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, images, labels):
        return self.loss(self.body(images), labels)


class Mlp(nn.Module):
    """An MLP exercising the element-wise ops, scalars and reductions. The
    scalar `- 0.25` becomes a frozen constant parameter (one element)."""

    def __init__(self, d_in=16, hidden=32, classes=5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.gate = nn.Linear(hidden, hidden, bias=False)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x, labels):
        h = self.drop(self.act(self.fc1(x)))
        h = torch.tanh(self.fc2(h)) * 0.5 + h / 2.0
        h = self.norm(h - 0.25)
        g = torch.sigmoid(self.gate(h)) * F.relu(h)
        z = torch.cat([g, h.softmax(dim=-1)], dim=1)
        z = z - z.mean(dim=1, keepdim=True)
        logits = self.head(z)
        return F.cross_entropy(logits, labels)


class Sorter(nn.Module):
    """Uses torch.sort, which the exporter does not support."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, labels):
        h, _ = torch.sort(self.fc(x), dim=-1)
        return F.cross_entropy(h, labels)
