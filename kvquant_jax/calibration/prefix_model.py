"""A differentiable LLaMA forward over ``[prefix rows | body tokens]`` with per-layer outputs.

Used by IntactKV calibration (gradients reach the prefix K/V), PrefixQuant discovery (per-token ``down_proj`` input
maxima) and static-scale calibration (exact body K/V rows).  Each layer is the model's own
``decoder_layer`` (so any ``linear`` hook, W8A8 included, applies) and it follows ``llama.forward``'s chunked
cache contract exactly:

* body token ``t`` sits at position ``P + t`` (``P`` prefix rows, positions ``0..P-1``);
* the body is processed in chunks of ``chunk`` tokens; a chunk attends, under ONE softmax, to the prefix rows, to the
  body history as the body scheme stores it (append the exact rows, ``materialize_layer`` them back), and to its
  own exact K/V (causal).  With the same chunking, the logits equal ``llama.forward`` over a
  ``cache.prefix.start_request`` cache (tested).

Gradients through quantized history: STRAIGHT-THROUGH ESTIMATOR.  The history a chunk reads is
``h = deq + (exact - stop_gradient(exact))``: the forward value is exactly the scheme's dequantized rows ``deq``;
the backward pass treats the quantize-dequantize round trip as the identity, so gradients flow from later chunks
into the exact K/V of earlier body rows (and from there into the prefix).  The scheme itself only ever sees
``stop_gradient`` inputs (its rounding is never differentiated).  ``body=None`` reads exact history (the
full-precision teacher).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache.interface import CacheScheme
from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.models.llama import attend, decoder_layer, dense, logits_from_hidden

OUTPUTS = ("logits", "hidden", "down_max", "kv")


class _DownInputMax:
    """A ``linear`` hook that delegates every projection to ``base`` and records the per-token ``max |x|`` of the
    ``down`` projection's input (PrefixQuant's outlier statistic). A ``norm_linears`` group method of ``base``
    (e.g. W8A8's fused RMSNorm producer) is kept, so the model computes exactly what it computes without the hook."""

    def __init__(self, base):
        self.base = base
        self.down_max = None
        if hasattr(base, "norm_linears"):
            self.norm_linears = base.norm_linears

    def __call__(self, x, w, name):
        if name == "down":
            self.down_max = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
        return self.base(x, w, name)


def block(cfg: LlamaConfig, x, lp, positions, attn_fn, linear=None):
    """The model's own decoder layer (:func:`kvquant_jax.models.llama.decoder_layer`, with ``linear`` or the
    config's activation policy), also reporting its ``down_proj`` input.

    Returns ``(x', k, v, down_max)``: ``k`` post-RoPE and ``v`` ``[B, T, Hkv, D]``; ``down_max [B, T]`` float32 is the
    per-token ``max |silu(gate) * up|`` (the input of ``w_down``: PrefixQuant's outlier statistic).
    """
    hook = _DownInputMax(linear or cfg.activation or dense)
    x, k, v = decoder_layer(cfg, x, lp, positions, attn_fn, hook)
    return x, k, v, hook.down_max


def init_body_state(body: CacheScheme, cfg: LlamaConfig, batch: int, capacity: int, *, k_scales=None,
                    v_scales=None):
    """Stacked ``[L, ...]`` empty body state; ``k_scales, v_scales`` (``[L]`` or ``[L, Hkv]``) fill the
    ``k_scale``/``v_scale`` fields of a static-scale scheme."""
    one = body.init_layer(batch, capacity, cfg.num_kv_heads, cfg.head_dim)
    st = jax.tree.map(lambda a: jnp.broadcast_to(a, (cfg.num_layers,) + a.shape), one)
    if k_scales is not None:
        shape = st.k_scale.shape
        st = st.replace(k_scale=jnp.broadcast_to(jnp.asarray(k_scales, jnp.float32).reshape(shape[0], -1), shape),
                        v_scale=jnp.broadcast_to(jnp.asarray(v_scales, jnp.float32).reshape(shape[0], -1), shape))
    return st


@functools.partial(jax.jit, static_argnames=("cfg", "body", "chunk", "want"))
def prefix_forward(params, cfg: LlamaConfig, tokens, prefix_k=None, prefix_v=None, body_state=None, *,
                   body: CacheScheme | None = None, chunk: int | None = None, want: tuple = ("logits",)):
    """Forward body ``tokens`` after prefix rows.

    Args:
      tokens: int32 ``[B, T]`` (all valid), at positions ``P + t``.
      prefix_k, prefix_v: float ``[L, 1 or B, Hkv, P, D]`` (keys post-RoPE at positions ``0..P-1``) or None.
      body_state: stacked ``[L, ...]`` initial body state (e.g. from :func:`init_body_state` with static scales);
        default: an empty ``body`` state of capacity ``T``.
      body: scheme the body history is read through (None: exact history).
      chunk: tokens per forward (``T`` must be a multiple; default ``T``).
      want: any of "logits" ``[B, T, V]``, "hidden" (layer outputs ``[L, B, T, H]``), "down_max" ``[L, B, T]``,
        "kv" (exact body rows ``(k, v)``, each ``[L, B, T, Hkv, D]``).
    """
    unknown = set(want) - set(OUTPUTS)
    if unknown:
        raise ValueError(f"prefix_forward: unknown outputs {sorted(unknown)}; choose from {OUTPUTS}")
    b, t = tokens.shape
    c = chunk or t
    if t % c:
        raise ValueError(f"prefix_forward: {t} tokens are not a multiple of chunk {c}")
    n_chunks, n_layers = t // c, cfg.num_layers
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    if prefix_k is None:
        prefix_k = prefix_v = jnp.zeros((n_layers, 1, hkv, 0, d), jnp.float32)
    p = prefix_k.shape[3]
    if body is not None and body_state is None:
        body_state = init_body_state(body, cfg, b, t)
    exact = jnp.zeros((n_layers, b, hkv, t, d), jnp.float32)
    x_chunks = jnp.swapaxes(params["embed"][tokens].reshape(b, n_chunks, c, -1), 0, 1)   # [n, B, c, H]
    num_new = jnp.full((b,), c, jnp.int32)

    def chunk_step(carry, inp):
        st, ek, ev = carry
        x, j = inp
        blen = j * c
        lens = jnp.full((b,), blen, jnp.int32)
        positions = jnp.broadcast_to(p + blen + jnp.arange(c, dtype=jnp.int32), (b, c))
        valid = jnp.concatenate([jnp.ones((b, p), jnp.bool_),
                                 jnp.broadcast_to(jnp.arange(t) < blen, (b, t))], axis=1)

        def layer_step(x, inp):
            lp, pk, pv, lst, lek, lev = inp

            def attn_fn(q, k, v):
                if body is None:
                    hk, hv = lek, lev
                else:   # straight-through: forward value = stored (dequantized) rows, backward = identity
                    mk, mv, _ = body.materialize_layer(lst, lens)
                    hk = mk + (lek - jax.lax.stop_gradient(lek))
                    hv = mv + (lev - jax.lax.stop_gradient(lev))
                hk = jnp.concatenate([jnp.broadcast_to(pk.astype(jnp.float32), (b,) + pk.shape[1:]), hk], axis=2)
                hv = jnp.concatenate([jnp.broadcast_to(pv.astype(jnp.float32), (b,) + pv.shape[1:]), hv], axis=2)
                return attend(q, k, v, num_new, (hk, hv, valid))

            x, k, v, dmax = block(cfg, x, lp, positions, attn_fn)
            start = (0, 0, blen, 0)
            lek = jax.lax.dynamic_update_slice(lek, jnp.swapaxes(k, 1, 2).astype(jnp.float32), start)
            lev = jax.lax.dynamic_update_slice(lev, jnp.swapaxes(v, 1, 2).astype(jnp.float32), start)
            if body is not None:
                lst = body.append_layer(lst, lens, jax.lax.stop_gradient(k), jax.lax.stop_gradient(v), num_new)
            out = {}
            if "hidden" in want:
                out["hidden"] = x
            if "down_max" in want:
                out["down_max"] = dmax
            if "kv" in want:
                out["kv"] = (k, v)
            return x, (lst, lek, lev, out)

        x, (st, ek, ev, outs) = jax.lax.scan(layer_step, x, (params["layers"], prefix_k, prefix_v, st, ek, ev))
        if "logits" in want:
            outs["logits"] = logits_from_hidden(params, cfg, x)
        return (st, ek, ev), outs

    _, outs = jax.lax.scan(chunk_step, (body_state, exact, exact), (x_chunks, jnp.arange(n_chunks)))

    def join(a, layer_axis):   # [n, (L,) B, c, ...] -> [(L,) B, T, ...]
        if layer_axis:
            a = jnp.moveaxis(a, 0, 2)                 # [L, B, n, c, ...]
            return a.reshape(a.shape[:2] + (t,) + a.shape[4:])
        a = jnp.moveaxis(a, 0, 1)                     # [B, n, c, ...]
        return a.reshape((b, t) + a.shape[3:])

    res = {}
    if "logits" in want:
        res["logits"] = join(outs["logits"], False)
    for name in ("hidden", "down_max"):
        if name in want:
            res[name] = join(outs[name], True)
    if "kv" in want:
        res["kv"] = tuple(join(a, True) for a in outs["kv"])
    return res


def artifact_rows(artifact, dtype=jnp.float32):
    """``(prefix_k, prefix_v)`` ``[L, 1, Hkv, P, D]`` device arrays of a :class:`PrefixArtifact` (or None)."""
    if artifact is None:
        return None, None
    return (jnp.asarray(np.asarray(artifact.k)[:, None], dtype), jnp.asarray(np.asarray(artifact.v)[:, None], dtype))
