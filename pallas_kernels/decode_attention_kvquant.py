"""Pallas decode attention over a KVQuant layer: LUT decode, sparse correction and RoPE inside the kernel.

One new query token per sequence (``q: [B, Hq, D]``, already rotated at its own position by the model) attends
over a :mod:`kvquant_jax.cache.kvquant` layer state read where it lies, plus the exact current token
(``k_new, v_new: [B, Hkv, D]``), under ONE softmax (design notes 0x07B pseudocode, 0x07F):

    for each cached row n in [sink, length):
        k_n  = codebook_k[code] * scale_c + zero_c           (LUT decode, calibrated per-channel state)
        k_n  = where(c is a kept outlier, sparse value, k_n)  (exact holes + full values)
        k_n  = R_{pos[n]} k_n                                  (RoPE at the row's STORED position, in-kernel)
        s_n  = q . k_n * sm_scale
        v_n  = where(outlier, sparse value, codebook_v[code] * v_scale_n + v_offset_n)
    online softmax over the rows; the full-precision sink rows (rotated at their positions) and the current token
    are merged into the same normalization outside the kernel (split-K style partials ``(acc, m, l)``).

No decoded key or value is written to memory: each block of ``block_t`` rows is unpacked, looked up, corrected,
rotated and consumed in registers.

Channel order inside the kernel (why no register interleave is needed).  The packed stream holds 8 codes in every
``b`` bytes (kvquant_jax.quant.packing, ``b`` = bits <= 4), so byte ``kk`` of chunk ``J`` sits at column
``b*J + kk``: one strided load per byte position, ``w = sum_kk byte_kk << 8 kk``, and code ``r`` of the chunk is
``(w >> b r) & (2^b - 1)``, channel ``8 J + r``.  The kernel keeps every tile as ``[rows, 2, 8, D/16]`` =
(row, half, r, j), i.e. channel ``half * D/2 + 8 j + r`` -- a fixed permutation of the channels.  Under the
``half_split`` RoPE pairing channel ``c`` rotates with ``c + D/2``: index ``(0, r, j)`` with ``(1, r, j)``; under
``interleaved`` (``2i`` with ``2i + 1``) ``(h, 2m, j)`` with ``(h, 2m + 1, j)``: both are elementwise between two
slices of the tile.  A dot product does not care about the channel order, so the wrapper hands the query in the
same permuted order, the QK dot and the PV product run on ``[rows, D]`` reshapes of the tiles, and the wrapper
un-permutes the output.  Sparse outliers are matched against each tile position's channel number (a compare +
select per slot).  The LUT is a select tree over the code bits (``2^b - 1`` selects), a gather-free form.

Backend: the Pallas Triton-style loop kernel (grid ``(B, Hkv, num_splits)``, a ``fori_loop`` over blocks), run
with ``interpret=True`` where no GPU exists (:func:`pallas_kernels.backend.default_interpret`); validated in the
interpreter against a float64 NumPy oracle (tests/kernels/test_decode_attention_kvquant.py).
:func:`decode_attention_kvquant_reference` is the plain-JAX twin (materialize the layer, one softmax).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kvquant_jax.cache.kvquant import KVQuantScheme
from kvquant_jax.models.rope import apply_rope
from pallas_kernels.backend import default_interpret

__all__ = ["decode_attention_kvquant", "decode_attention_kvquant_reference", "channel_subplanes"]

_F32 = jnp.float32
_NEG = -1e30
_HP = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class _Spec:
    d: int
    mp: int             # padded query rows per KV head
    bt: int             # rows per block
    ns: int             # splits
    kb: int
    vb: int
    ck: int             # key sparse slots per row
    cv: int             # value sparse slots per row
    rope: str           # "half_split" | "interleaved" | "none" (post-RoPE keys)

    @property
    def w(self):        # j extent of a [rows, 2, 8, D/16] tile
        return self.d // 16


def channel_subplanes(d: int) -> np.ndarray:
    """int ``[2, 8, D/16]``: the channel at tile index ``(half, r, j)`` = ``half*D/2 + 8 j + r`` (the kernel's
    channel permutation)."""
    if d % 16:
        raise ValueError(f"decode_attention_kvquant: head_dim must be a multiple of 16, got {d}")
    j = np.arange(d // 16)
    return np.array([[h * (d // 2) + 8 * j + r for r in range(8)] for h in range(2)])


# --------------------------------------------------------------------------------------------------------------
# kernel body: tiles are [bt, 2, 8, D/16] = (row, half, r, j), i.e. channel half*D/2 + 8 j + r
# --------------------------------------------------------------------------------------------------------------
def _lut(code, cb_ref, bits: int):
    """``codebook[code]`` as a select tree over the code bits (``2^b - 1`` selects, no gather)."""
    vals = [jnp.full(code.shape, cb_ref[e], _F32) for e in range(2 ** bits)]
    for bit in range(bits):
        sel = ((code >> bit) & 1) == 1
        vals = [jnp.where(sel, vals[2 * i + 1], vals[2 * i]) for i in range(len(vals) // 2)]
    return vals[0]


def _decode_tile(codes_ref, lead, rows, bits: int, cb_ref, sp: _Spec):
    """Packed codes of ``rows`` -> float32 codebook values ``[bt, 2, 8, D/16]`` (sub-plane order).

    8 codes fill ``bits`` bytes, so byte ``kk`` of every chunk is one strided load; the chunk word
    ``w = sum_kk byte_kk << 8 kk`` holds code ``r`` of the chunk at bit ``bits * r``."""
    w = None
    for kk in range(bits):
        byte = codes_ref[lead + (rows, pl.ds(kk, sp.d // 8, stride=bits))].astype(jnp.int32) << (8 * kk)
        w = byte if w is None else w | byte
    shifts = bits * lax.broadcasted_iota(jnp.int32, (1, 1, 8, 1), 2)
    code = (w.reshape(sp.bt, 2, 1, sp.w) >> shifts) & (2 ** bits - 1)
    return _lut(code, cb_ref, bits)


def _apply_sparse(x, idx_ref, val_ref, lead, rows, slots: int, chan):
    """Exact holes + full values: replace the kept outlier channels of ``x [bt, 2, 8, D/16]``."""
    for s in range(slots):
        idx = idx_ref[lead + (rows, pl.ds(s, 1))].astype(jnp.int32).reshape(-1, 1, 1, 1)   # 255 = unused
        val = val_ref[lead + (rows, pl.ds(s, 1))].astype(_F32).reshape(-1, 1, 1, 1)
        x = jnp.where(idx == chan, val, x)
    return x


def _rotate(x, ang, sp: _Spec):
    """RoPE of ``x [bt, 2, 8, D/16]``; ``ang``: angles of each column's pair, same shape."""
    if sp.rope == "none":
        return x
    c, s = jnp.cos(ang), jnp.sin(ang)
    if sp.rope == "half_split":                  # channel c pairs with c + D/2: half 0 with half 1
        a, b = x[:, 0], x[:, 1]
        return jnp.stack([a * c[:, 0] - b * s[:, 0], b * c[:, 0] + a * s[:, 0]], axis=1)
    a, b = x[:, :, 0::2], x[:, :, 1::2]          # interleaved: r = 2m pairs with r = 2m + 1
    ce, se = c[:, :, 0::2], s[:, :, 0::2]
    out = jnp.stack([a * ce - b * se, b * ce + a * se], axis=3)                    # [bt, 2, 4, 2, w]
    return out.reshape(x.shape)


