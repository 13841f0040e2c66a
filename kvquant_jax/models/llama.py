"""LLaMA decoder as a pure function of (params, tokens, cache) -> (logits, cache', ok).

Shapes: B batch, T tokens in this forward, H hidden, Hq query heads, Hkv KV heads, D head_dim, G = Hq // Hkv,
C cache capacity, V vocab.  Layers run under ``lax.scan`` over parameters stacked on a leading layer axis; cache
layer states are stacked the same way (one stacked group per run of layers sharing a scheme).

Attention contract (design notes 0x06D): the current forward attends with the EXACT K/V it just produced (causal
within the chunk) plus the retained history decoded from the cache's stored representation, under ONE softmax;
the stored representation (quantized or not) only affects what later forwards read.  Quantization affects
retention only.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from kvquant_jax.cache.interface import KVCache
from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.models.rope import apply_rope

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
NEG_INF = -1e30


def cast_params(params: dict, dtype: str = "fp32") -> dict:
    """NumPy/JAX params -> jnp arrays in ``dtype`` (norm weights stay float32)."""
    dt = DTYPES[dtype]

    def cast(path, a):
        name = jax.tree_util.keystr(path)
        return jnp.asarray(a, jnp.float32 if "norm" in name else dt)

    return jax.tree_util.tree_map_with_path(cast, params)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32; returns x's dtype. x: [..., H], w: [H]."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + jnp.float32(eps))
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def _dot(x, w):
    return jnp.matmul(x, w.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)


def dense(x, w, name: str):
    """The default ``linear(x, w, name)`` hook: ``x [..., K] @ w [K, N]`` in x's dtype (``name`` is one of q, k, v,
    o, gate, up, down, lm_head; unused here). An activation policy (``kvquant_jax.models.w8a8``) replaces it."""
    del name
    return _dot(x, w)


def attend(q: jax.Array, k_cur: jax.Array, v_cur: jax.Array, num_new: jax.Array,
           hist: tuple[jax.Array, jax.Array, jax.Array] | None) -> jax.Array:
    """One softmax over [history, current chunk].

    q: [B, T, Hq, D]; k_cur, v_cur: [B, T, Hkv, D]; num_new: int32 [B] (keys t >= num_new are padding);
    hist: optional (k [B, Hkv, C, D] f32, v [B, Hkv, C, D] f32, valid bool [B, C]).
    Returns [B, T, Hq, D] in q's dtype; scores and softmax in float32.
    """
    b, t, hq, d = q.shape
    hkv = k_cur.shape[2]
    g = hq // hkv
    scale = jnp.float32(1.0 / (d ** 0.5))
    qf = q.astype(jnp.float32).reshape(b, t, hkv, g, d)
    kc, vc = k_cur.astype(jnp.float32), v_cur.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    s_cur = jnp.einsum("btkgd,bskd->bkgts", qf, kc, precision=hp) * scale          # [B, Hkv, G, T, S=T]
    ti = jnp.arange(t)
    causal = (ti[None, :] <= ti[:, None])[None] & (ti[None, None, :] < num_new[:, None, None])  # [B, T, S]
    s_cur = jnp.where(causal[:, None, None], s_cur, jnp.float32(NEG_INF))
    if hist is not None:
        hk, hv, valid = hist
        s_hist = jnp.einsum("btkgd,bkcd->bkgtc", qf, hk, precision=hp) * scale      # [B, Hkv, G, T, C]
        s_hist = jnp.where(valid[:, None, None, None, :], s_hist, jnp.float32(NEG_INF))
        s = jnp.concatenate([s_hist, s_cur], axis=-1)
    else:
        s = s_cur
    p = jax.nn.softmax(s, axis=-1)
    if hist is not None:
        c = hk.shape[2]
        out = (jnp.einsum("bkgtc,bkcd->btkgd", p[..., :c], hv, precision=hp)
               + jnp.einsum("bkgts,bskd->btkgd", p[..., c:], vc, precision=hp))
    else:
        out = jnp.einsum("bkgts,bskd->btkgd", p, vc, precision=hp)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def norm_linears(linear: Callable, x, norm_w, eps: float, projections) -> list:
    """``RMSNorm(x; norm_w, eps)`` followed by each ``(w, name)`` of ``projections`` (weights that read the same
    normalized activations: q/k/v, gate/up, the head). A ``linear`` hook with a ``norm_linears`` method (e.g.
    ``W8A8Policy``) receives the whole group, so it can fuse the norm into a single activation quantization shared
    by the group; any other hook gets ``linear(rms_norm(x), w, name)`` per projection."""
    group = getattr(linear, "norm_linears", None)
    if group is not None:
        return group(x, norm_w, eps, projections)
    h = rms_norm(x, norm_w, eps)
    return [linear(h, w, name) for w, name in projections]


def _qkv(cfg: LlamaConfig, x, lp, positions, linear: Callable | None = None):
    """Projections of one layer: q ``[B, T, Hq, D]``, k, v ``[B, T, Hkv, D]`` (q, k post-RoPE).
    ``linear(x, w, name)`` computes each projection (default ``cfg.activation`` or :func:`dense`)."""
    linear = linear or cfg.activation or dense
    b, t, _ = x.shape
    q, k, v = norm_linears(linear, x, lp["attn_norm"], cfg.rms_eps, ((lp["wq"], "q"), (lp["wk"], "k"), (lp["wv"], "v")))
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    return (apply_rope(q, positions, cfg.rope_theta, cfg.rope_pairing),
            apply_rope(k, positions, cfg.rope_theta, cfg.rope_pairing), v)


def _finish(cfg: LlamaConfig, x, lp, a, linear: Callable | None = None):
    """Output projection + residual, then the SwiGLU MLP block. a: attention output ``[B, T, Hq, D]``."""
    linear = linear or cfg.activation or dense
    b, t, _ = x.shape
    x = x + linear(a.reshape(b, t, cfg.num_heads * cfg.head_dim), lp["wo"], "o")
    gate, up = norm_linears(linear, x, lp["ffn_norm"], cfg.rms_eps, ((lp["w_gate"], "gate"), (lp["w_up"], "up")))
    return x + linear(jax.nn.silu(gate) * up, lp["w_down"], "down")


def _layer(cfg: LlamaConfig, x, lp, positions, attn_fn: Callable, linear: Callable | None = None):
    """One decoder layer. ``attn_fn(q, k, v) -> [B, T, Hq, D]``. Returns (x', k, v) (this forward's exact K/V)."""
    q, k, v = _qkv(cfg, x, lp, positions, linear)
    return _finish(cfg, x, lp, attn_fn(q, k, v), linear), k, v


def logits_from_hidden(params, cfg: LlamaConfig, x, linear: Callable | None = None):
    """Final norm + output head -> float32 logits. A quantized head (``params["lm_head_q"]``, made only when an
    activation policy names ``lm_head``) goes through ``linear``; otherwise the float head as before."""
    linear = linear or cfg.activation or dense
    if "lm_head_q" in params:
        return norm_linears(linear, x, params["final_norm"], cfg.rms_eps,
                            ((params["lm_head_q"], "lm_head"),))[0].astype(jnp.float32)
    x = rms_norm(x, params["final_norm"], cfg.rms_eps)
    if cfg.tie_embeddings:
        return jnp.einsum("bth,vh->btv", x, params["embed"].astype(x.dtype),
                          precision=jax.lax.Precision.HIGHEST).astype(jnp.float32)
    return _dot(x, params["lm_head"]).astype(jnp.float32)


def forward_nocache(params, cfg: LlamaConfig, tokens: jax.Array, positions: jax.Array | None = None,
                    num_new: jax.Array | None = None, linear: Callable | None = None) -> jax.Array:
    """Plain causal forward without a cache: tokens int32 [B, T] -> logits float32 [B, T, V].

    ``linear``: optional ``linear(x, w, name)`` hook for every projection (None = float :func:`dense`), e.g. a
    ``kvquant_jax.models.w8a8.W8A8Policy`` with the params from its ``quantize_params``."""
    linear = linear or cfg.activation or dense
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if num_new is None:
        num_new = jnp.full((b,), t, jnp.int32)
    x = params["embed"][tokens]

    def body(x, lp):
        x, _, _ = _layer(cfg, x, lp, positions, lambda q, k, v: attend(q, k, v, num_new, None), linear)
        return x, None

    x, _ = jax.lax.scan(body, x, params["layers"])
    return logits_from_hidden(params, cfg, x, linear)


def forward(params, cfg: LlamaConfig, tokens: jax.Array, cache: KVCache, num_new: jax.Array | None = None,
            *, attention_impl: str = "reference", linear: Callable | None = None
            ) -> tuple[jax.Array, KVCache, jax.Array]:
    """Forward ``tokens`` (int32 [B, T]) at positions ``cache.lengths + t`` and append them to the cache.

    Args:
      num_new: int32 [B]: valid tokens per sequence (right padding beyond); default all T.
      attention_impl: "reference" (decode the stored history, one softmax in JAX) or "kernel"/"auto" (decode
        steps, T == 1, go through ``kvquant_jax.attention.dispatch.decode_attention`` which reads packed codes).
      linear: optional ``linear(x, w, name)`` projection hook (None = float); a hashable policy object (e.g.
        ``kvquant_jax.models.w8a8.W8A8Policy``) so it can be a static jit argument. The hook sees ``x [B, T, K]``,
        so it can specialise on the phase (prefill T > 1, decode T == 1).
    Returns:
      logits float32 [B, T, V]; the successor cache; ok: bool scalar. ``ok`` is False when any K/V row of any
      layer is non-finite: then ``lengths`` are NOT advanced (nothing is published) and the caller must raise.
    """
    b, t = tokens.shape
    linear = linear or cfg.activation or dense
    if num_new is None:
        num_new = jnp.full((b,), t, jnp.int32)
    lengths = cache.lengths
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    x = params["embed"][tokens]
    new_groups = []
    ok = jnp.bool_(True)
    for (scheme, first, n), gstate in zip(cache.schemes, cache.groups):
        lp_all = jax.tree.map(lambda a: a[first:first + n], params["layers"])

        def body(carry, inp, scheme=scheme):
            # The stacked group state rides in the carry. The append is written first (dynamic_update_slice of
            # this layer's slice) and attention then reads the UPDATED state at the OLD lengths: by the frontier
            # rule that view equals the old state's, and with no reader of the pre-append buffer left XLA updates
            # the donated cache in place (no per-step copy of the cache).
            x, ok, gst = carry
            lp, i = inp
            q, k, v = _qkv(cfg, x, lp, positions, linear)
            st = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), gst)
            st2, fin = scheme.append_layer_with_status(st, lengths, k, v, num_new)
            gst = jax.tree.map(lambda a, u: jax.lax.dynamic_update_index_in_dim(a, u.astype(a.dtype), i, 0), gst, st2)
            if scheme.append_keeps_old_view(t):
                view = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), gst)
            else:  # a long append may wrap residual rings onto slots still visible at the old lengths
                view = st
            if attention_impl != "reference" and t == 1:
                from kvquant_jax.attention.dispatch import decode_attention

                a = decode_attention(q[:, 0], scheme, view, lengths, k[:, 0], v[:, 0],
                                     impl=attention_impl)[:, None].astype(q.dtype)
            else:
                a = attend(q, k, v, num_new, scheme.materialize_layer(view, lengths))
            x = _finish(cfg, x, lp, a, linear)
            return (x, ok & jnp.all(fin), gst), None

        (x, ok, g2), _ = jax.lax.scan(body, (x, ok, gstate), (lp_all, jnp.arange(n, dtype=jnp.int32)))
        new_groups.append(g2)
    logits = logits_from_hidden(params, cfg, x, linear)
    # Publish: lengths advance iff every valid row of every layer was finite and encodable; a rejected multi-row
    # append restores residual rings it may have wrapped (see kvquant_jax.cache.ops.publish).
    from kvquant_jax.cache.ops import publish

    return logits, publish(cache, tuple(new_groups), num_new, ok, multi_row=t > 1), ok


@functools.partial(jax.jit, static_argnames=("cfg", "attention_impl", "linear"), donate_argnames=("cache",))
def forward_jit(params, cfg, tokens, cache, num_new, attention_impl="reference", linear=None):
    """``forward`` under jit with the cache donated (updated in place); ``linear`` must be hashable (static)."""
    return forward(params, cfg, tokens, cache, num_new, attention_impl=attention_impl, linear=linear)
