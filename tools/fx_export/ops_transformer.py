"""PyTorch's transformer modules, decomposed as the zoo builds them
(planner/graph/zoo.cc: BuildTransformer, PreNormBlock): nn.TransformerEncoder
(Layer), nn.TransformerDecoder(Layer) and nn.Transformer, post-norm or
norm_first, with their attention masks and key padding masks. The tracer
keeps them whole (tracing.HapTracer.LEAVES) for these handlers."""

import functools

import torch.nn as nn

from . import registry
from .ir import join
from .ops_attention import mha
from .ops_elementwise import activation, dropout
from .ops_linear import linear_module
from .ops_normalization import layer_norm


def _attention(ex, mod, at, attn, drop, q, kv, mask, key_padding_mask,
               batch_first, scope):
    """The layer's attention `attn` (self_attn, multihead_attn) of q over
    kv, then its dropout `drop`."""
    h = mha(ex, getattr(mod, attn), at(attn), q, kv, kv, mask,
            key_padding_mask, batch_first)
    return dropout(ex, getattr(mod, drop).p, at(drop), h, scope)


def _feed_forward(ex, mod, at, h, scope, last_dropout):
    """A layer's linear1, activation, dropout, linear2 and `last_dropout`."""
    h = linear_module(ex, mod.linear1, at("linear1"), h, scope)
    h = activation(ex, mod.activation, at("activation"), h, scope)
    h = dropout(ex, mod.dropout.p, at("dropout"), h, scope)
    h = linear_module(ex, mod.linear2, at("linear2"), h, scope)
    return dropout(ex, getattr(mod, last_dropout).p, at(last_dropout), h,
                   scope)


def _residual_blocks(ex, mod, at, x, blocks, scope):
    """x through `blocks` ([(norm leaf, block fn, residual name)]), each
    with its residual add and LayerNorm, post-norm or norm_first."""
    def add(name, a, b):
        return ex.emit("add", at(name), [a, b], None, a.shape, scope=scope)

    for leaf, block, res in blocks:
        norm = getattr(mod, leaf)
        if mod.norm_first:
            x = add(res, x, block(layer_norm(ex, norm, at(leaf), x, scope)))
        else:
            x = layer_norm(ex, norm, at(leaf), add(res, x, block(x)), scope)
    return x


def encoder_layer(ex, mod, path, x, mask, key_padding_mask,
                  batch_first=None):
    """nn.TransformerEncoderLayer: self-attention and feed-forward, each
    with its dropout and residual, post-norm or norm_first."""
    at = functools.partial(join, path)  # "<path>.<leaf>"
    scope = path.replace(".", "/")

    def sa(h):
        return _attention(ex, mod, at, "self_attn", "dropout1", h, h, mask,
                          key_padding_mask, batch_first, scope)

    def ff(h):
        return _feed_forward(ex, mod, at, h, scope, "dropout2")

    return _residual_blocks(ex, mod, at, x, (("norm1", sa, "attn_residual"),
                                             ("norm2", ff, "ff_residual")),
                            scope)


def decoder_layer(ex, mod, path, x, memory, tgt_mask, memory_mask,
                  tgt_key_padding_mask, memory_key_padding_mask,
                  batch_first=None):
    """nn.TransformerDecoderLayer: self-attention (tgt_mask), attention
    over the memory (memory_mask), feed-forward, each with its dropout
    and residual, post-norm or norm_first (PyTorch's order)."""
    at = functools.partial(join, path)  # "<path>.<leaf>"
    scope = path.replace(".", "/")

    def sa(h):
        return _attention(ex, mod, at, "self_attn", "dropout1", h, h,
                          tgt_mask, tgt_key_padding_mask, batch_first, scope)

    def ca(h):
        return _attention(ex, mod, at, "multihead_attn", "dropout2", h,
                          memory, memory_mask, memory_key_padding_mask,
                          batch_first, scope)

    def ff(h):
        return _feed_forward(ex, mod, at, h, scope, "dropout3")

    return _residual_blocks(ex, mod, at, x,
                            (("norm1", sa, "self_attn_residual"),
                             ("norm2", ca, "cross_attn_residual"),
                             ("norm3", ff, "ff_residual")), scope)