def _kernel(start_ref, end_ref, q_ref, kc_ref, kcb_ref, ks_ref, kz_ref, ki_ref, kv_ref, vc_ref, vcb_ref,
            vs_ref, vo_ref, vi_ref, vv_ref, pos_ref, freq_ref, o_ref, m_ref, l_ref, *, sp: _Spec):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = start_ref[b], end_ref[b]
    bt = jnp.int32(sp.bt)
    first = lax.div(start, bt)
    last = lax.div(end + bt - 1, bt)
    per = lax.div(jnp.maximum(last - first, 0) + sp.ns - 1, sp.ns)
    lo = first + s * per
    hi = jnp.minimum(lo + per, last)
    lead = (b, h)
    q = q_ref[b, h]                                                                  # [Mp, D] sub-plane order
    ks, kz = ks_ref[h][None], kz_ref[h][None]                                        # [1, 2, 8, w]
    freq = freq_ref[...][None]
    chan = (lax.broadcasted_iota(jnp.int32, (1, 2, 8, sp.w), 1) * (sp.d // 2)
            + 8 * lax.broadcasted_iota(jnp.int32, (1, 2, 8, sp.w), 3)
            + lax.broadcasted_iota(jnp.int32, (1, 2, 8, sp.w), 2))

    def body(blk, carry):
        m, l, acc = carry
        row0 = blk * sp.bt
        rows = pl.ds(row0, sp.bt)
        posn = row0 + lax.broadcasted_iota(jnp.int32, (sp.bt, 1), 0)
        valid_col = (posn >= start) & (posn < end)                                  # [bt, 1]
        valid_row = jnp.reshape(valid_col, (1, sp.bt))
        # keys: LUT decode -> per-channel scale/zero -> sparse -> RoPE at the stored position -> one dot
        k = _decode_tile(kc_ref, lead, rows, sp.kb, kcb_ref, sp) * ks + kz
        k = _apply_sparse(k, ki_ref, kv_ref, lead, rows, sp.ck, chan)
        p_row = pos_ref[b, rows].astype(_F32).reshape(sp.bt, 1, 1, 1)
        k = _rotate(k, p_row * freq, sp).reshape(sp.bt, sp.d)
        sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HP, preferred_element_type=_F32)
        sc = jnp.where(valid_row, sc, _NEG)                                          # [Mp, bt]
        m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid_row, jnp.exp(sc - m_new), 0.0)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        # values: LUT decode -> per-row scale/offset -> sparse -> PV
        vs = vs_ref[lead + (rows, pl.ds(0, 1))].astype(_F32).reshape(sp.bt, 1, 1, 1)
        vo = vo_ref[lead + (rows, pl.ds(0, 1))].astype(_F32).reshape(sp.bt, 1, 1, 1)
        v = _decode_tile(vc_ref, lead, rows, sp.vb, vcb_ref, sp) * vs + vo
        v = _apply_sparse(v, vi_ref, vv_ref, lead, rows, sp.cv, chan).reshape(sp.bt, sp.d)
        v = jnp.where(valid_col, v, 0.0)                                             # unspecified rows: 0
        pv = lax.dot_general(p, v, (((1,), (0,)), ((), ())), precision=_HP, preferred_element_type=_F32)
        return m_new, l, acc * alpha + pv

    init = (jnp.full((sp.mp, 1), _NEG, _F32), jnp.zeros((sp.mp, 1), _F32), jnp.zeros((sp.mp, sp.d), _F32))
    m, l, acc = lax.fori_loop(lo, hi, body, init)
    o_ref[b, h, s] = acc
    m_ref[b, h, s] = m
    l_ref[b, h, s] = l


