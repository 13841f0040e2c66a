"""The decoder (LLaMA, Gemma-3) as a pure function of (params, tokens, cache) -> (logits, cache', ok).

LLaMA and Gemma-3 are two configs of this one decoder (``kvquant_jax.models.config``): the layer is composed from
documented components -- norm convention, QK-norm, post-attention / post-MLP norms, SwiGLU or GeGLU, RoPE base per
layer type, attention window per layer (sliding-window "local" layers: a query at ``p`` sees keys ``p - W < s <=
p``), query scale, embedding scale, tied head, final logit soft-capping -- each a no-op at its LLaMA default.
Extra params of Gemma-3 layers: ``q_norm, k_norm [L, D]``, ``post_attn_norm, post_ffn_norm [L, H]``.  Functions
that depend on the layer's type take ``layer=`` (a Python int, or a traced int32 under ``lax.scan``); a config
whose layers all look alike (LLaMA) needs none.

Shapes: B batch, T tokens in this forward, H hidden, Hq query heads, Hkv KV heads, D head_dim, G = Hq // Hkv,
C cache capacity, V vocab.  Parameters are stacked on a leading layer axis (``params["layers"]`` a dict of
``[L, ...]`` arrays; the form calibration and evaluation use) or unstacked (a tuple of per-layer dicts, made by
:func:`unstack_layers`: the serving form).  Cache layer states come in groups (one per run of layers sharing a
scheme, or one per layer: ``init_cache(..., layer_groups="per_layer")``).  A stacked group over stacked params runs
under ``lax.scan``; every other combination is unrolled, so each layer reads its own weight and cache buffers in
place (on GPU a scan's per-layer dynamic slices of the stacked weights are materialized: a copy of every weight
matrix per step, measured in docs/results/serving).

Public layer API (what evaluation, calibration and serving build on): :func:`project_qkv`, :func:`attend`,
:func:`finish_layer` (output projection + MLP), :func:`decoder_layer`, :func:`logits_from_hidden`, :func:`matmul`,
:func:`dense` (the default ``linear`` hook), :func:`norm_linears`, :func:`layer_params`.

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

from kvquant_jax.attention.dispatch import decode_attention
from kvquant_jax.attention.sharded import local_layer
from kvquant_jax.cache.interface import KVCache
from kvquant_jax.cache.ops import publish
from kvquant_jax.quant.dtypes import float_dtype
from kvquant_jax.sharding import active_mesh, constrain_cache
from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.models.fixed_order import is_fixed_order, log_softmax as fixed_log_softmax, mean as fixed_mean
from kvquant_jax.models.prefill_attention import (ATTENTION_IMPLS, NEG_INF, attend, prefill_attention,  # noqa: F401
                                                   resolve_decode_impl, resolve_prefill_impl)
from kvquant_jax.models.rope import apply_rope



def cast_params(params: dict, dtype: str = "fp32") -> dict:
    """NumPy/JAX params -> jnp arrays in ``dtype`` (norm weights stay float32)."""
    dt = float_dtype(dtype)

    def cast(path, a):
        name = jax.tree_util.keystr(path)
        return jnp.asarray(a, jnp.float32 if "norm" in name else dt)

    return jax.tree_util.tree_map_with_path(cast, params)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0, *, fixed: bool = False) -> jax.Array:
    """RMSNorm in float32; returns x's dtype. x: [..., H], w: [H]; the multiplier is ``offset + w`` (Gemma's
    ``1 + w`` in transformers' weight convention; llama.cpp stores Gemma norms with the 1 already added).
    ``fixed``: the mean square by a fixed pairwise tree (``models.fixed_order.mean``: the same bits whatever the
    number of rows; XLA's row reduction rounds differently at different row counts)."""
    xf = x.astype(jnp.float32)
    ms = fixed_mean(xf * xf, axis=-1, keepdims=True) if fixed else jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(ms + jnp.float32(eps))
    wf = w.astype(jnp.float32)
    if offset:
        wf = wf + jnp.float32(offset)
    return (y * wf).astype(x.dtype)


def _norm(cfg: LlamaConfig, x, w):
    return rms_norm(x, w, cfg.rms_eps, cfg.norm_offset, fixed=is_fixed_order(cfg.activation))


def _norm_weight(cfg: LlamaConfig, w):
    """A norm weight as a plain multiplier (what ``norm_linears`` hooks such as W8A8's fused producer take)."""
    return w if not cfg.norm_offset else w.astype(jnp.float32) + jnp.float32(cfg.norm_offset)


def mlp_activation(cfg: LlamaConfig, gate):
    """The gated MLP's activation: SiLU (SwiGLU, LLaMA) or tanh-approximated GELU (GeGLU, Gemma)."""
    if cfg.mlp_activation == "gelu_tanh":
        return jax.nn.gelu(gate, approximate=True)
    return jax.nn.silu(gate)


def layer_rope_theta(cfg: LlamaConfig, layer):
    """RoPE base of ``layer`` (a Python int -> float; a traced index -> float32 scalar; None only for configs whose
    layers all share one base)."""
    if cfg.rope_theta_local is None or "local" not in cfg.layer_types:
        return cfg.rope_theta
    if layer is None:
        raise ValueError(f"{cfg.name}: layers have different RoPE bases (local {cfg.rope_theta_local}, global "
                         f"{cfg.rope_theta}); pass layer= to the layer functions")
    if isinstance(layer, int):
        return cfg.layer_rope_theta(layer)
    thetas = jnp.asarray([cfg.layer_rope_theta(i) for i in range(cfg.num_layers)], jnp.float32)
    return thetas[layer]


def layer_window(cfg: LlamaConfig, layer):
    """Attention window of ``layer``: 0 (unbounded) / W as a Python int for a static index, an int32 scalar (0 =
    unbounded) for a traced one."""
    if "local" not in cfg.layer_types:
        return 0
    if layer is None:
        raise ValueError(f"{cfg.name}: local and global layers differ; pass layer= to the layer functions")
    if isinstance(layer, int):
        return cfg.layer_window(layer)
    return jnp.asarray([cfg.layer_window(i) for i in range(cfg.num_layers)], jnp.int32)[layer]


def embed_tokens(params, cfg: LlamaConfig, tokens):
    """Embedding rows ``[B, T, H]`` of tokens int32 ``[B, T]`` times ``cfg.embed_scale`` (Gemma: sqrt(H))."""
    x = params["embed"][tokens]
    if cfg.embed_scale != 1.0:
        x = x * jnp.asarray(cfg.embed_scale, jnp.float32).astype(x.dtype)
    return x


def _precision(dtype):
    """float32 operands: HIGHEST (true float32 products: parity with float64 oracles and transformers); bf16 / fp16
    operands: DEFAULT (one tensor-core pass with float32 accumulation; HIGHEST would buy nothing)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def matmul(x, w):
    """``x [..., K] @ w [K, N]`` in x's dtype, precision by dtype (:func:`_precision`)."""
    return jnp.matmul(x, w.astype(x.dtype), precision=_precision(x.dtype))


def dense(x, w, name: str):
    """The default ``linear(x, w, name)`` hook: ``x [..., K] @ w [K, N]`` in x's dtype (``name`` is one of q, k, v,
    o, gate, up, down, lm_head; unused here). An activation policy (``kvquant_jax.models.w8a8``) replaces it."""
    del name
    return matmul(x, w)


def norm_linears(linear: Callable, x, norm_w, eps: float, projections) -> list:
    """``RMSNorm(x; norm_w, eps)`` followed by each ``(w, name)`` of ``projections`` (weights that read the same
    normalized activations: q/k/v, gate/up, the head). A ``linear`` hook with a ``norm_linears`` method (e.g.
    ``W8A8Policy``) receives the whole group, so it can fuse the norm into a single activation quantization shared
    by the group; any other hook gets ``linear(rms_norm(x), w, name)`` per projection."""
    group = getattr(linear, "norm_linears", None)
    if group is not None:
        return group(x, norm_w, eps, projections)
    h = rms_norm(x, norm_w, eps, fixed=is_fixed_order(linear))
    return [linear(h, w, name) for w, name in projections]


def project_qkv(cfg: LlamaConfig, x, lp, positions, linear: Callable | None = None, *, layer=None):
    """Projections of one layer: x ``[B, T, H]``, lp one layer's params, positions int32 ``[B, T]`` ->
    q ``[B, T, Hq, D]``, k, v ``[B, T, Hkv, D]`` in x's dtype (q, k post-RoPE; with ``cfg.qk_norm`` q and k are
    RMS-normalized over D before RoPE; a ``cfg.query_scale`` other than 1/sqrt(D) is folded into q, so attention
    always scales by 1/sqrt(D)).  ``linear(x, w, name)`` computes each projection (default ``cfg.activation`` or
    :func:`dense`); ``layer``: the layer index (needed when layers differ in RoPE base, see :func:`layer_rope_theta`)."""
    linear = linear or cfg.activation or dense
    b, t, _ = x.shape
    q, k, v = norm_linears(linear, x, _norm_weight(cfg, lp["attn_norm"]), cfg.rms_eps,
                           ((lp["wq"], "q"), (lp["wk"], "k"), (lp["wv"], "v")))
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = _norm(cfg, q, lp["q_norm"]), _norm(cfg, k, lp["k_norm"])
    if cfg.query_scale is not None and abs(cfg.query_scale * cfg.head_dim ** 0.5 - 1.0) > 1e-12:
        q = (q.astype(jnp.float32) * jnp.float32(cfg.query_scale * cfg.head_dim ** 0.5)).astype(q.dtype)
    theta = layer_rope_theta(cfg, layer)
    return (apply_rope(q, positions, theta, cfg.rope_pairing),
            apply_rope(k, positions, theta, cfg.rope_pairing), v)


def finish_layer(cfg: LlamaConfig, x, lp, a, linear: Callable | None = None):
    """Output projection + residual, then the gated MLP block: x ``[B, T, H]`` (the layer's input), a the attention
    output ``[B, T, Hq, D]`` -> the layer's output ``[B, T, H]``.  LLaMA: ``x + o(a)``, ``x + down(silu(gate) *
    up)`` on ``ffn_norm(x)``; Gemma-3 (``cfg.post_norms``): ``x + post_attn_norm(o(a))``, then ``x +
    post_ffn_norm(down(gelu(gate) * up))`` on ``ffn_norm(x)``."""
    linear = linear or cfg.activation or dense
    b, t, _ = x.shape
    o = linear(a.reshape(b, t, cfg.num_heads * cfg.head_dim), lp["wo"], "o")
    x = x + (_norm(cfg, o, lp["post_attn_norm"]) if cfg.post_norms else o)
    gate, up = norm_linears(linear, x, _norm_weight(cfg, lp["ffn_norm"]), cfg.rms_eps,
                            ((lp["w_gate"], "gate"), (lp["w_up"], "up")))
    m = linear(mlp_activation(cfg, gate) * up, lp["w_down"], "down")
    return x + (_norm(cfg, m, lp["post_ffn_norm"]) if cfg.post_norms else m)


def decoder_layer(cfg: LlamaConfig, x, lp, positions, attn_fn: Callable, linear: Callable | None = None, *,
                  layer=None):
    """One decoder layer. ``attn_fn(q, k, v) -> [B, T, Hq, D]`` (it applies the layer's window, see
    :func:`layer_window`). Returns (x', k, v) (this forward's exact K/V)."""
    q, k, v = project_qkv(cfg, x, lp, positions, linear, layer=layer)
    return finish_layer(cfg, x, lp, attn_fn(q, k, v), linear), k, v


def is_unstacked(params: dict) -> bool:
    """True for the serving form: ``params["layers"]`` a tuple (or list) of per-layer pytrees."""
    return isinstance(params["layers"], (tuple, list))


def unstack_layers(params: dict) -> dict:
    """Stacked ``params["layers"]`` (dict of ``[L, ...]`` arrays, or any pytree such as W8A8 ``QuantLinear``) ->
    a tuple of ``L`` per-layer pytrees: the serving form (each layer's weights are separate buffers, read in place
    by the unrolled forward). Already unstacked params are returned as they are."""
    if is_unstacked(params):
        return params
    layers = params["layers"]
    n = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n))}


