"""nn.RNN (tanh, relu) and nn.GRU through tools/export_fx.py: nn.RNN, and
nn.GRU given an initial state, unrolled over the sequence into linear, add,
mul, sub, sigmoid, tanh, relu and layout ops; nn.GRU from the zero state as
one gru op per layer and direction (tools/fx_export/ops_lstm.py). Each configuration (layers, directions,
batch_first, bias, an initial state, the output and h_n) exports, validates
with `hapctl validate`, keeps PyTorch's state_dict names and gives PyTorch's
loss and parameter gradients in float64 with the reference evaluator
(tests/hap_ir_eval.py); what cannot be exported fails naming the module; a
small GRU classifier trains 3 SGD steps on 2 ranks as PyTorch does, over 4
steps and over 300 (more than the unrolled export took)."""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402
import hap_ir_eval  # noqa: E402
from fx_export import ops_lstm  # noqa: E402

EXECUTOR = os.environ.get("HAP_EXECUTOR")
LAUNCH = os.environ.get("HAP_LAUNCH")
CPU_CLUSTER = os.environ.get("CPU_CLUSTER")

B, S, I, H = 3, 4, 5, 6  # batch, sequence, input features, hidden


class Recurrent(nn.Module):
    """`rnn` on x (and the initial state h0, when given); the loss weighs
    each element of the output and/or h_n (`use`: "both", "output",
    "h_n", or "last": h_n[-1]) by a parameter of its shape, so that every
    element's gradient differs."""

    def __init__(self, rnn, use="both"):
        super().__init__()
        self.rnn, self.use = rnn, use
        d = 2 if rnn.bidirectional else 1
        seq = (B, S) if rnn.batch_first else (S, B)
        self.probe_out = nn.Parameter(torch.randn(*seq, d * H))
        self.probe_h = nn.Parameter(torch.randn(rnn.num_layers * d, B, H))

    def forward(self, x, h0=None):
        out, h_n = self.rnn(x) if h0 is None else self.rnn(x, h0)
        if self.use == "output":
            return (out * self.probe_out).sum()
        if self.use == "h_n":
            return (h_n * self.probe_h).sum()
        if self.use == "last":
            return (h_n[-1] * self.probe_h[-1]).sum()
        return (out * self.probe_out).sum() + (h_n * self.probe_h).sum()


def rnn_inputs(rnn, h0):
    """x (and h0) for `rnn` in float64."""
    shape = (B, S, I) if rnn.batch_first else (S, B, I)
    inputs = {"x": torch.randn(*shape, dtype=torch.float64)}
    if h0:
        d = 2 if rnn.bidirectional else 1
        inputs["h0"] = torch.randn(rnn.num_layers * d, B, H,
                                   dtype=torch.float64)
    return inputs


# (module class, its keyword arguments, use, an initial state given)
CASES = [
    (nn.RNN, {}, "both", False),
    (nn.RNN, {"nonlinearity": "relu", "batch_first": True}, "both", True),
    (nn.RNN, {"nonlinearity": "relu", "num_layers": 2,
              "bidirectional": True}, "both", False),  # DeepSpeech's, 2 deep
    (nn.RNN, {"num_layers": 2, "bias": False, "batch_first": True},
     "output", True),
    (nn.RNN, {"num_layers": 2, "batch_first": True}, "last", False),
    (nn.GRU, {}, "both", False),
    (nn.GRU, {"batch_first": True}, "h_n", True),
    (nn.GRU, {"bias": False}, "both", True),
    (nn.GRU, {"bias": False, "batch_first": True}, "both", False),
    (nn.GRU, {"num_layers": 2, "bidirectional": True}, "both", True),
    (nn.GRU, {"num_layers": 2, "bidirectional": True, "batch_first": True,
              "bias": False}, "output", False),
    (nn.GRU, {"num_layers": 2, "batch_first": True}, "last", True),
]


