"""Decode attention for one layer of a cache scheme: adapt the layer state to kernel regions, pick kernel or reference.

``decode_attention(q, scheme, layer_state, lengths, k_new, v_new)`` is what the model's decode step calls.  The
layer state is read in place (docs/architecture.md, "Physical layouts"); every region boundary is derived from
``lengths`` with the scheme's own frontier functions:

* ``full`` / ``fp8`` / ``per_token`` / ``static_int`` / ``qserve``: one region, rows ``[0, len)``.
* ``prefix`` (IntactKV / PrefixQuant rows): the body scheme's regions at ``lengths - P`` plus the ``P`` immutable
  full-precision prefix rows as a small dense region (attended in plain JAX, same softmax).
* ``kivi``: the quantized region ``[0, min(fk, fv))`` (K per-channel groups, V per-token) read by the kernel, plus a
  small dense *tail* ``[min(fk, fv), len)`` (at most ``max(S_k, S_v)`` rows) gathered from the residual rings and,
  for positions whose K is already closed but whose V is still in the rolling tail (``[fv, fk)`` under the
  official rule), decoded from the K codes.  The tail is attended in plain JAX and merged into the same softmax.
* any other scheme: its ``materialize_layer`` output as one float32 region (reference only).

The current token's exact ``k_new, v_new`` join the same softmax.  ``impl``: ``"kernel"`` (Pallas; interpreted on
CPU), ``"reference"`` (float32 JAX, :func:`kvquant_jax.attention.reference.decode_attention_jnp`) or ``"auto"``:
the kernel on GPU/TPU when it supports the regions, the reference otherwise (including on CPU, where the Pallas
interpreter would be slow).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvquant_jax.attention.reference import decode_attention_jnp, dequantize_operand
from kvquant_jax.attention.regions import KVFormat, KVOperand, Region, dense_operand, region
from pallas_kernels import decode_attention as kernel
from pallas_kernels.backend import platform

__all__ = ["decode_attention", "layer_regions", "IMPLS"]

IMPLS = ("auto", "kernel", "reference")


def _rows_at(arr, idx):
    """``arr [B, H, N, X]`` rows ``idx [B, T]`` (per sequence) -> ``[B, H, T, X]``."""
    return jnp.take_along_axis(arr, idx[:, None, :, None], axis=2)


def _kivi_regions(scheme, st, lengths) -> tuple[list[Region], int]:
    g = scheme.group_size
    cap = st.k_codes.shape[2]
    d = st.k_res.shape[-1]
    s_k, s_v = scheme.ring_sizes
    fk, fv = scheme.frontiers(lengths)
    lo = jnp.minimum(fk, fv)
    kq = KVFormat(f"int{scheme.k_bits}", "channel", "min", g)
    vq = KVFormat(f"int{scheme.v_bits}", "token", "min", scheme.v_group_size)
    rows = (cap // g) * g
    k_codes, v_codes, v_scale, v_min = st.k_codes, st.v_codes, st.v_scale, st.v_min
    if rows != cap:   # capacity % G: the last partial group never closes; keep whole groups only
        k_codes, v_codes = k_codes[:, :, :rows], v_codes[:, :, :rows]
        v_scale, v_min = v_scale[:, :, :rows], v_min[:, :, :rows]
    main = Region(k=KVOperand(k_codes, st.k_scale, st.k_min, kq), v=KVOperand(v_codes, v_scale, v_min, vq),
                  start=jnp.zeros_like(lo), end=lo)

    nt = max(s_k, s_v, 1)
    pos = lo[:, None] + jnp.arange(nt, dtype=jnp.int32)[None, :]                     # [B, Nt]
    row = jnp.minimum(pos, cap - 1)
    grp = jnp.minimum(pos // g, st.k_scale.shape[2] - 1)
    k_codes_t = KVOperand(_rows_at(st.k_codes, row), _rows_at(st.k_scale, grp), _rows_at(st.k_min, grp),
                          KVFormat(kq.payload, "channel", "min", 1))
    v_codes_t = KVOperand(_rows_at(st.v_codes, row), _rows_at(st.v_scale, row), _rows_at(st.v_min, row), vq)
    k_t = dequantize_operand(k_codes_t, d, jnp, jnp.float32)
    v_t = dequantize_operand(v_codes_t, d, jnp, jnp.float32)
    if s_k:
        k_t = jnp.where((pos >= fk[:, None])[:, None, :, None], _rows_at(st.k_res, pos % s_k).astype(jnp.float32),
                        k_t)
    if s_v:
        v_t = jnp.where((pos >= fv[:, None])[:, None, :, None], _rows_at(st.v_res, pos % s_v).astype(jnp.float32),
                        v_t)
    tail = region(dense_operand(k_t), dense_operand(v_t), lengths - lo)
    return [main, tail], nt


def layer_regions(scheme, layer_state, lengths) -> tuple[list[Region], int]:
    """Regions of one layer at committed ``lengths`` plus the row count of its small dense tail (0: none)."""
    fam = getattr(scheme, "family", "") or scheme.schema.scheme
    if getattr(scheme, "key_stage", "post_rope") != "post_rope":
        raise ValueError("decode_attention reads post-RoPE keys; a pre-RoPE cache needs the model to rotate the "
                         "decoded keys (use the materialize path)")
    st = layer_state
    lengths = lengths.astype(jnp.int32)
    if fam == "full":
        return [region(dense_operand(st.k), dense_operand(st.v), lengths)], 0
    if fam == "fp8":
        f = KVFormat(scheme.fmt, "head")
        return [region(KVOperand(st.k, st.k_scale, None, f), KVOperand(st.v, st.v_scale, None, f), lengths)], 0
    if fam in ("per_token", "per_token_any") and scheme.bits in (1, 2, 4, 8):
        f = KVFormat(f"int{scheme.bits}", "token", "symmetric", scheme.group_size)
        return [region(KVOperand(st.k_codes, st.k_scale, None, f), KVOperand(st.v_codes, st.v_scale, None, f),
                       lengths)], 0
    if fam == "static_int" and scheme.bits in (1, 2, 4, 8):
        f = KVFormat(f"int{scheme.bits}", "head", "symmetric")
        return [region(KVOperand(st.k_codes, st.k_scale, None, f), KVOperand(st.v_codes, st.v_scale, None, f),
                       lengths)], 0
    if fam == "prefix":            # immutable full-precision prefix rows + any body scheme at lengths - P
        from kvquant_jax.cache.prefix import split_state

        pk, pv, body = split_state(st)
        b = lengths.shape[0]
        full = (b,) + pk.shape[1:]
        sink = region(dense_operand(jnp.broadcast_to(pk, full)), dense_operand(jnp.broadcast_to(pv, full)),
                      jnp.minimum(lengths, scheme.prefix_len))
        body_regions, tail_rows = layer_regions(scheme.body, body, scheme.body_lengths(lengths))
        return body_regions + [sink], max(tail_rows, scheme.prefix_len)
    if fam == "qserve":
        f = KVFormat("int4", "token", "offset")
        return [region(KVOperand(st.k_codes, st.k_scale[..., None], st.k_offset[..., None], f),
                       KVOperand(st.v_codes, st.v_scale[..., None], st.v_offset[..., None], f), lengths)], 0
    if fam == "kivi":
        return _kivi_regions(scheme, st, lengths)
    k, v, _ = scheme.materialize_layer(st, lengths)
    return [region(dense_operand(k), dense_operand(v), lengths)], 0


def decode_attention(q: jax.Array, scheme, layer_state, lengths: jax.Array, k_new: jax.Array | None = None,
                     v_new: jax.Array | None = None, *, impl: str = "auto", interpret: Any = None,
                     backend: str | None = None, config=None, sm_scale: float | None = None,
                     out_dtype=None) -> jax.Array:
    """One decode step's attention for one layer: ``q [B, Hq, D]`` over the cached history and the exact current
    token (``k_new, v_new: [B, Hkv, D]``), one softmax.  Returns ``[B, Hq, D]`` in ``out_dtype`` (default
    ``q.dtype``).

    ``config``: a :class:`pallas_kernels.decode_attention.KernelConfig` for the kernel path (None: defaults).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    regions, tail_rows = layer_regions(scheme, layer_state, lengths)
    d = q.shape[-1]
    if impl == "auto":
        plat = platform()
        ok = plat in ("gpu", "tpu") and not kernel.kernel_unsupported(regions[0], d, "tpu" if plat == "tpu" else "gpu")
        impl = "kernel" if ok else "reference"
    if impl == "reference":
        return decode_attention_jnp(q, regions, k_new=k_new, v_new=v_new, sm_scale=sm_scale, out_dtype=out_dtype)
    return kernel.decode_attention(q, regions, k_new=k_new, v_new=v_new, sm_scale=sm_scale, backend=backend,
                                   interpret=interpret, config=config, small_rows=tail_rows, out_dtype=out_dtype)