def stack_layers(params: dict) -> dict:
    """The inverse of :func:`unstack_layers` (stacked params are returned as they are)."""
    if not is_unstacked(params):
        return params
    return {**params, "layers": jax.tree.map(lambda *a: jnp.stack(a), *params["layers"])}


def num_param_layers(params: dict) -> int:
    layers = params["layers"]
    return len(layers) if is_unstacked(params) else jax.tree.leaves(layers)[0].shape[0]


def layer_params(params: dict, layer: int):
    """One layer's params (a static index into stacked or unstacked params)."""
    if is_unstacked(params):
        return params["layers"][layer]
    return jax.tree.map(lambda a: a[layer], params["layers"])


def logits_from_hidden(params, cfg: LlamaConfig, x, linear: Callable | None = None):
    """Final norm + output head -> float32 logits. A quantized head (``params["lm_head_q"]``, made only when an
    activation policy names ``lm_head``) goes through ``linear``; otherwise the float head as before."""
    linear = linear or cfg.activation or dense
    if "lm_head_q" in params:
        logits = norm_linears(linear, x, _norm_weight(cfg, params["final_norm"]), cfg.rms_eps,
                              ((params["lm_head_q"], "lm_head"),))[0].astype(jnp.float32)
    else:
        x = _norm(cfg, x, params["final_norm"])
        if is_fixed_order(linear):                       # fixed-order numerics: the head is one of its projections
            w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
            logits = linear(x, w, "lm_head").astype(jnp.float32)
        elif cfg.tie_embeddings:
            logits = jnp.einsum("bth,vh->btv", x, params["embed"].astype(x.dtype),
                                precision=_precision(x.dtype)).astype(jnp.float32)
        else:
            logits = matmul(x, params["lm_head"]).astype(jnp.float32)
    if cfg.final_logit_softcap:
        c = jnp.float32(cfg.final_logit_softcap)
        logits = c * jnp.tanh(logits / c)
    return logits


