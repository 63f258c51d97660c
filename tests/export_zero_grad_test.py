"""Parameters whose PyTorch gradient is zero, and those PyTorch gives no
gradient at all, through tools/export_fx.py and training: a 1-step nn.GRU,
nn.RNN or nn.LSTM from the zero state gives weight_hh a zero gradient in
PyTorch (h_0 W_hh^T with h_0 = 0), so AdamW with weight decay still
shrinks it; a parameter forward never uses has grad None and AdamW leaves
it as it is. The graph's gradients (the reference evaluator) and 3 AdamW
steps with weight decay on 2 ranks (hap-launch, hap-executor) give
PyTorch's, in float64. A trainable graph parameter that no op reads is an
internal error of the exporter."""

import json
import os

import torch
import torch.nn as nn

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402

EXECUTOR = os.environ.get("HAP_EXECUTOR")
LAUNCH = os.environ.get("HAP_LAUNCH")
CPU_CLUSTER = os.environ.get("CPU_CLUSTER")

B, I, H = 4, 5, 6  # batch, input features, hidden
LR, WD, STEPS = 0.05, 0.1, 3


class OneStep(nn.Module):
    """`rnn` over a sequence of one step from the zero state; the loss
    reads the output and h_n. `unused` is a parameter forward never
    reads."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn, self.lstm = rnn, isinstance(rnn, nn.LSTM)
        self.unused = nn.Parameter(torch.randn(3))
        d = 2 if rnn.bidirectional else 1
        self.probe = nn.Parameter(torch.randn(1, d * H))

    def forward(self, x):
        out, h_n = self.rnn(x)
        if self.lstm:
            h_n = h_n[0]
        y = out * self.probe
        return (y * y).sum() + h_n.sum()


MODULES = [
    ("GRU", lambda: nn.GRU(I, H, batch_first=True)),
    ("GRU, no bias, 2 layers, bidirectional",
     lambda: nn.GRU(I, H, num_layers=2, bidirectional=True, bias=False,
                    batch_first=True)),
    ("RNN tanh", lambda: nn.RNN(I, H, batch_first=True)),
    ("RNN relu, no bias", lambda: nn.RNN(I, H, nonlinearity="relu",
                                         bias=False, batch_first=True)),
    ("LSTM", lambda: nn.LSTM(I, H, batch_first=True)),
]


def pytorch_adamw_steps(m, xs, batch, steps):
    """PyTorch's AdamW (LR, WD) over `steps` batches of xs: the losses and
    the final parameters by name."""
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for k in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = m(xs[k * batch:(k + 1) * batch])
        loss.backward()
        losses.append(float(loss))
        opt.step()
    return losses, {k: v.detach() for k, v in m.named_parameters()}


def hap_adamw_steps(m, xs, batch, steps):
    """The same steps from m's export on 2 ranks (dp-even plan, AdamW with
    WD): the logged losses and the final weights by name."""
    d = U.tmpdir()
    graph, weights = os.path.join(d, "g.json"), os.path.join(d, "w.st")
    g, values = export_fx.export(m, {"x": xs[:batch]}, return_values=True)
    with open(graph, "w") as f:
        json.dump(g, f)
    export_fx.write_weights(weights, g, values, m)
    data = os.path.join(d, "data")
    os.makedirs(data)
    U.write_npy(os.path.join(data, "x.npy"), xs)
    plan = os.path.join(d, "plan.pb")
    U.run([U.HAPCTL, "plan", "--cluster", CPU_CLUSTER, "--graph", graph,
           "--baseline", "dp-even", "--optimizer", "adam", "--lr", str(LR),
           "--weight-decay", str(WD), "--save-plan", plan,
           "--max-seconds", "5"])
    ckpt = plan + ".ckpt"
    p = U.run([LAUNCH, "--executor", EXECUTOR, "--plan", plan, "--steps",
               str(steps), "--data", "npy:" + data, "--init-weights",
               weights, "--log-every", "1", "--checkpoint-dir", ckpt])
    losses = [float(line.split()[3]) for line in p.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == steps, p.stdout
    out = ckpt + ".safetensors"
    U.run([U.HAPCTL, "checkpoint", "export", ckpt, "-o", out])
    return g, losses, export_fx._safetensors_io().read(out)


class ExportZeroGradTest(ExportTestCase):
    def test_one_step_weight_hh_gets_pytorchs_zero_gradient(self):
        """The graph's gradient of weight_hh is PyTorch's zeros (it was
        none: no op read weight_hh)."""
        for what, make in MODULES:
            with self.subTest(module=what):
                torch.manual_seed(1)
                m = OneStep(make()).double()
                x = torch.randn(B, 1, I, dtype=torch.float64)
                g, values = self.assert_loss_and_gradients(m, {"x": x},
                                                           tol=1e-10)
                names = [k for k in dict(m.rnn.named_parameters())
                         if k.startswith("weight_hh")]
                read = {i for op in g["ops"] for i in op["inputs"]}
                for k in names:
                    self.assertIn(f"rnn.{k}", read)
                    self.assertTrue(bool((m.rnn.get_parameter(k).grad ==
                                          0).all()))
                # The unused parameter is no graph parameter (PyTorch's
                # grad is None: AdamW skips it).
                self.assertNotIn("unused", values)
                self.assertIsNone(m.unused.grad)

    def test_adamw_with_weight_decay_trains_like_pytorch(self):
        """3 AdamW steps (weight decay 0.1) on 2 ranks: every parameter is
        PyTorch's after them, weight_hh decayed (zero gradient), `unused`
        as it was (no gradient: skipped)."""
        if not (EXECUTOR and LAUNCH and CPU_CLUSTER):
            self.skipTest("HAP_EXECUTOR, HAP_LAUNCH, CPU_CLUSTER not given")
        for what, make in MODULES:
            with self.subTest(module=what):
                torch.manual_seed(2)
                m = OneStep(make()).double()
                before = {k: v.detach().clone()
                          for k, v in m.named_parameters()}
                xs = torch.randn(B * STEPS, 1, I, dtype=torch.float64)
                _, losses, params = hap_adamw_steps(m, xs, B, STEPS)
                want, final = pytorch_adamw_steps(m, xs, B, STEPS)
                for got, ref in zip(losses, want):
                    self.assertAlmostEqual(got, ref,
                                           delta=1e-5 * max(1, abs(ref)),
                                           msg=f"{losses} vs {want}")
                for name, p in final.items():
                    if name == "unused":
                        continue
                    self.assertIn(name, params)
                    err = float((params[name].double() - p).abs().max())
                    bound = 1e-6 * max(float(p.abs().max()), 1e-3)
                    self.assertLessEqual(err, bound, name)
                # weight_hh moved only by the decay; `unused` not at all.
                w = "weight_hh_l0"
                self.assertTrue(torch.allclose(
                    final[f"rnn.{w}"],
                    before[f"rnn.{w}"] * (1 - LR * WD) ** STEPS,
                    rtol=1e-12, atol=0))
                self.assertTrue(torch.equal(final["unused"],
                                            before["unused"]))
                if "unused" in params:
                    self.assertTrue(torch.equal(
                        params["unused"].double(), before["unused"]))

    def test_parameters_reached_only_through_detach_train_like_pytorch(self):
        """A parameter whose every use is detached (a target network's,
        a codebook moved only by its own loss) has grad None in PyTorch,
        and AdamW leaves it as it is; the others train as PyTorch's. 3
        AdamW steps with weight decay on 2 ranks."""
        if not (EXECUTOR and LAUNCH and CPU_CLUSTER):
            self.skipTest("HAP_EXECUTOR, HAP_LAUNCH, CPU_CLUSTER not given")

        class Detached(nn.Module):
            def __init__(self):
                super().__init__()
                self.enc = nn.Linear(I, H)
                self.target = nn.Linear(I, H)

            def forward(self, x):
                z = torch.tanh(self.enc(x[:, 0]))
                aim = self.target(x[:, 0]).detach()
                st = z + (aim - z).detach()  # straight through
                return ((z - aim) * (z - aim)).sum() + (st * st).sum()

        torch.manual_seed(3)
        m = Detached().double()
        before = {k: v.detach().clone() for k, v in m.named_parameters()}
        xs = torch.randn(B * STEPS, 1, I, dtype=torch.float64)
        g, losses, params = hap_adamw_steps(m, xs, B, STEPS)
        self.assertIn("stop_gradient", {op["type"] for op in g["ops"]})
        want, final = pytorch_adamw_steps(m, xs, B, STEPS)
        for got, ref in zip(losses, want):
            self.assertAlmostEqual(got, ref, delta=1e-5 * max(1, abs(ref)),
                                   msg=f"{losses} vs {want}")
        for name, p in final.items():
            err = float((params[name].double() - p).abs().max())
            self.assertLessEqual(err, 1e-6 * max(float(p.abs().max()), 1e-3),
                                 name)
        for name in ("target.weight", "target.bias"):
            self.assertTrue(torch.equal(final[name], before[name]), name)

    def test_a_declared_parameter_no_op_reads_is_an_internal_error(self):
        """The exporter's own check: a handler that declares a trainable
        parameter and emits no op reading it (as the 1-step nn.GRU did)
        fails the export, instead of a graph that trains it differently
        from PyTorch."""
        from fx_export import registry

        class Declares(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(3))

            def forward(self, x):
                return x * self.w

        # Kept whole by the tracer, as torch.nn's modules are.
        Declares.__module__ = "torch.nn.modules.declares_for_test"

        @registry.modules(Declares, exact=True)
        def _declares(ex, call):
            ex.param(call.mod.w)  # declared, not read
            return ex.t(call.bound()["x"])

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.d = Declares()

            def forward(self, x):
                return (self.d(x) * x).sum()

        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(Model(), {"x": torch.randn(2, 3)})
        self.assertIn("internal: trainable graph parameter 'd.w' is read "
                      "by no op", str(cm.exception))


if __name__ == "__main__":
    U.main("export_zero_grad_test")
