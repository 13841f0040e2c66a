"""Float64 NumPy oracles for kvquant_jax.quant, written from the design notes (not from the JAX code).

Each oracle works group by group on explicit Python loops/reshapes so that a layout bug in the JAX grouping
machinery cannot be mirrored here.  Oracles that reject input raise ``OracleReject``.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


class OracleReject(Exception):
    pass


def as_f64(x):
    return np.asarray(x, dtype=np.float64)


def round_to(value, dtype):
    """Round float64 values to ``dtype`` (round to nearest even) without warnings."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return np.asarray(value, dtype=np.float64).astype(dtype)


def ulp_distance(a, b, dtype):
    """|a - b| in units of the dtype's spacing at the larger magnitude (a, b already in dtype)."""
    a64, b64 = as_f64(np.asarray(a).astype(dtype)), as_f64(np.asarray(b).astype(dtype))
    spacing = as_f64(np.spacing(np.maximum(np.abs(np.asarray(a).astype(dtype)), np.abs(np.asarray(b).astype(dtype)))))
    spacing = np.maximum(spacing, float(jnp.finfo(dtype).smallest_subnormal))
    return np.abs(a64 - b64) / spacing


def near_half(q, slack):
    """|frac(q) - 0.5| < slack: a quotient whose rounding may legitimately flip between float32 and float64."""
    frac = np.abs(q - np.floor(q) - 0.5)
    return frac < slack


# ---------------------------------------------------------------- symmetric (0x02A reference, one row at a time)
def symmetric_row(row, bits, dtype):
    """Return (codes int64, stored scale) for one row; raises OracleReject like the design-notes reference."""
    row = as_f64(row)
    qmax = 2 ** (bits - 1) - 1
    if not np.isfinite(row).all():
        raise OracleReject("non-finite")
    amax = np.max(np.abs(row))
    if amax == 0:
        return np.zeros(row.shape, np.int64), np.asarray(1.0).astype(dtype)
    scale = round_to(amax / qmax, dtype)
    eff = float(scale)
    if not np.isfinite(eff) or eff < float(jnp.finfo(dtype).tiny):
        raise OracleReject("scale")
    return np.clip(np.rint(row / eff), -qmax, qmax).astype(np.int64), scale


def symmetric_groups(x, bits, axis, group_size, dtype, valid_length=None):
    """Grouped oracle: returns codes (x.shape, int64), scales (axis -> n_groups), via explicit index loops."""
    x = as_f64(x)
    xm = np.moveaxis(x, axis, -1)
    n = xm.shape[-1]
    g = group_size or n
    ng = -(-n // g)
    codes = np.zeros(xm.shape, np.int64)
    scales = np.zeros(xm.shape[:-1] + (ng,), dtype)
    for idx in np.ndindex(*xm.shape[:-1]):
        vl = n if valid_length is None else int(np.broadcast_to(valid_length, xm.shape[:-1])[idx])
        for j in range(ng):
            lo, hi = j * g, min((j + 1) * g, n, vl)
            if hi <= lo:
                scales[idx + (j,)] = 1.0
                continue
            c, s = symmetric_row(xm[idx][lo:hi], bits, dtype)
            codes[idx][lo:hi] = c
            scales[idx + (j,)] = s
    return np.moveaxis(codes, -1, axis), np.moveaxis(scales, -1, axis)


# ---------------------------------------------------------------- affine
def affine_qparams(vals, bits, dtype, zero):
    """Ideal qparams of one (valid, non-empty) group -> (scale, zero_or_min) in storage types (float64 math)."""
    q = 2 ** bits - 1
    lo, hi = float(np.min(vals)), float(np.max(vals))
    if zero == "int":
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi == lo:
        return np.asarray(1.0).astype(dtype), (np.asarray(lo).astype(dtype) if zero == "min" else np.uint8(0))
    scale = round_to((hi - lo) / q, dtype)
    eff = float(scale)
    if not np.isfinite(eff) or eff < float(jnp.finfo(dtype).tiny):
        raise OracleReject("scale")
    if zero == "min":
        return scale, round_to(lo, dtype)
    return scale, np.uint8(np.clip(np.rint(-lo / eff), 0, q))


def affine_encode(vals, bits, scale, zero_or_min, zero):
    """Codes of one group from STORED qparams, and the real-valued quotient before rounding (for tie slack)."""
    q = 2 ** bits - 1
    s, z = float(scale), float(zero_or_min)
    if zero == "min":
        quot = (vals - z) / s
        return np.clip(np.rint(quot), 0, q).astype(np.int64), quot
    quot = vals / s
    return np.clip(np.rint(quot) + z, 0, q).astype(np.int64), quot


def affine_decode(codes, scale, zero_or_min, zero):
    s, z = float(scale), float(zero_or_min)
    return codes * s + z if zero == "min" else (codes - z) * s


# ---------------------------------------------------------------- QServe (0x09C reference)
def qserve_head(a, dtype=np.float16):
    a = as_f64(a)
    if not np.isfinite(a).all():
        raise OracleReject("non-finite")
    width = np.max(a) - np.min(a)
    if not np.isfinite(width) or width <= 0:
        raise OracleReject("constant")
    ideal = width / 15.0
    scale = round_to(ideal, dtype)
    offset = round_to(-np.min(a) / ideal, dtype)
    if not np.isfinite(float(scale)) or float(scale) < float(jnp.finfo(dtype).tiny) or not np.isfinite(float(offset)):
        raise OracleReject("qparams")
    return scale, offset


def qserve_encode(a, scale, offset):
    quot = as_f64(a) / float(scale) + float(offset)
    return np.clip(np.rint(quot), 0, 15).astype(np.int64), quot


# ---------------------------------------------------------------- packing: an explicit LSB-first bit stream
def pack_stream(codes, bits, word_bits):
    """Pack a 1-D code list: stream bit j = bit (j % bits) of code j // bits; word w = stream bits [w*W, (w+1)*W)."""
    stream = [(int(c) >> b) & 1 for c in codes for b in range(bits)]
    n_words = -(-len(stream) // word_bits)
    stream += [0] * (n_words * word_bits - len(stream))
    return [sum(stream[w * word_bits + j] << j for j in range(word_bits)) for w in range(n_words)]


# ---------------------------------------------------------------- NUQ
def nearest_index(values, codebook):
    """argmin |v - c_i| in float64 with ties to the lower index; also returns the distance gap for tie slack."""
    v = as_f64(values)[..., None]
    d = np.abs(v - as_f64(codebook))
    idx = np.argmin(d, axis=-1)                      # argmin returns the first (lowest) index on ties
    srt = np.sort(d, axis=-1)
    gap = srt[..., 1] - srt[..., 0] if d.shape[-1] > 1 else np.full(idx.shape, np.inf)
    return idx, gap


# ---------------------------------------------------------------- test data
def random_tensor(seed, shape, log10_lo=-1.0, log10_hi=3.0, zero_fraction=0.0, axis=-1):
    """float32 non-zero data with a per-vector magnitude 10**U(lo, hi) and occasional outliers; with
    ``zero_fraction`` some whole vectors along ``axis`` are zeroed (all-zero groups)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    lead = list(shape)
    lead[axis] = 1
    x *= 10.0 ** rng.uniform(log10_lo, log10_hi, size=lead)
    x *= np.where(rng.random(shape) < 0.05, rng.uniform(2, 20, size=shape), 1.0)
    x[x == 0] = 1.0
    if zero_fraction:
        x *= (rng.random(lead) >= zero_fraction)
    return x.astype(np.float32)