# --------------------------------------------------------------------------------------------------------------
# wrapper
# --------------------------------------------------------------------------------------------------------------
def _subplanes(x, d):
    """``[..., D]`` -> ``[..., 2, 8, D/16]`` in the kernel's channel order (see :func:`channel_subplanes`)."""
    return jnp.swapaxes(x.reshape(x.shape[:-1] + (2, d // 16, 8)), -1, -2)


def _from_subplanes(x, d):
    return jnp.swapaxes(x, -1, -2).reshape(x.shape[:-3] + (d,))


def _inv_freq(d: int, theta: float, pairing: str):
    """float32 ``[D]``: the RoPE frequency of the pair each channel belongs to (the model's formula)."""
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / jnp.float32(d)))     # [D/2], pair i
    if pairing == "half_split":
        return jnp.concatenate([inv, inv])
    return jnp.repeat(inv, 2)


def _pick_block(rows: int, want: int) -> int:
    bt = 1 << max(int(want).bit_length() - 1, 0)
    while rows % bt:
        bt //= 2
    return bt


def _combine(parts):
    """Merge partials ``(acc [B,Hkv,S,G,D], m [B,Hkv,S,G], l)`` into normalized outputs ``[B, Hkv, G, D]``."""
    acc = jnp.concatenate([p[0] for p in parts], axis=2)
    m = jnp.concatenate([p[1] for p in parts], axis=2)
    l = jnp.concatenate([p[2] for p in parts], axis=2)
    w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))
    den = jnp.sum(w * l, axis=2)
    num = jnp.sum(w[..., None] * acc, axis=2)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def _dense_partial(q4, k, v, valid):
    """Partial ``(acc, m, l)`` of a small dense key set ``k, v [B, Hkv, N, D]`` (valid ``[B, N]``), in JAX."""
    s = jnp.einsum("bhgd,bhnd->bhgn", q4, k, precision=_HP)
    s = jnp.where(valid[:, None, None, :], s, _NEG)
    m = jnp.max(s, axis=-1)
    p = jnp.where(valid[:, None, None, :], jnp.exp(s - m[..., None]), 0.0)
    acc = jnp.einsum("bhgn,bhnd->bhgd", p, jnp.where(valid[:, None, :, None], v, 0.0), precision=_HP)
    return acc[:, :, None], m[:, :, None], jnp.sum(p, axis=-1)[:, :, None]