class ExportRnnTest(ExportTestCase):
    def test_rnn_and_gru_give_pytorchs_loss_and_gradients(self):
        for cls, kwargs, use, h0 in CASES:
            with self.subTest(module=cls.__name__, use=use, h0=h0, **kwargs):
                torch.manual_seed(1)
                m = Recurrent(cls(I, H, **kwargs), use).double()
                g, _ = self.assert_loss_and_gradients(
                    m, rnn_inputs(m.rnn, h0), tol=1e-10)
                types = [op["type"] for op in g["ops"]]
                self.assertNotIn("lstm", types)
                step = [op for op in g["ops"]
                        if op["name"].startswith("rnn.l0.t1.")]
                if cls is nn.GRU and not h0:
                    # From the zero state: one gru op a layer and
                    # direction, nothing unrolled.
                    d = 2 if m.rnn.bidirectional else 1
                    self.assertEqual(types.count("gru"),
                                     m.rnn.num_layers * d)
                    self.assertEqual(step, [])
                    continue
                self.assertNotIn("gru", types)
                # A step after the first is OPS_PER_STEP ops (the bound on
                # the unrolled graph counts them).
                kind = "GRU" if cls is nn.GRU else m.rnn.nonlinearity
                self.assertEqual(len(step), ops_lstm.OPS_PER_STEP[kind])
                # Parameters keep their state_dict names and shapes.
                shapes = {p["tensor"]["name"]: p["tensor"]["shape"]
                          for p in g["parameters"]
                          if p["tensor"]["name"].startswith("rnn.")}
                self.assertEqual(shapes, {f"rnn.{k}": list(v.shape) for k, v
                                          in m.rnn.state_dict().items()})

    def test_zeros_made_in_forward_are_the_default_state(self):
        """Tutorials write h0 = torch.zeros(num_layers, x.size(0), hidden)
        (and c0 for nn.LSTM) and pass them: nn.LSTM refused any initial
        state and nn.GRU was unrolled. Zeros forward makes are PyTorch's
        default state, so these are the lstm and gru ops, one a layer and
        direction, with PyTorch's loss and gradients; nn.RNN unrolls as
        from no state. A learnable initial state (a parameter, zeros at
        first) is an input of the graph: nn.GRU unrolls it and its
        gradient is PyTorch's."""

        class Tutorial(nn.Module):
            def __init__(self, rnn, new_zeros=False):
                super().__init__()
                self.rnn, self.new_zeros = rnn, new_zeros
                self.fc = nn.Linear(H * (2 if rnn.bidirectional else 1), 3)

            def forward(self, x):
                d = 2 if self.rnn.bidirectional else 1
                shape = (self.rnn.num_layers * d, x.size(0), H)
                h0 = x.new_zeros(shape) if self.new_zeros else \
                    torch.zeros(shape, dtype=x.dtype)
                if isinstance(self.rnn, nn.LSTM):
                    out, _ = self.rnn(x, (h0, torch.zeros_like(h0)))
                else:
                    out, _ = self.rnn(x, h0)
                y = self.fc(out[:, -1])
                return (y * y).sum()

        for cls, kwargs, op, new_zeros in (
                (nn.LSTM, {"num_layers": 2}, "lstm", False),
                (nn.LSTM, {"bidirectional": True}, "lstm", True),
                (nn.GRU, {"num_layers": 2, "bidirectional": True}, "gru",
                 False),
                (nn.GRU, {}, "gru", True),
                (nn.RNN, {"num_layers": 2}, None, False)):
            with self.subTest(module=cls.__name__, new_zeros=new_zeros,
                              **kwargs):
                torch.manual_seed(2)
                m = Tutorial(cls(I, H, batch_first=True, **kwargs),
                             new_zeros).double()
                x = torch.randn(B, S, I, dtype=torch.float64)
                g, _ = self.assert_loss_and_gradients(m, {"x": x},
                                                      tol=1e-10)
                types = [o["type"] for o in g["ops"]]
                d = 2 if m.rnn.bidirectional else 1
                if op is None:
                    self.assertNotIn("gru", types)
                    self.assertNotIn("lstm", types)
                    continue
                self.assertEqual(types.count(op), m.rnn.num_layers * d)
                self.assertEqual(
                    [o for o in g["ops"] if ".t1." in o["name"]], [])

        class LearnedStart(nn.Module):
            def __init__(self):
                super().__init__()
                self.gru = nn.GRU(I, H, batch_first=True)
                self.h0 = nn.Parameter(torch.zeros(1, 1, H))

            def forward(self, x):
                out, _ = self.gru(x, self.h0.expand(1, x.size(0), H)
                                  .contiguous())
                return (out * out).sum()

        torch.manual_seed(3)
        m = LearnedStart().double()
        x = torch.randn(B, S, I, dtype=torch.float64)
        with torch.no_grad():
            m.h0.normal_()  # its gradient is checked where it is not zero
        g, _ = self.assert_loss_and_gradients(m, {"x": x}, tol=1e-10)
        types = [o["type"] for o in g["ops"]]
        self.assertNotIn("gru", types)
        with torch.no_grad():
            m.h0.zero_()  # zeros, but a parameter: still the graph's input
        g, _ = self.assert_loss_and_gradients(m, {"x": x}, tol=1e-10)
        self.assertNotIn("gru", [o["type"] for o in g["ops"]])
        self.assertIn("h0", {p["tensor"]["name"] for p in g["parameters"]})

    def test_cells_step_as_pytorch(self):
        """nn.RNNCell (tanh, relu), nn.GRUCell and nn.LSTMCell (decoders
        that step a cell in a loop) were refused as unsupported modules.
        Each call is one step of the unrolled form: PyTorch's loss and
        gradients in float64 from no state, from zeros made in forward, from
        a given state (an input), over a loop that feeds each step's state
        to the next (an LSTMCell's h and c both used), with and without
        bias."""

        class Loop(nn.Module):
            def __init__(self, cell, start):
                super().__init__()
                self.cell, self.start = cell, start
                self.lstm = isinstance(cell, nn.LSTMCell)
                self.probe = nn.Parameter(torch.randn(S, B, H))

            def forward(self, x, h0):
                if self.start == "none":
                    state = None
                elif self.start == "zeros":
                    z = torch.zeros(x.size(0), H, dtype=x.dtype)
                    state = (z, z) if self.lstm else z
                else:
                    state = (h0, h0 * 0.5) if self.lstm else h0
                total = 0
                for t in range(S):
                    state = self.cell(x[:, t], state)
                    h = state[0] if self.lstm else state
                    total = total + (h * self.probe[t]).sum()
                    if self.lstm:
                        total = total + (state[1] * self.probe[t]).sum() * 0.3
                return total

        for cls, kwargs in ((nn.RNNCell, {}),
                            (nn.RNNCell, {"nonlinearity": "relu",
                                          "bias": False}),
                            (nn.GRUCell, {}), (nn.GRUCell, {"bias": False}),
                            (nn.LSTMCell, {}), (nn.LSTMCell, {"bias": False})):
            for start in ("none", "zeros", "given"):
                with self.subTest(cell=cls.__name__, start=start, **kwargs):
                    torch.manual_seed(7)
                    m = Loop(cls(I, H, **kwargs), start).double()
                    inputs = {"x": torch.randn(B, S, I, dtype=torch.float64),
                              "h0": torch.randn(B, H, dtype=torch.float64)}
                    g, _ = self.assert_loss_and_gradients(m, inputs,
                                                          tol=1e-10)
                    params = {p["tensor"]["name"] for p in g["parameters"]}
                    self.assertIn("cell.weight_hh", params)

        class Unbatched(nn.Module):
            def __init__(self):
                super().__init__()
                self.cell = nn.GRUCell(I, H)

            def forward(self, x):
                return self.cell(x[0]).sum()

        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(Unbatched(), {"x": torch.randn(B, I)})
        self.assertIn("nn.GRUCell 'cell': input [5] must have rank 2",
                      str(cm.exception))

    def test_one_step_and_the_graph_it_unrolls_into(self):
        """A sequence of one step from the zero state: nn.GRU is one gru
        op; nn.RNN is the input projection, the zero state's hidden
        projection (a linear of a zero constant: weight_hh_l0 is read, so
        its gradient is PyTorch's zero) and the nonlinearity; the losses
        are PyTorch's."""
        for cls, want in ((nn.GRU, ["gru"]),
                          (nn.RNN, ["linear", "slice", "reshape", "add",
                                    "tanh", "reshape"])):
            with self.subTest(module=cls.__name__):
                torch.manual_seed(1)
                m = cls(I, H, batch_first=True).double()
                x = torch.randn(B, 1, I, dtype=torch.float64)

                class Loss(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.rnn = m

                    def forward(self, x):
                        out, h_n = self.rnn(x)
                        return (out * out).sum() + h_n.sum()

                g, values = self.export_valid(Loss(), {"x": x})
                ops = [op["type"] for op in g["ops"]
                       if op["name"].startswith("rnn.l0")]
                self.assertEqual(ops, want)
                got = hap_ir_eval.evaluate(g, {"x": x}, values)
                self.assertAlmostEqual(float(got), float(Loss()(x)),
                                       delta=1e-10)

    def test_dropout_between_layers_is_a_dropout_op(self):
        """As nn.LSTM's: a dropout op on each layer's output but the
        last's (the IR's mask, not PyTorch's random numbers)."""
        m = Recurrent(nn.GRU(I, H, num_layers=3, dropout=0.25))
        g, _ = self.export_valid(m, {"x": torch.randn(S, B, I)})
        drops = [(op["name"], op["attrs"]["p"]["f"]) for op in g["ops"]
                 if op["type"] == "dropout"]
        self.assertEqual(drops, [("rnn.l0_dropout", 0.25),
                                 ("rnn.l1_dropout", 0.25)])

    def test_what_cannot_be_exported_fails_naming_the_module(self):
        class Unbatched(nn.Module):
            def __init__(self):
                super().__init__()
                self.gru = nn.GRU(I, H)

            def forward(self, x):
                return self.gru(x[0])[0].sum()

        class Long(nn.Module):
            """Given an h_0 other than zeros, nn.GRU is still unrolled."""

            def __init__(self):
                super().__init__()
                self.gru = nn.GRU(I, H, bidirectional=True)

            def forward(self, x):
                return self.gru(x, torch.ones(2, B, H))[0].sum()

        per_step = ops_lstm.OPS_PER_STEP["GRU"]
        steps = ops_lstm.MAX_UNROLLED_OPS // (2 * per_step) + 1
        for mod, x, needles in (
                (Unbatched(), torch.randn(2, S, I),
                 ["nn.GRU 'gru'", "must have rank 3", "unbatched"]),
                (Long(), torch.randn(steps, B, I),
                 [f"nn.GRU 'gru': {steps} steps x 1 layers x 2 directions "
                  f"unroll into about {steps * 2 * per_step} ops, more "
                  f"than {ops_lstm.MAX_UNROLLED_OPS}"])):
            with self.subTest(module=type(mod).__name__):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(mod, {"x": x})
                for needle in needles:
                    self.assertIn(needle, str(cm.exception))

    def test_gru_classifier_trains_like_pytorch_on_two_ranks(self):
        """3 SGD steps on 2 ranks (the dp-even and the synthesized plan)
        from the --weights file of a 2-layer bidirectional GRU classifier
        that reads the output's mean and h_n[-1]: the losses and final
        parameters are PyTorch's (the executor's gru kernels and their
        gradients, batch-sharded)."""
        self.assert_gru_classifier_trains_like_pytorch(S)

    def test_a_long_gru_trains_like_pytorch_on_two_ranks(self):
        """The classifier over 300 steps: unrolled, 2 layers x 2
        directions x 300 steps were some 21,600 ops, past MAX_UNROLLED_OPS
        (the export was refused); now 4 gru ops."""
        self.assertGreater(300 * 4 * ops_lstm.OPS_PER_STEP["GRU"],
                           ops_lstm.MAX_UNROLLED_OPS)
        self.assert_gru_classifier_trains_like_pytorch(300)

    def assert_gru_classifier_trains_like_pytorch(self, seq):
        if not (EXECUTOR and LAUNCH and CPU_CLUSTER):
            self.skipTest("HAP_EXECUTOR, HAP_LAUNCH, CPU_CLUSTER not given")

        class Classifier(nn.Module):
            def __init__(self):
                super().__init__()
                self.gru = nn.GRU(I, H, num_layers=2, bidirectional=True,
                                  batch_first=True)
                self.head = nn.Linear(3 * H, 3)

            def forward(self, x, labels):
                out, h_n = self.gru(x)
                y = torch.cat([out.mean(1), h_n[-1]], dim=1)
                return F.cross_entropy(self.head(y), labels)

        batch, steps = 4, 3
        torch.manual_seed(0)
        m = Classifier().double()
        g = torch.Generator().manual_seed(3)
        xs = torch.randn(batch * steps, seq, I, generator=g,
                         dtype=torch.float64)
        ys = torch.randint(0, 3, (batch * steps,), generator=g)
        graph = export_fx.export(m, {"x": xs[:batch], "labels": ys[:batch]})
        self.assertEqual(
            [op["name"] for op in graph["ops"] if op["type"] == "gru"],
            ["gru.l0", "gru.l0_reverse", "gru.l1", "gru.l1_reverse"])
        final = U.assert_trains_like_pytorch(self, m, xs, ys, batch, steps,
                                             0.5, LAUNCH, EXECUTOR,
                                             CPU_CLUSTER)
        self.assertIn("gru.weight_hh_l1_reverse", final)

if __name__ == "__main__":
    U.main("export_rnn_test")
