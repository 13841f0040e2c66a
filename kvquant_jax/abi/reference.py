"""Decode-attention oracle: dequantize every region, then ONE softmax over all of them (design notes 0x03, 0x06C).

Two instances of the same arithmetic:

* :func:`decode_attention_reference`: float64 NumPy, the ground truth of the tests;
* :func:`decode_attention_jnp`: float32 ``jax.numpy``, jit-able, used inside the model (``impl="reference"``) and
  as the plain-JAX twin of the Pallas kernel (``pallas_kernels.decode_attention.decode_attention_reference``).

Both materialize each region's K/V in the working precision (which is what a kernel must avoid, and what an oracle
should do), mask rows outside ``[start, end)`` (their contents are unspecified and may be non-finite), append the
current token's exact ``k_new, v_new`` as one more key, and normalize once over the concatenation.  GQA: query
head ``h`` reads KV head ``h // (Hq // Hkv)``.  A sequence with no live key gets a zero output.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from kvquant_jax.abi.regions import KVOperand, Region, check_query

__all__ = ["decode_attention_reference", "decode_attention_jnp", "dequantize_operand", "unpack_codes"]


def unpack_codes(data, bits: int, xp=np):
    """uint8 ``[..., D*bits/8]`` -> integer codes ``[..., D]`` (element ``i`` at bit offset ``i*bits``)."""
    if bits == 8:
        return data
    per = 8 // bits
    shifts = xp.asarray(np.arange(per, dtype=np.uint8) * np.uint8(bits))
    u = (data[..., None] >> shifts) & xp.asarray(np.uint8(2 ** bits - 1))
    return u.reshape(data.shape[:-1] + (data.shape[-1] * per,))


def dequantize_operand(op: KVOperand, head_dim: int, xp=np, dtype=np.float64):
    """Decode one operand to ``[B, Hkv, N, D]`` in ``dtype`` (no masking)."""
    f = op.fmt
    if not f.is_int:
        x = xp.asarray(op.data).astype(dtype)
        if f.scale == "head":
            x = x * xp.asarray(op.scale).astype(dtype)[None, :, None, None]
        return x
    u = unpack_codes(xp.asarray(op.data), f.bits, xp).astype(dtype)
    s = xp.asarray(op.scale).astype(dtype)
    z = None if op.zero is None else xp.asarray(op.zero).astype(dtype)
    if f.scale == "head":       # static per-KV-head scale (symmetric)
        return (u - float(2 ** (f.bits - 1))) * s[None, :, None, None]
    if f.scale == "token":
        rep = head_dim // s.shape[-1]
        axis = 3
    else:  # channel: one row of scales per group of f.group tokens
        rep = f.group
        axis = 2
    s = xp.repeat(s, rep, axis=axis)
    z = None if z is None else xp.repeat(z, rep, axis=axis)
    if f.zero == "symmetric":
        return (u - float(2 ** (f.bits - 1))) * s
    if f.zero == "offset":
        return (u - z) * s
    return u * s + z  # "min"


def _einsum(xp, spec, a, b):
    if xp is np:
        return np.einsum(spec, a, b)
    return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST)


def _attend(q, regions: Sequence[Region], k_new, v_new, sm_scale, xp, dtype):
    b, hq, hkv, d = check_query(q, regions, k_new, v_new)
    g = hq // hkv
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)
    qf = xp.asarray(q).astype(dtype).reshape(b, hkv, g, d)
    logits, values = [], []
    neg_inf = -np.inf
    for r in regions:
        n = r.k.data.shape[2]
        k = dequantize_operand(r.k, d, xp, dtype)
        v = dequantize_operand(r.v, d, xp, dtype)
        rows = xp.asarray(np.arange(n, dtype=np.int32))[None, :]
        valid = (rows >= xp.asarray(r.start)[:, None]) & (rows < xp.asarray(r.end)[:, None])  # [B, N]
        vm = valid[:, None, :, None]
        k = xp.where(vm, k, 0.0)
        v = xp.where(vm, v, 0.0)
        s = _einsum(xp, "bhgd,bhnd->bhgn", qf, k) * scale
        logits.append(xp.where(valid[:, None, None, :], s, neg_inf))
        values.append(v)
    if k_new is not None:
        kn = xp.asarray(k_new).astype(dtype)
        logits.append(_einsum(xp, "bhgd,bhd->bhg", qf, kn)[..., None] * scale)
        values.append(xp.asarray(v_new).astype(dtype)[:, :, None, :])
    s = xp.concatenate(logits, axis=-1)                     # [B, Hkv, G, N_total]
    vals = xp.concatenate(values, axis=2)                   # [B, Hkv, N_total, D]
    m = xp.max(s, axis=-1, keepdims=True)
    live = m > neg_inf
    p = xp.where(live, xp.exp(s - xp.where(live, m, 0.0)), 0.0)
    den = xp.sum(p, axis=-1, keepdims=True)
    out = _einsum(xp, "bhgn,bhnd->bhgd", p, vals) / xp.where(den > 0, den, 1.0)
    return out.reshape(b, hq, d)


def decode_attention_reference(q, regions: Sequence[Region] = (), *, k_new=None, v_new=None,
                               sm_scale: float | None = None) -> np.ndarray:
    """float64 NumPy oracle.  ``q``: ``[B, Hq, D]``; returns float64 ``[B, Hq, D]``."""
    return _attend(q, list(regions), k_new, v_new, sm_scale, np, np.float64)


def decode_attention_jnp(q, regions: Sequence[Region] = (), *, k_new=None, v_new=None,
                         sm_scale: float | None = None, out_dtype=None):
    """float32 ``jax.numpy`` version of :func:`decode_attention_reference`; returns ``[B, Hq, D]`` in
    ``out_dtype`` (default ``q.dtype``)."""
    out = _attend(q, list(regions), k_new, v_new, sm_scale, jnp, jnp.float32)
    return out.astype(out_dtype or q.dtype)
