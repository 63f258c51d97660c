"""tools/export_fx.py on models it exported with wrong semantics or whose bad
input it met with a traceback: each case exports, validates with `hapctl
validate` and gives PyTorch's loss and gradients with the reference
evaluator tests/hap_ir_eval.py, or fails with a clear error naming what is
not supported."""

import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402


def labels(n, hi):
    return torch.randint(0, hi, (n,))


class InPlace(nn.Module):
    """A tensor changed in place by an op whose result is not assigned:
    `body(self, h)` changes h; the loss reads h afterwards."""

    def __init__(self, body):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(6, 3)
        self.body = body

    def forward(self, x, labels):
        h = self.fc(x)
        self.body(self, h)
        return F.cross_entropy(self.head(h), labels)


class ExportReviewTest(ExportTestCase):
    def test_in_place_ops_whose_result_is_not_assigned(self):
        """h.add_(1), h.mul_(2), F.relu(h, inplace=True) and
        nn.ReLU(inplace=True) with their result unused: the op was dropped
        (not needed by the loss) and the loss read h as it was before, a
        wrong loss with exit status 0."""
        bodies = {
            "add_": lambda s, h: h.add_(1.5),
            "mul_": lambda s, h: h.mul_(2.0),
            "F.relu inplace": lambda s, h: F.relu(h, inplace=True),
            "F.relu inplace positional": lambda s, h: F.relu(h, True),
            "nn.ReLU(inplace=True)": lambda s, h: s.act(h),
            "two in a row": lambda s, h: (h.mul_(3.0), s.act(h)),
            "torch.relu_": lambda s, h: torch.relu_(h),
            "F.relu_": lambda s, h: F.relu_(h),
        }
        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        types = set()
        for what, body in bodies.items():
            with self.subTest(what):
                g, _ = self.assert_loss_and_gradients(InPlace(body), inputs)
                types.update(op["type"] for op in g["ops"])
        # The ops are there.
        self.assertIn("relu", types)
        self.assertIn("scale", types)

    def test_in_place_op_on_a_view_of_a_tensor_used_later_fails(self):
        """h[:, 0].mul_(2) changes h through a view: not followed, so it
        fails naming the node instead of dropping the change."""
        m = InPlace(lambda s, h: h[:, :2].mul_(2.0))
        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(m, inputs)
        self.assertIn("mul_", str(cm.exception))
        self.assertIn("in place", str(cm.exception))
        self.assertIn("view", str(cm.exception))

        class LstmRelu(nn.Module):
            """An in-place op on one output of a module (an element of
            its output tuple, not a view of another output)."""

            def __init__(self):
                super().__init__()
                self.lstm = nn.LSTM(4, 6, batch_first=True)
                self.head = nn.Linear(6, 3)

            def forward(self, x, labels):
                out = self.lstm(x)
                o = out[0]
                F.relu(o, inplace=True)
                h = out[1][0]  # h_n, read after the in-place relu
                return F.cross_entropy(self.head(o[:, -1] + h[0]), labels)

        self.assert_loss_and_gradients(
            LstmRelu(), {"x": torch.randn(5, 7, 4), "labels": labels(5, 3)})


    def test_a_view_taken_before_an_in_place_op_and_used_after_fails(self):
        """k = h[:, :2]; h.mul_(2); ... k: only h's later uses took the
        change, so k read h unscaled and the loss was silently another
        (PyTorch's k sees the change). It fails naming the node; a view
        taken after the change, or one not used after it, still exports
        with PyTorch's loss."""
        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}

        class ViewThenChange(nn.Module):
            def __init__(self, view_after=False, use_view_later=True):
                super().__init__()
                self.fc = nn.Linear(4, 6)
                self.head = nn.Linear(2, 3)
                self.view_after = view_after
                self.use_view_later = use_view_later

            def forward(self, x, labels):
                h = self.fc(x)
                k = h[:, :2]
                early = k.sum()
                h.mul_(2.0)
                if self.view_after:
                    k = h[:, :2]
                out = h[:, :3] + early
                if self.use_view_later:
                    out = out + self.head(k)
                return F.cross_entropy(out, labels)

        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(ViewThenChange(), inputs)
        self.assertIn("'mul_'", str(cm.exception))
        self.assertIn("a view of it taken before the change is used after",
                      str(cm.exception))
        self.assert_loss_and_gradients(ViewThenChange(view_after=True), inputs)
        self.assert_loss_and_gradients(
            ViewThenChange(use_view_later=False), inputs)

    def test_in_place_operator_method_is_not_dropped(self):
        """h.__imul__(2) (an in-place operator called as a method) was
        dropped like the other unassigned in-place ops, and the loss read
        h unscaled; it is now used, and fails naming the method the
        exporter does not handle."""
        m = InPlace(lambda s, h: h.__imul__(2.0))
        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(m, inputs)
        self.assertIn("Tensor.__imul__", str(cm.exception))
        self.assertIn("not supported", str(cm.exception))
        # So is an in-place torch function the exporter does not handle.
        m = InPlace(lambda s, h: torch.sigmoid_(h))
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(m, inputs)
        self.assertIn("torch.sigmoid_", str(cm.exception))

    def test_out_argument_fails_naming_the_node(self):
        """torch.add(x, y, out=z) writes into z; the exporter dropped the
        out= and later uses of z read it unchanged, with exit status 0."""
        class Out(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x, labels):
                z = torch.zeros(5, 3)
                h = self.fc(x)
                torch.add(h, h, out=z)
                return F.cross_entropy(z, labels)

        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(Out(), inputs)
        self.assertIn("out=", str(cm.exception))
        self.assertIn("add", str(cm.exception))

    def test_torch_subclass_with_its_own_forward_is_not_its_base(self):
        """torch.nn.qat.Linear (a torch.nn.Linear whose forward
        fake-quantizes the weight) was exported as a plain Linear, its
        quantization lost, with exit status 0. It is traced through and
        fails naming the fake quantizer; its buffers, which the run resized,
        are put back (restoring them raised a RuntimeError traceback)."""
        import torch.nn.qat as qat

        class Qat(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = qat.Linear(
                    4, 6, qconfig=torch.quantization.get_default_qat_qconfig("fbgemm"))
                self.b = nn.Linear(6, 3)

            def forward(self, x, labels):
                return F.cross_entropy(self.b(self.a(x)), labels)

        m = Qat()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(m, inputs)
        self.assertIn("a.weight_fake_quant", str(cm.exception))
        self.assertIn("not supported", str(cm.exception))
        after = m.state_dict()
        self.assertEqual(sorted(before), sorted(after))
        for k, v in before.items():
            self.assertTrue(torch.equal(v, after[k]), k)

    def test_backward_hooks_fail_naming_them(self):
        """A module's backward hook or a parameter's gradient hook changes
        gradients in PyTorch; fx records neither, and the graph trained
        without them with exit status 0. Each is named."""
        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        m = InPlace(lambda s, h: None)
        m.fc.register_full_backward_hook(lambda mod, gi, go: (gi[0] * 0,))
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(m, inputs)
        self.assertIn("module 'fc' has a backward hook", str(cm.exception))
        m = InPlace(lambda s, h: None)
        m.head.weight.register_hook(lambda grad: grad * 2)
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(m, inputs)
        self.assertIn("parameter 'head.weight' has a gradient hook", str(cm.exception))
        self.export_valid(InPlace(lambda s, h: None), inputs)  # without: exported

    def test_a_run_that_fails_names_the_node_in_one_line(self):
        """A shape error in the run on the example inputs carried fx's
        "While executing %b : [#users=1] = call_module[target=b](...)" and
        "Original traceback: None" lines; it names the node in one line."""
        class Mismatch(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(4, 6)
                self.b = nn.Linear(5, 3)

            def forward(self, x, labels):
                return F.cross_entropy(self.b(self.a(x)), labels)

        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(Mismatch(), inputs)
        message = str(cm.exception)
        self.assertIn("cannot be multiplied", message)
        self.assertIn("(at node 'b': call_module b)", message)
        self.assertNotIn("Original traceback", message)
        self.assertNotIn("\n", message)

    def test_causal_mask_broadcast_over_one_query_fails(self):
        """scores [B, 1, S] + a causal [S, S] mask is [B, S, S] in PyTorch
        (the mask broadcasts the one query over S rows); the exporter
        marked the [B, 1, S] scores causal instead: a softmax that `hapctl
        validate` refused, after exit status 0. It now fails naming the
        add; square scores still take the mask."""
        class Attend(nn.Module):
            def __init__(self, last_only):
                super().__init__()
                self.fc = nn.Linear(6, 6)
                self.head = nn.Linear(6, 3)
                self.last_only = last_only

            def forward(self, x, labels):
                h = self.fc(x)  # [B, 5, 6]
                q = h[:, -1:] if self.last_only else h
                mask = torch.triu(torch.full((5, 5), float("-inf")), 1)
                w = F.softmax(q @ h.transpose(1, 2) + mask, -1)
                return F.cross_entropy(self.head((w @ h).mean(1)), labels)

        inputs = {"x": torch.randn(4, 5, 6), "labels": labels(4, 3)}
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(Attend(True), inputs)
        self.assertIn("node 'add'", str(cm.exception))
        g, _ = self.assert_loss_and_gradients(Attend(False), inputs)
        soft = [op for op in g["ops"] if op["type"] == "softmax"]
        self.assertTrue(soft[0]["attrs"]["causal"], soft)

    def test_no_grad_in_forward_fails_naming_the_node(self):
        """`with torch.no_grad(): t = self.a(x)` in forward: fx records no
        grad mode, so the graph trained self.a, which PyTorch leaves as it
        is (its gradient None), with exit status 0. It now fails naming
        the node; a constant computed under no_grad is still folded, and
        export() called under torch.no_grad() still exports."""
        class NoGrad(nn.Module):
            def __init__(self, frozen_part):
                super().__init__()
                self.a = nn.Linear(4, 6)
                self.b = nn.Linear(6, 3)
                self.frozen_part = frozen_part

            def forward(self, x, labels):
                with torch.no_grad():
                    scale = torch.ones(6) * 0.5  # a constant
                    t = self.a(x) if self.frozen_part else None
                if t is None:
                    t = self.a(x)
                return F.cross_entropy(self.b(t * scale), labels)

        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(NoGrad(True), inputs)
        self.assertIn("node 'a'", str(cm.exception))
        self.assertIn("torch.no_grad()", str(cm.exception))
        # torch.inference_mode() turns gradients off as well.
        class Inference(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(4, 6)
                self.b = nn.Linear(6, 3)

            def forward(self, x, labels):
                with torch.inference_mode():
                    t = self.a(x)
                return F.cross_entropy(self.b(t.clone()), labels)

        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(Inference(), inputs)
        self.assertIn("node 'a'", str(cm.exception))
        self.assertIn("inference_mode()", str(cm.exception))
        self.assert_loss_and_gradients(NoGrad(False), inputs)
        with torch.no_grad():
            g = export_fx.export(NoGrad(False), inputs)
        self.assertEqual([op["type"] for op in g["ops"]].count("linear"), 2)

    def test_forward_hooks_of_a_module_kept_whole_are_run(self):
        """fx makes a torch.nn module (nn.Linear, nn.LayerNorm) one node
        and does not run its forward hooks: a hook scaling nn.Linear's
        output, or a pre-hook changing its input, was dropped, a wrong
        loss with exit status 0. Their ops are traced now; a hook that
        returns None (one that only looks) changes nothing."""
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 6)
                self.norm = nn.LayerNorm(6)
                self.head = nn.Linear(6, 3)

            def forward(self, x, labels):
                return F.cross_entropy(self.head(self.norm(self.fc(x))),
                                       labels)

        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        seen = []
        m = Net()
        m.fc.register_forward_hook(lambda mod, i, o: o * 2.0 + 0.5)
        m.head.register_forward_pre_hook(lambda mod, i: (i[0] * 3.0,))
        m.norm.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
        g, _ = self.assert_loss_and_gradients(m, inputs)
        types = [op["type"] for op in g["ops"]]
        self.assertEqual(types.count("scale"), 2, types)
        self.assertEqual(types.count("add"), 1, types)

    def test_module_extra_state_is_named_not_a_traceback(self):
        """A module with extra state (get_extra_state: any object in its
        state_dict) was an AttributeError traceback ('dict' object has no
        attribute 'dtype'). It exports; the entry is named as one the
        graph does not hold, and --weights writes the tensors."""
        class Versioned(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def get_extra_state(self):
                return {"version": 3}

            def set_extra_state(self, state):
                pass

            def forward(self, x, labels):
                return F.cross_entropy(self.fc(x), labels)

        m = Versioned()
        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        g, values = self.assert_loss_and_gradients(m, inputs)
        extras = json.loads(g["metadata"][export_fx.EXTRAS_KEY])
        self.assertIn("_extra_state", extras["unheld"])
        self.assertIn("extra state", extras["unrecorded"]["_extra_state"])
        path = os.path.join(self.dir, "versioned.safetensors")
        export_fx.write_weights(path, g, values, m)
        got = export_fx._safetensors_io().read(path)
        self.assertEqual(sorted(got), ["fc.bias", "fc.weight"])
        self.assertTrue(torch.equal(got["fc.weight"], m.fc.weight.detach()))

    def test_constant_changed_in_place_after_a_use(self):
        """m = torch.zeros(6); y = h + m; m.add_(1): the use before the
        change read the changed constant (h + 1), as the value recorded
        for m was the tensor the in-place op then changed."""
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 6)
                self.head = nn.Linear(6, 3)

            def forward(self, x, labels):
                h = self.fc(x)
                m = torch.zeros(6)
                y = h + m
                m.add_(1.0)
                return F.cross_entropy(self.head(y * m + m), labels)

        class Traced(Net):
            """The constant made from a traced size: a graph node."""

            def forward(self, x, labels):
                h = self.fc(x)
                m = torch.zeros(h.shape[-1])
                y = h + m
                m.add_(1.0)
                return F.cross_entropy(self.head(y * m + m), labels)

        for cls in (Net, Traced):
            with self.subTest(cls.__name__):
                self.assert_loss_and_gradients(
                    cls(), {"x": torch.randn(5, 4), "labels": labels(5, 3)})

    def test_buffer_changed_in_place_fails_and_is_kept(self):
        """self.steps.add_(1) in forward (module state the graph cannot
        hold): the uses before the change read it changed, and the
        exporter's run on meta tensors changed the caller's buffer. It now
        fails naming the buffer, which is left as it was."""
        class Counting(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)
                self.register_buffer("steps", torch.zeros(()))

            def forward(self, x, labels):
                h = self.fc(x) + self.steps
                self.steps.add_(1.0)
                return F.cross_entropy(h * self.steps, labels)

        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        for run_on in ("meta", "cpu"):
            with self.subTest(run_on):
                m = Counting()
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(m, inputs, run_on=run_on)
                self.assertIn("'steps'", str(cm.exception))
                self.assertIn("in place", str(cm.exception))
                self.assertEqual(float(m.steps), 0.0)

    def test_tensor_attribute_changed_in_place_fails_and_is_kept(self):
        """self.scale = torch.ones(6) (a plain attribute) and
        self.scale.mul_(2) in forward: fx ran the change while tracing and
        recorded none, so every use read the doubled values and the
        caller's module was left changed. It now fails naming the
        attribute, which is put back; one holding NaN that forward leaves
        alone does not count as changed."""
        class Scaled(nn.Module):
            def __init__(self, change):
                super().__init__()
                self.fc = nn.Linear(4, 6)
                self.head = nn.Linear(6, 3)
                self.scale = torch.ones(6)
                self.unused = torch.tensor([float("nan"), 1.0])
                self.change = change

            def forward(self, x, labels):
                h = self.fc(x) * self.scale
                if self.change:
                    self.scale.mul_(2.0)
                return F.cross_entropy(self.head(h * self.scale), labels)

        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        m = Scaled(True)
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(m, inputs)
        self.assertIn("tensor attribute 'scale' in place", str(cm.exception))
        self.assertTrue(torch.equal(m.scale, torch.ones(6)))
        self.assert_loss_and_gradients(Scaled(False), inputs)

    def test_softmax_dtype_by_position_or_method_is_read(self):
        """torch.softmax(x, -1, torch.float64) read its dtype as
        F.softmax's _stacklevel and x.softmax(-1, dtype=...) did not read
        it: the graph declared a float64 softmax of a float32 input, which
        `hapctl validate` refused after export succeeded. Now an other
        dtype fails naming it, and x's own dtype is accepted."""
        class Scores(nn.Module):
            def __init__(self, f):
                super().__init__()
                self.fc = nn.Linear(4, 3)
                self.f = f

            def forward(self, x, labels):
                h = self.fc(x)
                return F.cross_entropy(self.f(h) * h, labels)

        inputs = {"x": torch.randn(5, 4), "labels": labels(5, 3)}
        other = {
            "torch.softmax": lambda h: torch.softmax(h, -1, torch.float64),
            "Tensor.softmax": lambda h: h.softmax(-1, torch.float64),
            "Tensor.softmax kw": lambda h: h.softmax(-1, dtype=torch.float64),
        }
        for what, f in other.items():
            with self.subTest(what):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(Scores(f), inputs)
                self.assertIn("softmax with dtype=torch.float64",
                              str(cm.exception))
        same = {
            "torch.softmax": lambda h: torch.softmax(h, -1, torch.float32),
            "Tensor.softmax": lambda h: h.softmax(-1, torch.float32),
            "F.softmax": lambda h: F.softmax(h, -1, dtype=torch.float32),
        }
        for what, f in same.items():
            with self.subTest(what):
                self.assert_loss_and_gradients(Scores(f), inputs)

    def test_subclass_of_a_transformer_module_with_its_own_forward(self):
        """A subclass of nn.TransformerEncoderLayer (or MultiheadAttention)
        that overrides forward was kept whole and exported as its base:
        `super().forward(src) * 3` lost its factor, a wrong loss with exit
        status 0. It is traced through now (PyTorch's forward has
        data-dependent control flow: an error naming the line); a subclass
        that keeps the base's forward is still decomposed."""
        class Tripled(nn.TransformerEncoderLayer):
            def forward(self, src, src_mask=None, src_key_padding_mask=None):
                return super().forward(src, src_mask,
                                       src_key_padding_mask) * 3.0

        class Named(nn.TransformerEncoderLayer):
            kind = "encoder"  # same forward

        class Net(nn.Module):
            def __init__(self, cls):
                super().__init__()
                self.layer = cls(8, 2, 16, dropout=0.0, batch_first=True)
                self.head = nn.Linear(8, 3)

            def forward(self, x, labels):
                return F.cross_entropy(self.head(self.layer(x)[:, 0]),
                                       labels)

        inputs = {"x": torch.randn(4, 5, 8), "labels": labels(4, 3)}
        g, _ = self.assert_loss_and_gradients(Net(Tripled), inputs, tol=1e-4)
        self.assertIn("layer_norm", [op["type"] for op in g["ops"]])
        g, _ = self.assert_loss_and_gradients(Net(Named), inputs, tol=1e-4)
        self.assertIn("layer_norm", [op["type"] for op in g["ops"]])

if __name__ == "__main__":
    U.main("export_review_test")
