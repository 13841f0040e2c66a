"""Pallas decode attention over a KVQuant layer: LUT decode, sparse correction and RoPE inside the kernel.

One new query token per sequence (``q: [B, Hq, D]``, already rotated at its own position by the model) attends
over a KVQuant layer (:mod:`kvquant_jax.abi.kvquant`: the arrays plus a static :class:`KVQuantFormat`) read where
it lies, plus the exact current token
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

Channel order inside the kernel (no register slicing or interleave).  The packed stream holds 8 codes in every
``b`` bytes (kvquant_jax.quant.packing, ``b`` = bits <= 4), so byte ``kk`` of chunk ``J`` sits at column
``b*J + kk``: one strided load per byte position gives ``w = sum_kk byte_kk << 8 kk`` for a run of chunks, and code
``r`` of a chunk is ``(w >> b r) & (2^b - 1)``, channel ``8 J + r``.  Keys are decoded as two PARTNER tiles
``A, B: [rows, D/2]`` whose column ``i`` holds the two channels of one RoPE pair: for ``half_split`` (``c`` with
``c + D/2``) A is the first half of the chunks and B the second (``(r, j)`` order: channel ``8 j + r`` and
``D/2 + 8 j + r``); for ``interleaved`` (``2i`` with ``2i + 1``) A holds the even code positions and B the odd ones
of every chunk (``(half, m, j)`` order: channel ``half D/2 + 8 j + 2m`` and ``+ 1``).  RoPE is then elementwise
between A and B, and ``q . k = q_A . A + q_B . B`` with the query split the same way by the wrapper (a dot product
does not care about the channel order).  Values are decoded as one tile ``[rows, D]`` in ``(r, J)`` order (channel
``8 J + r``); the wrapper un-permutes the output.  Sparse outliers are matched against each tile column's channel
number (a compare + select per slot; the maps come in as small int32 operands).  The LUT is a select tree over the
code bits (``2^b - 1`` selects), a gather-free form.  Only elementwise ops, reshapes, strided loads and 2-D dots:
the body lowers to Pallas Triton (checked on an H200, see docs/results/kvquant/) as well as running interpreted.

Backend: the Pallas Triton-style loop kernel (grid ``(B, Hkv, num_splits)``, a ``fori_loop`` over blocks), run
with ``interpret=True`` where no GPU exists (:func:`pallas_kernels.backend.default_interpret`); validated in the
interpreter against a float64 NumPy oracle (tests/kernels/test_decode_attention_kvquant.py).
:func:`decode_attention_kvquant_reference` is the plain-JAX twin (``abi.kvquant.materialize``, one softmax).
Neither reads a scheme class or the model: the format says everything (``KVQuantScheme.kernel_format``).
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

from kvquant_jax.abi import kvquant as abi
from kvquant_jax.abi.kvquant import KVQuantFormat, KVQuantLayerState
from pallas_kernels.backend import default_interpret

__all__ = ["decode_attention_kvquant", "decode_attention_kvquant_reference", "channel_maps"]

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
    def w(self):        # chunks per key half (D/16)
        return self.d // 16


def channel_maps(d: int, rope: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int ``[D/2]``, ``[D/2]``, ``[D]``: the channel of every column of the key partner tiles A and B and of the
    value tile (see the module docstring).  ``rope``: "half_split", "interleaved" or "none" (A/B as half_split)."""
    if d % 16:
        raise ValueError(f"decode_attention_kvquant: head_dim must be a multiple of 16, got {d}")
    j, r, m = np.arange(d // 16), np.arange(8), np.arange(4)
    if rope == "interleaved":
        a = (np.arange(2)[:, None, None] * (d // 2) + 8 * j[None, None, :] + 2 * m[None, :, None]).reshape(-1)
        b = a + 1
    else:
        a = (8 * j[None, :] + r[:, None]).reshape(-1)
        b = a + d // 2
    v = (8 * np.arange(d // 8)[None, :] + r[:, None]).reshape(-1)
    return a, b, v


# --------------------------------------------------------------------------------------------------------------
# kernel body
# --------------------------------------------------------------------------------------------------------------
def _lut(code, cb_ref, bits: int):
    """``codebook[code]`` as a select tree over the code bits (``2^b - 1`` selects, no gather)."""
    vals = [jnp.full(code.shape, cb_ref[e], _F32) for e in range(2 ** bits)]
    for bit in range(bits):
        sel = ((code >> bit) & 1) == 1
        vals = [jnp.where(sel, vals[2 * i + 1], vals[2 * i]) for i in range(len(vals) // 2)]
    return vals[0]


def _words(codes_ref, lead, rows, bits: int, first: int, n: int):
    """int32 ``[rows, n]``: the packed 8-code words of chunks ``first .. first + n - 1`` (one strided load per
    byte of the chunk)."""
    w = None
    for kk in range(bits):
        byte = codes_ref[lead + (rows, pl.ds(bits * first + kk, n, stride=bits))].astype(jnp.int32) << (8 * kk)
        w = byte if w is None else w | byte
    return w


def _values(w, bits: int, positions: int, step: int, phase: int, cb_ref, lead_shape):
    """Codebook values of code positions ``phase + step * i`` (``i < positions``) of the words ``w``, reshaped to
    ``lead_shape + (-1,)``: ``[..., positions, n]`` flattened in (position, chunk) order."""
    shifts = bits * (step * lax.broadcasted_iota(jnp.int32, (1,) * (w.ndim - 1) + (positions, 1), w.ndim - 1)
                     + phase)
    code = (jnp.expand_dims(w, -2) >> shifts) & (2 ** bits - 1)
    return _lut(code, cb_ref, bits).reshape(lead_shape + (-1,))


def _key_tiles(codes_ref, lead, rows, cb_ref, sp: _Spec):
    """Key partner tiles A, B ``[bt, D/2]`` of codebook values (see the module docstring)."""
    b = sp.kb
    if sp.rope == "interleaved":
        w = _words(codes_ref, lead, rows, b, 0, sp.d // 8).reshape(sp.bt, 2, sp.w)
        return (_values(w, b, 4, 2, 0, cb_ref, (sp.bt,)), _values(w, b, 4, 2, 1, cb_ref, (sp.bt,)))
    return (_values(_words(codes_ref, lead, rows, b, 0, sp.w), b, 8, 1, 0, cb_ref, (sp.bt,)),
            _values(_words(codes_ref, lead, rows, b, sp.w, sp.w), b, 8, 1, 0, cb_ref, (sp.bt,)))


def _apply_sparse(x, idx_ref, val_ref, lead, rows, slots: int, chan):
    """Exact holes + full values: replace the kept outlier channels of ``x [bt, N]`` (``chan [1, N]``)."""
    for s in range(slots):
        idx = idx_ref[lead + (rows, pl.ds(s, 1))].astype(jnp.int32)                 # [bt, 1]; 255 = unused
        val = val_ref[lead + (rows, pl.ds(s, 1))].astype(_F32)
        x = jnp.where(idx == chan, val, x)
    return x


def _kernel(start_ref, end_ref, qa_ref, qb_ref, kc_ref, kcb_ref, ksa_ref, ksb_ref, kza_ref, kzb_ref, ki_ref,
            kv_ref, vc_ref, vcb_ref, vs_ref, vo_ref, vi_ref, vv_ref, pos_ref, freq_ref, chan_ref, chanv_ref,
            o_ref, m_ref, l_ref, *, sp: _Spec):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = start_ref[b], end_ref[b]
    bt = jnp.int32(sp.bt)
    first = lax.div(start, bt)
    last = lax.div(end + bt - 1, bt)
    per = lax.div(jnp.maximum(last - first, 0) + sp.ns - 1, sp.ns)
    lo = first + s * per
    hi = jnp.minimum(lo + per, last)
    lead = (b, h)
    qa, qb = qa_ref[b, h], qb_ref[b, h]                                              # [Mp, D/2]
    half = pl.ds(0, sp.d // 2)
    ksa, ksb = ksa_ref[pl.ds(h, 1), half], ksb_ref[pl.ds(h, 1), half]              # [1, D/2]
    kza, kzb = kza_ref[pl.ds(h, 1), half], kzb_ref[pl.ds(h, 1), half]
    freq = freq_ref[pl.ds(0, 1), half]
    chan_a, chan_b = chan_ref[pl.ds(0, 1), half], chan_ref[pl.ds(1, 1), half]
    chan_v = chanv_ref[pl.ds(0, 1), pl.ds(0, sp.d)]

    def body(blk, carry):
        m, l, acc = carry
        row0 = blk * sp.bt
        rows = pl.ds(row0, sp.bt)
        posn = row0 + lax.broadcasted_iota(jnp.int32, (sp.bt, 1), 0)
        valid_col = (posn >= start) & (posn < end)                                  # [bt, 1]
        valid_row = jnp.reshape(valid_col, (1, sp.bt))
        # keys: LUT decode -> per-channel scale/zero -> sparse -> RoPE at the stored position -> two dots
        ka, kb = _key_tiles(kc_ref, lead, rows, kcb_ref, sp)
        ka = _apply_sparse(ka * ksa + kza, ki_ref, kv_ref, lead, rows, sp.ck, chan_a)
        kb = _apply_sparse(kb * ksb + kzb, ki_ref, kv_ref, lead, rows, sp.ck, chan_b)
        if sp.rope != "none":
            ang = pos_ref[b, rows].astype(_F32)[:, None] * freq                      # [bt, D/2]
            c, sn = jnp.cos(ang), jnp.sin(ang)
            ka, kb = ka * c - kb * sn, kb * c + ka * sn
        dims = (((1,), (1,)), ((), ()))
        sc = (lax.dot_general(qa, ka, dims, precision=_HP, preferred_element_type=_F32)
              + lax.dot_general(qb, kb, dims, precision=_HP, preferred_element_type=_F32))
        sc = jnp.where(valid_row, sc, _NEG)                                          # [Mp, bt]
        m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid_row, jnp.exp(sc - m_new), 0.0)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        # values: LUT decode -> per-row scale/offset -> sparse -> PV
        vs = vs_ref[lead + (rows, pl.ds(0, 1))].astype(_F32)                        # [bt, 1]
        vo = vo_ref[lead + (rows, pl.ds(0, 1))].astype(_F32)
        v = _values(_words(vc_ref, lead, rows, sp.vb, 0, sp.d // 8), sp.vb, 8, 1, 0, vcb_ref, (sp.bt,))
        v = _apply_sparse(v * vs + vo, vi_ref, vv_ref, lead, rows, sp.cv, chan_v)
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


def _check(q, fmt, state, lengths, k_new, v_new):
    if not isinstance(fmt, KVQuantFormat):
        raise ValueError("decode_attention_kvquant needs a KVQuantScheme's static format (KVQuantFormat, "
                         f"scheme.kernel_format), got {type(fmt).__name__}")
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
    channel_maps(d, "none")
    return b, hq, hkv, d, cap


def decode_attention_kvquant(q, fmt: KVQuantFormat, state: KVQuantLayerState, lengths, k_new=None, v_new=None, *,
                             sm_scale: float | None = None, interpret: Any = None, block_t: int = 64,
                             num_splits: int = 1):
    """Attention of one new token over a KVQuant layer (+ the exact current token), ONE softmax.

    Args:
      q: ``[B, Hq, D]`` query, post-RoPE (rotated once at its position).
      fmt, state: the layer's static :class:`~kvquant_jax.abi.kvquant.KVQuantFormat` and its (unstacked)
        :class:`~kvquant_jax.abi.kvquant.KVQuantLayerState` arrays.
      lengths: int ``[B]`` committed rows (history = positions ``[0, lengths)``).
      k_new, v_new: optional ``[B, Hkv, D]`` exact post-RoPE K/V of the current token.
      sm_scale: logit scale (default ``1/sqrt(D)``).  interpret: None -> interpreter unless on GPU.
      block_t: rows per kernel block (the largest power of two <= it dividing the capacity).
      num_splits: split-K programs per (sequence, KV head).
    Returns ``[B, Hq, D]`` in ``q.dtype``.  Raises ``ValueError`` for mismatched shapes, a non-KVQuant format or
    ``D`` not a multiple of 16.
    """
    b, hq, hkv, d, cap = _check(q, fmt, state, lengths, k_new, v_new)
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
    rope = fmt.rope
    sp = _Spec(d=d, mp=mp, bt=bt, ns=ns, kb=fmt.k_bits, vb=fmt.v_bits, ck=fmt.k_sparse_capacity,
               cv=fmt.v_outliers, rope=rope)
    ca, cb, cv = channel_maps(d, rope)
    qp = jnp.pad(q4, ((0, 0), (0, 0), (0, mp - g), (0, 0)))
    freq = _inv_freq(d, fmt.rope_theta, rope if rope != "none" else "half_split")[ca][None]      # [1, D/2]
    start = jnp.minimum(jnp.int32(fmt.sink), lengths)
    st = state

    def dummy(x):      # Pallas cannot take zero-size operands: a one-slot never-matching stand-in
        return x if x.shape[-1] else jnp.full(x.shape[:-1] + (1,), 255 if x.dtype == jnp.uint8 else 0, x.dtype)

    out_shape = (jax.ShapeDtypeStruct((b, hkv, ns, mp, d), _F32),
                 jax.ShapeDtypeStruct((b, hkv, ns, mp, 1), _F32),
                 jax.ShapeDtypeStruct((b, hkv, ns, mp, 1), _F32))
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, sp=sp), out_shape=out_shape, grid=(b, hkv, ns), interpret=interpret,
        name=f"decode_attention_kvquant_k{sp.kb}v{sp.vb}",
    )(start, lengths, qp[..., ca], qp[..., cb], st.k_codes, st.k_codebook, st.k_scale[:, ca], st.k_scale[:, cb],
      st.k_zero[:, ca], st.k_zero[:, cb], dummy(st.k_sp_idx), dummy(st.k_sp_val), st.v_codes, st.v_codebook,
      st.v_scale, st.v_offset, dummy(st.v_sp_idx), dummy(st.v_sp_val), st.pos, freq,
      jnp.asarray(np.stack([ca, cb]), jnp.int32), jnp.asarray(cv[None], jnp.int32))
    acc = o[..., np.argsort(cv)][:, :, :, :g]                                           # [B, Hkv, S, G, D]
    parts = [(acc, m[:, :, :, :g, 0], l[:, :, :, :g, 0])]
    if fmt.sink:
        n = min(fmt.sink, cap)
        ks = st.k_sink[:, :, :n].astype(_F32)
        pos = st.pos[:, :n]
        if rope != "none":
            ks = abi.rotate_keys(ks, pos, fmt.rope_theta, rope)
        valid = jnp.arange(n, dtype=jnp.int32)[None, :] < lengths[:, None]
        parts.append(_dense_partial(q4, ks, st.v_sink[:, :, :n].astype(_F32), valid))
    if k_new is not None:
        parts.append(_dense_partial(q4, k_new.astype(_F32)[:, :, None], v_new.astype(_F32)[:, :, None],
                                    jnp.ones((b, 1), jnp.bool_)))
    return _combine(parts).reshape(b, hq, d).astype(q.dtype)


def decode_attention_kvquant_reference(q, fmt: KVQuantFormat, state: KVQuantLayerState, lengths, k_new=None,
                                       v_new=None, *,
                                       sm_scale: float | None = None, interpret: Any = None, block_t: int = 64,
                                       num_splits: int = 1):
    """Plain-JAX twin of :func:`decode_attention_kvquant` (same signature; kernel-only arguments ignored):
    :func:`kvquant_jax.abi.kvquant.materialize` (post-RoPE keys) and one float32 softmax with the current token."""
    del interpret, block_t, num_splits
    b, hq, hkv, d, cap = _check(q, fmt, state, lengths, k_new, v_new)
    g = hq // hkv
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)
    q4 = q.astype(_F32).reshape(b, hkv, g, d) * scale
    k, v, valid = abi.materialize(fmt, state, lengths.astype(jnp.int32))
    parts = [_dense_partial(q4, k, v, valid)]
    if k_new is not None:
        parts.append(_dense_partial(q4, k_new.astype(_F32)[:, :, None], v_new.astype(_F32)[:, :, None],
                                    jnp.ones((b, 1), jnp.bool_)))
    return _combine(parts).reshape(b, hq, d).astype(q.dtype)