def layer_stack(ex, mod, path, layer_type, x, memory, run_layer):
    """nn.TransformerEncoder/Decoder: its layers (run_layer, batch
    first) and optional final LayerNorm; sequence-first stacks are
    transposed once (x and memory), not per layer."""
    at = functools.partial(join, path)  # "<path>.<leaf>"
    scope = path.replace(".", "/")
    layers = list(mod.layers)
    if not all(isinstance(l, layer_type) for l in layers):
        ex.fail(f"{path}: layers must be nn.{layer_type.__name__}")
    seq_first = bool(layers) and not layers[0].self_attn.batch_first
    if seq_first:  # one transpose for the whole stack, not per layer
        x = ex.transpose(at("batch_first"), x, (1, 0, 2), scope)
        if memory is not None:
            memory = ex.transpose(at("memory_batch_first"), memory,
                                  (1, 0, 2), scope)
    for i, layer in enumerate(layers):
        if layer.self_attn.batch_first != (not seq_first):
            ex.fail(f"{path}: mixed batch_first layers")
        x = run_layer(layer, at(f"layers.{i}"), x, memory)
    if mod.norm is not None:
        if not isinstance(mod.norm, nn.LayerNorm):
            ex.fail(f"{path}: norm must be an nn.LayerNorm")
        x = layer_norm(ex, mod.norm, at("norm"), x, scope)
    if seq_first:
        x = ex.transpose(at("seq_first"), x, (1, 0, 2), scope)
    return x


def encoder(ex, mod, path, x, mask, key_padding_mask):
    return layer_stack(ex, mod, path, nn.TransformerEncoderLayer, x, None,
                       lambda layer, at_i, h, mem: encoder_layer(
                           ex, layer, at_i, h, mask, key_padding_mask,
                           batch_first=True))


def decoder(ex, mod, path, x, memory, tgt_mask, memory_mask,
            tgt_key_padding_mask, memory_key_padding_mask):
    return layer_stack(ex, mod, path, nn.TransformerDecoderLayer, x, memory,
                       lambda layer, at_i, h, mem: decoder_layer(
                           ex, layer, at_i, h, mem, tgt_mask, memory_mask,
                           tgt_key_padding_mask, memory_key_padding_mask,
                           batch_first=True))


# ---- the modules -----------------------------------------------------------


def _encoder_args(ex, call, mask):
    """The arguments after `mod, path` of encoder_layer and encoder, in
    their order; `mask` names the attention mask (a layer's src_mask, a
    stack's mask)."""
    a = call.bound()
    return (ex.t(a["src"]), call.optional(a[mask]),
            call.optional(a["src_key_padding_mask"]))


@registry.modules(nn.TransformerEncoderLayer)
def _encoder_layer_module(ex, call):
    return encoder_layer(ex, call.mod, call.path,
                         *_encoder_args(ex, call, "src_mask"))


@registry.modules(nn.TransformerEncoder)
def _encoder_module(ex, call):
    return encoder(ex, call.mod, call.path, *_encoder_args(ex, call, "mask"))


def _decoder_args(ex, call, a, memory=None):
    """The arguments after `mod, path` of decoder_layer and decoder, from
    the bound arguments `a`, converted in their order; `memory`: the
    encoder's output (nn.Transformer), else the argument `memory`."""
    tgt = ex.t(a["tgt"])
    if memory is None:
        memory = ex.t(a["memory"])
    return (tgt, memory, call.optional(a["tgt_mask"]),
            call.optional(a["memory_mask"]),
            call.optional(a["tgt_key_padding_mask"]),
            call.optional(a["memory_key_padding_mask"]))


@registry.modules(nn.TransformerDecoderLayer)
def _decoder_layer_module(ex, call):
    a = call.bound()
    return decoder_layer(ex, call.mod, call.path, *_decoder_args(ex, call, a))


@registry.modules(nn.TransformerDecoder)
def _decoder_module(ex, call):
    a = call.bound()
    return decoder(ex, call.mod, call.path, *_decoder_args(ex, call, a))


@registry.modules(nn.Transformer)
def _transformer_module(ex, call):
    mod, path = call.mod, call.path
    a = call.bound()
    if not isinstance(mod.encoder, nn.TransformerEncoder) or \
            not isinstance(mod.decoder, nn.TransformerDecoder):
        ex.fail("nn.Transformer with a custom encoder or decoder "
                "is not supported")
    memory = encoder(ex, mod.encoder, join(path, "encoder"), ex.t(a["src"]),
                     call.optional(a["src_mask"]),
                     call.optional(a["src_key_padding_mask"]))
    return decoder(ex, mod.decoder, join(path, "decoder"),
                   *_decoder_args(ex, call, a, memory))