def _check(q, scheme, state, lengths, k_new, v_new):
    if not isinstance(scheme, KVQuantScheme):
        raise ValueError(f"decode_attention_kvquant needs a KVQuantScheme, got {type(scheme).__name__}")
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D] (one new token), got shape {q.shape}")
    b, hq, d = q.shape
    bs, hkv, cap, _ = state.k_codes.shape
    if bs != b or state.k_sink.shape[-1] != d:
        raise ValueError(f"q {q.shape} does not match the layer state (B={bs}, D={state.k_sink.shape[-1]})")
    if hq % hkv:
        raise ValueError(f"GQA needs Hq ({hq}) to be a multiple of Hkv ({hkv})")
    if tuple(lengths.shape) != (b,):
        raise ValueError(f"lengths must be int [B={b}], got shape {lengths.shape}")
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both k_new and v_new, or neither")
    if k_new is not None and (tuple(k_new.shape) != (b, hkv, d) or tuple(v_new.shape) != (b, hkv, d)):
        raise ValueError(f"k_new, v_new must be [B, Hkv, D] = {(b, hkv, d)}, got {k_new.shape}, {v_new.shape}")
    channel_subplanes(d)
    return b, hq, hkv, d, cap


def decode_attention_kvquant(q, scheme: KVQuantScheme, state, lengths, k_new=None, v_new=None, *,
                             sm_scale: float | None = None, interpret: Any = None, block_t: int = 64,
                             num_splits: int = 1):
    """Attention of one new token over a KVQuant layer (+ the exact current token), ONE softmax.

    Args:
      q: ``[B, Hq, D]`` query, post-RoPE (rotated once at its position).
      scheme, state: the layer's :class:`~kvquant_jax.cache.kvquant.KVQuantScheme` and (unstacked) state.
      lengths: int ``[B]`` committed rows (history = positions ``[0, lengths)``).
      k_new, v_new: optional ``[B, Hkv, D]`` exact post-RoPE K/V of the current token.
      sm_scale: logit scale (default ``1/sqrt(D)``).  interpret: None -> interpreter unless on GPU.
      block_t: rows per kernel block (the largest power of two <= it dividing the capacity).
      num_splits: split-K programs per (sequence, KV head).
    Returns ``[B, Hq, D]`` in ``q.dtype``.  Raises ``ValueError`` for mismatched shapes, a non-KVQuant scheme or
    ``D`` not a multiple of 16.
    """
    b, hq, hkv, d, cap = _check(q, scheme, state, lengths, k_new, v_new)
    g = hq // hkv
    if interpret is None:
        interpret = default_interpret()
    if num_splits < 1 or block_t < 1:
        raise ValueError(f"num_splits and block_t must be >= 1, got {num_splits}, {block_t}")
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)
    lengths = lengths.astype(jnp.int32)
    q4 = q.astype(_F32).reshape(b, hkv, g, d) * scale
    mp = max(8, -(-g // 8) * 8)
    bt = _pick_block(cap, block_t)
    ns = max(1, min(num_splits, cap // bt))
    rope = scheme.rope_pairing if scheme.key_stage == "pre_rope" else "none"
    sp = _Spec(d=d, mp=mp, bt=bt, ns=ns, kb=scheme.k_bits, vb=scheme.v_bits, ck=scheme.k_sparse_capacity,
               cv=scheme.v_outliers, rope=rope)
    qsub = _subplanes(jnp.pad(q4, ((0, 0), (0, 0), (0, mp - g), (0, 0))), d).reshape(b, hkv, mp, d)
    freq = _subplanes(_inv_freq(d, scheme.rope_theta, scheme.rope_pairing), d)          # [2, 8, D/16]
    start = jnp.minimum(jnp.int32(scheme.sink), lengths)
    st = state

    def dummy(x):      # Pallas cannot take zero-size operands: a one-slot never-matching stand-in
        return x if x.shape[-1] else jnp.full(x.shape[:-1] + (1,), 255 if x.dtype == jnp.uint8 else 0, x.dtype)

    out_shape = (jax.ShapeDtypeStruct((b, hkv, ns, mp, d), _F32),
                 jax.ShapeDtypeStruct((b, hkv, ns, mp, 1), _F32),
                 jax.ShapeDtypeStruct((b, hkv, ns, mp, 1), _F32))
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, sp=sp), out_shape=out_shape, grid=(b, hkv, ns), interpret=interpret,
        name=f"decode_attention_kvquant_k{sp.kb}v{sp.vb}",
    )(start, lengths, qsub, st.k_codes, st.k_codebook, _subplanes(st.k_scale, d), _subplanes(st.k_zero, d),
      dummy(st.k_sp_idx), dummy(st.k_sp_val), st.v_codes, st.v_codebook, st.v_scale, st.v_offset,
      dummy(st.v_sp_idx), dummy(st.v_sp_val), st.pos, freq)
    acc = _from_subplanes(o.reshape(b, hkv, ns, mp, 2, 8, d // 16), d)[:, :, :, :g]   # [B, Hkv, S, G, D]
    parts = [(acc, m[:, :, :, :g, 0], l[:, :, :, :g, 0])]
    if scheme.sink:
        n = min(scheme.sink, cap)
        ks = st.k_sink[:, :, :n].astype(_F32)
        pos = st.pos[:, :n]
        if scheme.key_stage == "pre_rope":
            ks = jnp.swapaxes(apply_rope(jnp.swapaxes(ks, 1, 2), pos, scheme.rope_theta, scheme.rope_pairing), 1, 2)
        valid = jnp.arange(n, dtype=jnp.int32)[None, :] < lengths[:, None]
        parts.append(_dense_partial(q4, ks, st.v_sink[:, :, :n].astype(_F32), valid))
    if k_new is not None:
        parts.append(_dense_partial(q4, k_new.astype(_F32)[:, :, None], v_new.astype(_F32)[:, :, None],
                                    jnp.ones((b, 1), jnp.bool_)))
    return _combine(parts).reshape(b, hq, d).astype(q.dtype)


def decode_attention_kvquant_reference(q, scheme: KVQuantScheme, state, lengths, k_new=None, v_new=None, *,
                                       sm_scale: float | None = None, interpret: Any = None, block_t: int = 64,
                                       num_splits: int = 1):
    """Plain-JAX twin of :func:`decode_attention_kvquant` (same signature; kernel-only arguments ignored):
    ``scheme.materialize_layer`` (post-RoPE keys) and one float32 softmax with the current token."""
    del interpret, block_t, num_splits
    b, hq, hkv, d, cap = _check(q, scheme, state, lengths, k_new, v_new)
    g = hq // hkv
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)
    q4 = q.astype(_F32).reshape(b, hkv, g, d) * scale
    k, v, valid = scheme.materialize_layer(state, lengths.astype(jnp.int32))
    parts = [_dense_partial(q4, k, v, valid)]
    if k_new is not None:
        parts.append(_dense_partial(q4, k_new.astype(_F32)[:, :, None], v_new.astype(_F32)[:, :, None],
                                    jnp.ones((b, 1), jnp.bool_)))
    return _combine(parts).reshape(b, hq, d).astype(q.dtype)