def window_served(scheme, window) -> bool:
    """Can ``attention.dispatch.decode_attention`` serve a layer with attention ``window`` from this scheme's
    regions?  Always for unbounded layers; for a local layer only when the scheme is a sliding-window ring of that
    window (its regions hold exactly the window's rows), otherwise the model masks the materialized history."""
    return not window or getattr(scheme, "window", 0) == window


def check_layer_window(cfg: LlamaConfig, scheme, layer, window) -> None:
    """Trace-time guard: a sliding-window ring cache must sit on a local layer of exactly its window (a global
    layer, or a wider window, would need rows the ring has dropped)."""
    ring = getattr(scheme, "window", 0)
    if ring and ring != window:
        where = f"layer {layer}" if isinstance(layer, int) else "a layer"
        raise ValueError(f"{cfg.name}: {where} has attention window {window or 'unbounded'} but its cache keeps only "
                         f"the last {ring} rows (use kvquant_jax.models.cache_layout.layer_schemes)")


def history_positions(scheme, lengths, capacity: int):
    """int32 ``[B, C]``: the position each materialized history row holds (``scheme.row_positions`` for a ring
    that stores rows out of order, row ``i`` = position ``i`` otherwise)."""
    rows = getattr(scheme, "row_positions", None)
    if rows is not None:
        return rows(lengths)
    return jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (lengths.shape[0], capacity))


