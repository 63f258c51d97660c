#!/usr/bin/env python3
"""Export a PyTorch nn.Module to the HAP model IR (hap.v1.Graph, proto3 JSON).

The module is traced with torch.fx and run once on example inputs to learn
every tensor's shape; each traced node is then mapped onto the ops of
planner/graph (`hapctl ops` lists them). The module's forward must return the
scalar training loss (for example a wrapper that applies nn.CrossEntropyLoss
to the model's output and a labels input), or pass `loss=` (see export()).

Conventions (the same as the model zoo, planner/graph/zoo.cc):
  * Graph parameters are named as in the module's state_dict() (also with
    export(loss=...), whose wrapper adds no prefix), except
      - the parameters split from one PyTorch tensor, listed in the graph's
        metadata "hap.state_dict_slices" (below; so is, as a whole-tensor
        slice "<name>_1", a parameter whose name an input already has), and
      - exporter constants: frozen parameters with a constant initialiser
        that are not in the state_dict ("const.<node>" for literal tensors
        and scalars, "<module>.weight"/".bias" of a LayerNorm without affine).
  * nn.MultiheadAttention becomes three q/k/v linears (parameters sliced from
    in_proj_weight/in_proj_bias, named "<module>.q.weight", ".k.weight",
    ".v.weight", ".q.bias" ...), reshape to heads, transpose, matmul, scale,
    softmax, dropout, matmul, transpose, reshape and the output linear
    ("<module>.out_proj.weight"). With kdim/vdim != embed_dim its separate
    q/k/v_proj_weight keep their state_dict names.
  * metadata["hap.state_dict_slices"] (always present; "{}" when nothing is
    split) is a JSON object string: graph parameter -> {"source": state_dict
    name, "axis": int, "offset": int, "source_shape": [int, ...]}: the graph
    parameter is source.narrow(axis, offset, its size along axis), e.g.
    "enc.layers.0.self_attn.k.weight" -> {"source":
    "enc.layers.0.self_attn.in_proj_weight", "axis": 0, "offset": E,
    "source_shape": [3E, E]}. hap-executor --init-weights and
    `hapctl checkpoint export` read and write the source whole through it.
  * Attention key padding masks (key_padding_mask, src_/tgt_/
    memory_key_padding_mask; [batch, keys]): a bool mask (True = padding)
    that is a graph input (it becomes an INT64 0/1 input) or is computed
    from integer ids as `ids == c`, `ids != c`, `~mask` (the ids must also
    index an nn.Embedding, which bounds them) is an `embedding` of the ids
    in a [limit, 1] table of 0 and -1e30 (concatenated constants), reshaped
    to [batch, 1, 1, keys] and added by the softmax over heads and queries
    (plus the attn_mask, if any); one such mask per source, shared by every
    attention. A float mask is added as it is (PyTorch's additive mask),
    without an attn_mask only. Rows with a kept key equal PyTorch's; a row
    whose keys are all padded gets uniform weights (PyTorch: NaN).
  * nn.TransformerEncoderLayer (post-norm or norm_first, relu or gelu) and
    nn.TransformerEncoder are decomposed the same way as the zoo's
    BuildTransformer / PreNormBlock; nn.TransformerDecoderLayer,
    nn.TransformerDecoder and nn.Transformer likewise (self-attention,
    attention over the memory, feed-forward, in PyTorch's order). A
    subclass of these modules (or of nn.MultiheadAttention) that overrides
    forward is traced through instead, not decomposed as its base; so is
    torch's own subclass of a supported module made elsewhere that
    overrides forward (torch.nn.qat.Linear: its fake quantizer is then
    named as not supported).
  * nn.LSTM becomes one lstm op per layer and direction (the reverse
    direction with attribute reverse, both outputs concatenated on the
    features; nn.LSTM's dropout as dropout ops between layers; transposes
    around a sequence-first (batch_first=False) stack); its parameters keep
    their state_dict names (weight_ih_l0, bias_hh_l1_reverse, ...). Of
    `out, (h_n, c_n) = lstm(x)`, out and h_n are supported (h_n[k] is a
    slice of layer k's output at its last step); c_n, an initial state
    (h_0, c_0), proj_size and packed or unbatched sequences fail naming
    them.
  * nn.GRU from the zero state is one gru op per layer and direction in
    the same way (`out, h_n = gru(x)`, both supported); given an initial
    state h_0 it is unrolled over the sequence, as nn.RNN is
    (tools/fx_export/ops_lstm.py).
  * Initialisers keep the module's own values where the IR can: a parameter
    whose values are all equal is ZEROS / ONES / CONSTANT (a zero-initialised
    head stays zero); the others carry the kind of PyTorch's default
    initialisation of their module (UNIFORM / NORMAL), or for a bare
    nn.Parameter a kind fitted to its values. Values themselves go into the
    --weights file, not the graph.
  * A module parameter with requires_grad=False is a frozen graph parameter
    (not trained, as in PyTorch; in --weights and exports under its name).
  * A persistent floating-point buffer of one value used as it is (`x *
    self.scale`) is a frozen graph parameter under its state_dict name; other
    buffers are folded into exporter constants (those of unequal values
    are VALUES constants, listing them), their values recorded for --weights
    and checkpoint exports.
  * nn.Embedding / F.embedding with padding_idx: the lookup is multiplied by
    an embedding of the ids in a [rows, 1] table of ones with a 0 at
    padding_idx (concatenated constants), so that row gets no gradient, as
    in PyTorch; its output is 0, PyTorch's while the row is zero (as
    nn.Embedding initialises it; a nonzero padding row fails, and so does
    scale_grad_by_freq).
  * Integer inputs become INT64; the ones used only as loss targets are LABELS.
  * Dropout is exported as in training mode (the IR is one training step).
  * An op that changes a tensor in place (x.add_(y), x.mul_(2), F.relu(x,
    inplace=True), nn.ReLU(inplace=True), x += y) is followed, also when
    its result is not assigned: later uses of x take its result. One that
    changes a view of a tensor used afterwards (x[:, 0].mul_(2)) fails
    naming it, and so does one that changes a buffer, parameter or plain
    tensor attribute of the module (state the graph does not hold; the
    module is left as it was), and a result that forward computes from the
    inputs or parameters under torch.no_grad() (fx records no grad mode;
    PyTorch gives it no gradient). Forward hooks of modules kept whole
    (nn.Linear ...) are traced as Module.__call__ runs them; backward hooks
    (a module's, a parameter's register_hook, a global one) fail naming
    them, and so does a call with out= (torch.add(x, y, out=z)).

Command line:
  /usr/bin/python3 tools/export_fx.py --module pkg.mod:factory_or_class \
      [--kwargs '{"hidden": 64}'] [--input-shape x=8,16] \
      [--input-shape tokens=8,128:int64[:HIGH]] [--name NAME] -o out.json \
      [--weights OUT.safetensors]

  MODULE is "package.module:attr" or "path/to/file.py:attr"; attr is an
  nn.Module instance, a class or a factory called with --kwargs (which an
  instance, built already, does not take: an error). A factory may
  return (module, {name: example tensor}) and a module may have an
  `example_inputs` attribute (a dict or a callable returning one); --input-shape
  adds or replaces inputs: float32 random normal, an integer dtype filled
  with zeros (or random integers in [0, HIGH) when HIGH is given), or bool
  (a key padding mask input: all False).

  --weights OUT.safetensors also writes the module's current parameters
  as a safetensors file under their state_dict names, split tensors
  whole (in_proj_weight, not q/k/v), BatchNorm running statistics included
  (module buffers the graph keeps as state), every name of a tied tensor
  (`head.weight = emb.weight`: one graph parameter, both names written),
  BatchNorm's num_batches_tracked, the buffers folded into constants
  (or unused) and the parameters forward does not use with their values,
  exporter constants left out (the graph's
  metadata "hap.state_dict_extras" lists the tied names, the constants, the
  counters with their forwards per step, the folded buffers and unused
  parameters with their values, which checkpoint exports give back as
  they were, and the state_dict entries the graph does not hold and cannot
  record: buffers of a dtype safetensors has no name for (complex) or past
  65536 runs of equal values, unused parameters past 262144 such runs
  (about 1 MiB of float32 values of random initialisation), named on
  stderr; --init-weights accepts a file of the whole model.state_dict()):
  `module.load_state_dict(safetensors_io.read(OUT), strict=True)` restores
  them exactly (tools/safetensors_io.py) when nothing was named, and
  `hap-executor --init-weights OUT` starts training from them. In Python: export(..., return_values=True), then
  state_dict_weights(graph, values) or write_weights(path, graph, values).

-o - writes the graph to standard output; --weights takes a file (not
'-'). -o and --weights are each written into a temporary file beside them and
renamed into place only when both are complete (a device or FIFO such as
/dev/stdout is written in place): a failed write leaves both as they were.

Exit status: 0 on success, 2 on an unsupported op/module, a bad argument, an
error in the module's own code (import, factory) or a file that cannot be
written (the message names the fx node and its target, the argument, the
exception and its place, or the file).

The implementation is the package tools/fx_export/ (its __init__.py maps
it): tracing, the exporter core, and one file of handlers per op family,
found through dispatch tables. This file is its entry point and public API:
export, state_dict_slices, state_dict_weights, write_weights, ExportError,
SLICES_KEY, BUFFERS_KEY, EXTRAS_KEY and main.
"""

import os
import sys

# fx_export is next to this file; tools/ is on sys.path when this file runs
# as a script or is imported from there, but not when it is loaded by path
# (e.g. importlib from another directory).
_HERE = os.path.dirname(os.path.realpath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)

from fx_export.api import export  # noqa: E402,F401
from fx_export.cli import main  # noqa: E402
from fx_export.ir import (  # noqa: E402,F401
    BUFFERS_KEY, EXTRAS_KEY, SLICES_KEY, ExportError)
from fx_export.weights import (  # noqa: E402,F401
    state_dict_slices, state_dict_weights, write_weights)
# tools/safetensors_io.py as a module (tests/export_fx_test.py uses it).
from fx_export.weights import (  # noqa: E402,F401
    safetensors_io as _safetensors_io)

__all__ = ["BUFFERS_KEY", "EXTRAS_KEY", "ExportError", "SLICES_KEY", "export", "main",
           "state_dict_slices", "state_dict_weights", "write_weights"]

if __name__ == "__main__":
    sys.exit(main())
