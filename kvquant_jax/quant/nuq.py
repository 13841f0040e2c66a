"""Non-uniform codes (KVQuant, design notes 0x07C): nearest-signpost encode against a per-layer codebook, LUT decode.

A codebook is a float32 vector of ``2**bits`` strictly increasing finite signposts (``1 <= bits <= 8``), normally
derived offline (sensitivity-weighted k-means) on normalized values in ``[-1, 1]``.  A code is an INDEX into it,
not an affine integer: ``decode(code) = codebook[code]``.

Encode: ``code = #{i : m_i < x}`` with the float32 midpoints ``m_i = c_i * 0.5 + c_{i+1} * 0.5`` (each half is
exact, the sum is rounded once).  So every value maps to the nearest signpost and a value exactly on a midpoint
(equidistant) goes to the LOWER index; values outside the codebook map to the first/last entry.

:func:`quantize_nuq` adds KVQuant's online per-group normalization: ``offset = (max + min) / 2`` and
``scale = (max - min) / 2`` stored in the qparam dtype, ``code = encode((x - offset) / scale)``,
``x_hat = codebook[code] * scale + offset``.  Constant groups store ``scale = 0`` (exact sentinel: they decode to
``offset``, the constant rounded to the qparam dtype, whatever the codebook) and code ``argmin |c_i|``.
Non-constant groups whose stored scale overflows, underflows or is subnormal are rejected like the affine ones.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.quant import _common as C


class NuqQuantized(NamedTuple):
    """``codes``: uint8 indices, ``x.shape``; ``scale``, ``offset``: qparam dtype, ``x.shape`` with ``axis`` ->
    ``n_groups``."""

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array


def check_codebook(codebook, what: str = "codebook") -> jax.Array:
    """float32 1-D, length ``2**b`` (b in 1..8); on concrete input also finite and strictly increasing."""
    cb = jnp.asarray(codebook)
    if not jnp.issubdtype(cb.dtype, jnp.floating):
        raise ValueError(f"{what}: codebook must be floating, got dtype {cb.dtype}")
    n = cb.shape[0] if cb.ndim == 1 else 0
    if cb.ndim != 1 or n < 2 or n > 256 or n & (n - 1):
        raise ValueError(f"{what}: codebook must be 1-D with 2**bits entries (2..256), got shape {cb.shape}")
    cb = cb.astype(jnp.float32)
    if C.is_concrete(cb):
        c = np.asarray(cb, dtype=np.float64)
        if not np.isfinite(c).all():
            raise ValueError(f"{what}: codebook has non-finite entries")
        if not (np.diff(c) > 0).all():
            raise ValueError(f"{what}: codebook must be strictly increasing (sorted, no duplicates)")
    return cb


@jax.jit
def _encode(x: jax.Array, cb: jax.Array) -> jax.Array:
    mids = cb[:-1] * jnp.float32(0.5) + cb[1:] * jnp.float32(0.5)
    return jnp.sum(x[..., None] > mids, axis=-1, dtype=jnp.int32).astype(jnp.uint8)


def nuq_encode(x, codebook) -> jax.Array:
    """Index of the nearest codebook entry for every element (ties -> lower index); uint8, ``x.shape``.

    x: float array (non-finite values are rejected on concrete input; NaN encodes to 0 under jit).
    """
    x = C.check_float_input(x, "nuq_encode", min_ndim=0)
    C.check_finite(x, "nuq_encode")
    return _encode(x.astype(jnp.float32), check_codebook(codebook, "nuq_encode"))


def nuq_decode(codes, codebook, dtype=jnp.float32) -> jax.Array:
    """LUT decode ``codebook[codes]`` in ``dtype``."""
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"nuq_decode: codes must be integer, got dtype {codes.dtype}")
    return jnp.take(check_codebook(codebook, "nuq_decode"), codes.astype(jnp.int32), mode="clip").astype(dtype)


@functools.partial(jax.jit, static_argnames=("axis", "group_size", "qparam_dtype"))
def _nuq_core(x, codebook, valid_length, mask, *, axis, group_size, qparam_dtype):
    g = C.to_groups(x, axis, group_size, valid_length, mask)
    mn, mx, _, all_finite = C.masked_range(g)
    constant = mx == mn
    half_width = mx * jnp.float32(0.5) - mn * jnp.float32(0.5)
    scale, eff, flags = C.store_qparam(jnp.where(constant, jnp.float32(0), half_width), qparam_dtype, ~constant)
    offset = (mn * jnp.float32(0.5) + mx * jnp.float32(0.5)).astype(qparam_dtype)
    off_eff = offset.astype(jnp.float32)
    flags |= C.flag_if(~jnp.isfinite(off_eff), C.QuantStatus.ZERO_NONFINITE)
    status = C.finalize_status(flags, all_finite)
    safe = jnp.where(constant, jnp.float32(1), eff)
    normalized = jnp.where(constant[..., None], jnp.float32(0), C.exact_divide(g.values - off_eff[..., None], safe[..., None]))
    codes = _encode(normalized, codebook)
    keep = (status == 0)[..., None]
    if g.valid is not None:
        keep = keep & g.valid
    codes = jnp.where(keep, codes, jnp.uint8(0))
    out = NuqQuantized(C.from_groups(codes, g), C.qparam_from_groups(scale, g), C.qparam_from_groups(offset, g))
    return out, C.qparam_from_groups(status, g)


def quantize_nuq_with_status(x, codebook, axis: int = -1, group_size: int = 0, qparam_dtype=jnp.float16,
                             valid_length=None, mask=None):
    """Jit-safe normalized non-uniform quantization. Returns ``(NuqQuantized, status)``.

    Grouping arguments (``axis``, ``group_size``, ``valid_length``, ``mask``) as in
    :func:`kvquant_jax.quant.affine.quantize_affine_with_status`; ``codebook`` as in :func:`check_codebook`.
    """
    what = "quantize_nuq"
    x = C.check_float_input(x, what)
    cb = check_codebook(codebook, what)
    axis = C.normalize_axis(axis, x.ndim, what)
    group_size = C.resolve_group_size(x.shape[axis], group_size, valid_length is not None or mask is not None, what)
    return _nuq_core(x, cb, valid_length, mask, axis=axis, group_size=group_size,
                     qparam_dtype=C.canonical_qparam_dtype(qparam_dtype))


def quantize_nuq(x, codebook, axis: int = -1, group_size: int = 0, qparam_dtype=jnp.float16, valid_length=None,
                 mask=None) -> NuqQuantized:
    """Normalized non-uniform quantization; raises ``ValueError`` on concrete bad input (see module docstring)."""
    out, status = quantize_nuq_with_status(x, codebook, axis, group_size, qparam_dtype, valid_length, mask)
    if C.is_concrete(status):
        C.raise_for_status(status, "quantize_nuq")
    return out


def dequantize_nuq(codes, scale, offset, codebook, axis: int = -1, group_size: int = 0, dtype=jnp.float32):
    """``codebook[codes] * scale + offset`` with per-group scale/offset broadcast along ``axis``."""
    axis, g = C.decode_groups_setup(codes, {"scale": scale, "offset": offset}, axis, group_size, "dequantize_nuq")
    return C.grouped_decode(nuq_decode(codes, codebook), jnp.asarray(scale), jnp.asarray(offset), axis=axis,
                            group_size=g, shift_first=False, dtype=np.dtype(dtype))


def uniform_codebook(bits: int) -> jax.Array:
    """``2**bits`` evenly spaced signposts ``(2i - L + 1) / (L - 1)`` on ``[-1, 1]`` (correctly rounded float32)."""
    n = 2 ** C.check_bits(bits, 1, 8, "uniform_codebook")
    return C.exact_divide(jnp.arange(1 - n, n, 2, dtype=jnp.int32).astype(jnp.float32), n - 1)