def token_nll(logits: jax.Array, tokens: jax.Array, *, fixed: bool = False) -> jax.Array:
    """Per-position NLL float32 [B, T-1] of tokens[:, 1:] under logits[:, :-1] (``fixed``: the fixed-order
    log-softmax, ``models.fixed_order.log_softmax``)."""
    lf = logits[:, :-1].astype(jnp.float32)
    lp = fixed_log_softmax(lf, axis=-1) if fixed else jax.nn.log_softmax(lf, axis=-1)
    return -jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]


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
    x = embed_tokens(params, cfg, tokens)
    fixed = is_fixed_order(linear)

    def layer(x, lp, i):
        window = layer_window(cfg, i)
        x, _, _ = decoder_layer(cfg, x, lp, positions,
                                lambda q, k, v: attend(q, k, v, num_new, None, window=window, fixed_order=fixed),
                                linear, layer=i)
        return x

    if is_unstacked(params):
        for i, lp in enumerate(params["layers"]):
            x = layer(x, lp, i)
    else:
        n = num_param_layers(params)
        x, _ = jax.lax.scan(lambda x, inp: (layer(x, *inp), None), x,
                            (params["layers"], jnp.arange(n, dtype=jnp.int32)))
    return logits_from_hidden(params, cfg, x, linear)


