"""Float64 NumPy oracle of the KVQuant cache representation and its decode attention (design notes 0x07B-0x07E).

Written from the module docstring of kvquant_jax/cache/kvquant.py (the documented layout and rules), not from the
JAX code: explicit bit streams, argmin signpost search, sorted outlier selection and per-row loops.
"""
from __future__ import annotations

import numpy as np

UNUSED = 255


def rope64(x, pos, theta, pairing, inverse=False):
    """RoPE of ``x [..., D]`` at positions ``pos`` (broadcast against ``x[..., 0]``) in float64."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    inv = 1.0 / (float(theta) ** (np.arange(0, d, 2, dtype=np.float64) / d))            # pair i
    ang = np.asarray(pos, np.float64)[..., None] * inv
    c, s = np.cos(ang), np.sin(ang)
    if inverse:
        s = -s
    out = np.empty_like(x)
    if pairing == "half_split":
        a, b = x[..., : d // 2], x[..., d // 2:]
        out[..., : d // 2], out[..., d // 2:] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
    return out


def unpack(codes_u8, bits, d):
    """Little-endian bit stream: element i at bits [i*bits, (i+1)*bits) -> int codes ``[..., d]``."""
    c = np.asarray(codes_u8, np.uint8)
    stream = np.unpackbits(c, axis=-1, bitorder="little")[..., : d * bits].reshape(c.shape[:-1] + (d, bits))
    return (stream.astype(np.int64) << np.arange(bits)).sum(-1)


def nearest(x, cb):
    """Nearest signpost index (ties -> lower index) and the gap to the second candidate (tie detector)."""
    dist = np.abs(np.asarray(x, np.float64)[..., None] - np.asarray(cb, np.float64))
    idx = np.argmin(dist, axis=-1)
    srt = np.sort(dist, axis=-1)
    return idx, srt[..., 1] - srt[..., 0]


def f16(x):
    return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)


# ------------------------------------------------------------------------------------------- encode (one row)
def encode_key_row(k, zero, scale, cb, cap):
    """Expected decoded pre-RoPE key row and its near-tie mask: ``k, zero, scale: [D]``."""
    x = (k - zero) / scale
    out = np.abs(x) > 1.0
    order = sorted(np.flatnonzero(out), key=lambda c: (-abs(x[c]), c))
    kept = np.zeros(k.shape, bool)
    kept[order[:cap]] = True
    idx, gap = nearest(x, cb)
    dec = np.asarray(cb, np.float64)[idx] * scale + zero
    return np.where(kept, f16(k), dec), (gap < 1e-5) & ~kept


def encode_value_row(v, cb, n_out):
    """Expected decoded value row (fp16 qparams, ``n_out`` largest-|v| outliers) and its near-tie mask."""
    kept = np.zeros(v.shape, bool)
    if n_out:
        mag = np.abs(v)
        t = np.sort(mag)[::-1][n_out]                         # the (n+1)-th largest |v|
        kept = mag > t
    dense = v[~kept]
    mn, mx = dense.min(), dense.max()
    scale, offset = f16((mx - mn) / 2), f16((mx + mn) / 2)
    if scale == 0:
        return np.where(kept, f16(v), offset), np.zeros(v.shape, bool)
    x = (v - offset) / scale
    idx, gap = nearest(x, cb)
    dec = np.asarray(cb, np.float64)[idx] * scale + offset
    return np.where(kept, f16(v), dec), (gap < 1e-4) & ~kept


# ------------------------------------------------------------------------------------------- decode (raw state)
def decode_state(st, *, k_bits, v_bits, sink, lengths):
    """Stored-stage ``(k, v)`` float64 ``[B, H, C, D]`` from a layer state's raw arrays (rows >= length: 0)."""
    g = {n: np.asarray(getattr(st, n)) for n in ("k_codes", "k_sp_idx", "k_sp_val", "v_codes", "v_scale",
                                                 "v_offset", "v_sp_idx", "v_sp_val", "k_sink", "v_sink",
                                                 "k_scale", "k_zero", "k_codebook", "v_codebook")}
    b, h, c, _ = g["k_codes"].shape
    d = g["k_sink"].shape[-1]
    k = np.zeros((b, h, c, d))
    v = np.zeros((b, h, c, d))
    kcb, vcb = g["k_codebook"].astype(np.float64), g["v_codebook"].astype(np.float64)
    for bi in range(b):
        for hi in range(h):
            for row in range(int(lengths[bi])):
                if row < sink:
                    k[bi, hi, row] = g["k_sink"][bi, hi, row].astype(np.float64)
                    v[bi, hi, row] = g["v_sink"][bi, hi, row].astype(np.float64)
                    continue
                kr = kcb[unpack(g["k_codes"][bi, hi, row], k_bits, d)] * g["k_scale"][hi] + g["k_zero"][hi]
                vr = (vcb[unpack(g["v_codes"][bi, hi, row], v_bits, d)] * float(g["v_scale"][bi, hi, row, 0])
                      + float(g["v_offset"][bi, hi, row, 0]))
                for name, r in (("k", kr), ("v", vr)):
                    for idx, val in zip(g[f"{name}_sp_idx"][bi, hi, row], g[f"{name}_sp_val"][bi, hi, row]):
                        if idx != UNUSED:
                            r[idx] = float(val)
                k[bi, hi, row], v[bi, hi, row] = kr, vr
    return k, v


def decode_attention(q, st, lengths, *, k_bits, v_bits, sink, key_stage, theta, pairing, k_new=None, v_new=None):
    """float64 ``[B, Hq, D]``: one softmax over rotated cached keys (rows < length) and the current token."""
    k, v = decode_state(st, k_bits=k_bits, v_bits=v_bits, sink=sink, lengths=lengths)
    pos = np.asarray(st.pos)
    q = np.asarray(q, np.float64)
    b, hq, d = q.shape
    h = k.shape[1]
    gq = hq // h
    out = np.zeros((b, hq, d))
    for bi in range(b):
        n = int(lengths[bi])
        for qh in range(hq):
            kh = qh // gq
            keys = k[bi, kh, :n]
            if key_stage == "pre_rope":
                keys = rope64(keys, pos[bi, :n], theta, pairing)
            vals = v[bi, kh, :n]
            if k_new is not None:
                keys = np.concatenate([keys, np.asarray(k_new, np.float64)[bi, kh][None]])
                vals = np.concatenate([vals, np.asarray(v_new, np.float64)[bi, kh][None]])
            if keys.shape[0] == 0:
                continue
            s = keys @ q[bi, qh] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[bi, qh] = (p / p.sum()) @ vals
    return out