def forward(params, cfg: LlamaConfig, tokens: jax.Array, cache: KVCache, num_new: jax.Array | None = None,
            *, attention_impl: str = "auto", linear: Callable | None = None, logits_at: jax.Array | None = None
            ) -> tuple[jax.Array, KVCache, jax.Array]:
    """Forward ``tokens`` (int32 [B, T]) at positions ``cache.lengths + t`` and append them to the cache.

    ``cache``: a :class:`KVCache`, or a cache value that owns its per-layer append + attention through a
    ``layer_step(group, group_state, i, attn, q, k, v, num_new, *, decode_impl) -> (group_state', ok [B],
    out [B, T, Hq, D])`` method (``attention.paged.PagedStep``: the paged cache read and written through its page
    table); it must also carry ``schemes``, ``groups``, ``lengths``, ``capacity`` and ``replace`` like a KVCache.

    Args:
      num_new: int32 [B]: valid tokens per sequence (right padding beyond); default all T.
      attention_impl: "reference" (decode the stored history, one float32 softmax in JAX, every phase), "kernel"
        (decode steps, T == 1, go through ``kvquant_jax.attention.dispatch.decode_attention``, which reads packed
        codes in place; prefill, T > 1, through cuDNN flash attention on GPU for bf16/fp16 models, the float32
        reference for float32 ones) or "auto" (the default: "kernel" on GPU/TPU where a kernel serves the layout,
        the float32 reference on CPU, so CPU results are unchanged).
      linear: optional ``linear(x, w, name)`` projection hook (None = float); a hashable policy object (e.g.
        ``kvquant_jax.models.w8a8.W8A8Policy``) so it can be a static jit argument. The hook sees ``x [B, T, K]``,
        so it can specialise on the phase (prefill T > 1, decode T == 1).
      logits_at: optional int32 [B]: the one position per sequence whose logits are wanted (e.g. its last valid
        token): the hidden state is gathered there BEFORE the final norm and LM head, so a long prefill never
        holds ``[B, T, V]`` logits (at B = 20, T = 8000 and a 49K vocabulary that is 31 GB); logits are then
        ``[B, 1, V]``.
    Returns:
      logits float32 [B, T, V] (``[B, 1, V]`` with ``logits_at``); the successor cache; ok: bool scalar. ``ok``
      is False when any K/V row of any layer is non-finite: then ``lengths`` are NOT advanced (nothing is
      published) and the caller must raise.
    """
    b, t = tokens.shape
    linear = linear or cfg.activation or dense
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
    if num_new is None:
        num_new = jnp.full((b,), t, jnp.int32)
    if num_param_layers(params) != cache.num_layers:
        raise ValueError(f"params hold {num_param_layers(params)} layers, the cache {cache.num_layers}")
    lengths = cache.lengths
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    fixed = is_fixed_order(linear)
    # fixed-order numerics: the float32 reference attention in every phase, batch-major (models/fixed_order.py)
    prefill_impl = "reference" if fixed else resolve_prefill_impl(attention_impl, dtype=params["embed"].dtype)
    decode_impl = "reference" if fixed else resolve_decode_impl(attention_impl)
    x = embed_tokens(params, cfg, tokens)
    new_groups = []
    ok = jnp.bool_(True)
    unstacked = is_unstacked(params)
    on_mesh = active_mesh() is not None
    # a cache type that owns its per-layer append + attention (attention/paged.PagedStep: the paged-direct
    # forward) provides ``layer_step``; the contiguous KVCache uses the code below (one path, no family switch)
    layer_step = getattr(cache, "layer_step", None)
    for gi, ((scheme, first, n), gstate) in enumerate(zip(cache.schemes, cache.groups)):

        # layers of one group share the scheme; when they also share the layer type (RoPE base, window), the group
        # runs under lax.scan with that type as static facts (``kind``: a representative layer index)
        same_type = len({cfg.layer_rope_theta(first + j) for j in range(n)}) == 1 and \
            len({cfg.layer_window(first + j) for j in range(n)}) == 1
        scan = not (unstacked or n == 1 or not same_type)

        def body(carry, inp, scheme=scheme, first=first, scan=scan, gi=gi):
            # The group state rides in the carry. The append is written first (dynamic_update_slice of this layer's
            # slice) and attention then reads the UPDATED state at the OLD lengths: by the frontier rule that view
            # equals the old state's, and with no reader of the pre-append buffer left XLA updates the donated cache
            # in place (no per-step copy of the cache). ``i`` is a traced index under the scan, a Python int when
            # unrolled (then every slice is static; for one-layer groups a bitcast).
            x, ok, gst = carry
            lp, i = inp
            layer = first if scan else first + i                  # static: the group's layer type under the scan
            q, k, v = project_qkv(cfg, x, lp, positions, linear, layer=layer)
            window = layer_window(cfg, layer)
            check_layer_window(cfg, scheme, layer, window)

            def attn(q, k, v, view, lengths, num_new, scheme=scheme, window=window):
                if decode_impl != "reference" and t == 1 and window_served(scheme, window):
                    return decode_attention(q[:, 0], scheme, view, lengths, k[:, 0], v[:, 0],
                                            impl=decode_impl)[:, None].astype(q.dtype)
                if window:
                    return attend(q, k, v, num_new, scheme.materialize_layer(view, lengths), window=window,
                                  q_start=lengths, hist_pos=history_positions(scheme, lengths, cache.capacity),
                                  fixed_order=fixed)
                return prefill_attention(q, k, v, num_new, scheme.materialize_layer(view, lengths),
                                         impl=prefill_impl, fixed_order=fixed)

            if layer_step is not None:
                gst, fin, a = layer_step(gi, gst, i, attn, q, k, v, num_new, decode_impl=decode_impl)
                x = finish_layer(cfg, x, lp, a, linear)
                return (x, ok & jnp.all(fin), gst), None
            st = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), gst)
            if on_mesh:   # append + attention per device on its sequences and KV heads (attention/sharded.py)
                st2, fin, a = local_layer(attn, scheme, q, k, v, st, lengths, num_new)
            else:
                st2, fin = scheme.append_layer_with_status(st, lengths, k, v, num_new)
            gst = jax.tree.map(lambda a, u: jax.lax.dynamic_update_index_in_dim(a, u.astype(a.dtype), i, 0), gst, st2)
            if not on_mesh:
                if scheme.append_keeps_old_view(t):
                    view = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), gst)
                else:  # a long append may wrap residual rings onto slots still visible at the old lengths
                    view = st
                a = attn(q, k, v, view, lengths, num_new)
            x = finish_layer(cfg, x, lp, a, linear)
            return (x, ok & jnp.all(fin), gst), None

        if not scan:          # unrolled: static per-layer slices of params and cache
            carry = (x, ok, gstate)
            for j in range(n):
                carry, _ = body(carry, (layer_params(params, first + j), j))
            x, ok, g2 = carry
        else:
            lp_all = jax.tree.map(lambda a: a[first:first + n], params["layers"])
            (x, ok, g2), _ = jax.lax.scan(body, (x, ok, gstate), (lp_all, jnp.arange(n, dtype=jnp.int32)))
        new_groups.append(g2)
    if logits_at is not None:
        x = jnp.take_along_axis(x, jnp.clip(logits_at, 0, t - 1).astype(jnp.int32)[:, None, None], axis=1)
    logits = logits_from_hidden(params, cfg, x, linear)
    # Publish: lengths advance iff every valid row of every layer was finite and encodable; a rejected multi-row
    # append restores residual rings it may have wrapped (see kvquant_jax.cache.ops.publish).
    # Under a mesh (kvquant_jax.sharding.mesh_context) the successor cache keeps its sharded layout.
    return logits, constrain_cache(publish(cache, tuple(new_groups), num_new, ok, multi_row=t > 1)), ok


@functools.partial(jax.jit, static_argnames=("cfg", "attention_impl", "linear"), donate_argnames=("cache",))
def forward_jit(params, cfg, tokens, cache, num_new, attention_impl="auto", linear=None):
    """``forward`` under jit with the cache donated (updated in place); ``linear`` must be hashable (static)."""
    return forward(params, cfg, tokens, cache, num_new, attention_impl=attention_impl, linear=linear)
