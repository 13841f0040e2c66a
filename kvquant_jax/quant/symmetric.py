"""Symmetric (zero-free) signed integer quantization: per-token rows (design notes 0x02A) and groups on any axis.

Alphabet: the *narrow* signed range ``q in [-qmax, qmax]``, ``qmax = 2**(bits-1) - 1``, ``2 <= bits <= 8``; codes
are ``int8``.  (Caches store them offset-binary, see :func:`kvquant_jax.quant.packing.to_offset_binary`.)

Semantics of one group ``x`` (a row, or ``group_size`` elements along ``axis``)::

    ideal  = max|x| / qmax                    (float32 arithmetic; exact single rounding of the real quotient)
    scale  = ideal rounded to qparam_dtype     (fp16 / bf16 / fp32, round-to-nearest-even) -- the STORED qparam
    codes  = clip(rint(x / float32(scale)), -qmax, qmax)     (rint: ties to even; the stored scale is re-read)
    x_hat  = codes * scale

* all-zero group (every element +-0): ``scale = 1`` (exact sentinel) and zero codes; nothing is divided by zero.
* non-zero group whose stored scale overflows (inf), underflows to 0, or is subnormal (below the dtype's smallest
  normal, unsafe on flush-to-zero hardware): rejected -- ``ValueError`` from the public functions on concrete
  inputs, a status flag from the ``*_with_status`` forms (see :mod:`kvquant_jax.quant._common` for the split).
* non-finite input: rejected the same way.  Empty input, a wrong rank, ``bits`` outside ``[2, 8]`` or an
  unsupported qparam dtype raise ``ValueError`` always (also under ``jit``).

Double rounding note: ``max|x|`` is exact and the float32 division is correctly rounded; since float32 carries
24 >= 2*11+2 significand bits, rounding that quotient again to fp16 (or bf16) gives the correctly rounded real
quotient, so the stored scale is bit-identical to a float64 reference.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.quant import _common as C


class SymmetricQuantized(NamedTuple):
    """``codes``: int8, same shape as ``x``; ``scale``: qparam dtype, ``x.shape`` with ``axis`` -> ``n_groups``
    (for :func:`quantize_symmetric_rows`: ``[M]``)."""

    codes: jax.Array
    scale: jax.Array


def symmetric_qmax(bits: int) -> int:
    """Largest code of the narrow signed alphabet: ``2**(bits-1) - 1``."""
    return 2 ** (C.check_bits(bits, 2, 8, "symmetric quantization") - 1) - 1


@functools.partial(jax.jit, static_argnames=("axis", "group_size", "qparam_dtype"))
def _symmetric_core(x, qmax, valid_length, mask, *, axis, group_size, qparam_dtype):
    """``qmax`` is a traced float32 scalar (one compilation serves every bit width)."""
    g = C.to_groups(x, axis, group_size, valid_length, mask)
    xv = g.values
    nz, mag, finite = C.nonzero_bits(xv), jnp.abs(xv), jnp.isfinite(xv)
    if g.valid is not None:
        nz, finite = nz & g.valid, finite | ~g.valid
        mag = jnp.where(g.valid, mag, jnp.float32(0))
    all_finite = jnp.all(finite, axis=-1)
    nonzero = jnp.any(nz, axis=-1)
    amax = jnp.max(mag, axis=-1)
    ideal = jnp.where(nonzero, C.exact_divide(amax, qmax), jnp.float32(1))
    scale, eff, flags = C.store_qparam(ideal, qparam_dtype, nonzero)
    status = C.finalize_status(flags, all_finite)
    q = jnp.clip(jnp.rint(C.exact_divide(xv, eff[..., None])), -qmax, qmax)
    keep = ((status == 0) & nonzero)[..., None]
    if g.valid is not None:
        keep = keep & g.valid
    codes = jnp.where(keep, q, jnp.float32(0)).astype(jnp.int8)
    return SymmetricQuantized(C.from_groups(codes, g), C.qparam_from_groups(scale, g)), C.qparam_from_groups(status, g)


def _prepare(x, bits, axis, group_size, qparam_dtype, partial_ok, what, ndim=None):
    x = C.check_float_input(x, what, ndim=ndim)
    C.check_bits(bits, 2, 8, what)
    axis = C.normalize_axis(axis, x.ndim, what)
    group_size = C.resolve_group_size(x.shape[axis], group_size, partial_ok, what)
    return x, jnp.float32(2 ** (bits - 1) - 1), dict(axis=axis, group_size=group_size, qparam_dtype=C.canonical_qparam_dtype(qparam_dtype))


def quantize_symmetric_with_status(x, bits: int = 8, axis: int = -1, group_size: int = 0,
                                   qparam_dtype=jnp.float32, valid_length=None, mask=None):
    """Jit-safe grouped symmetric quantization. Returns ``(SymmetricQuantized, status)``.

    Args:
      x: float array (fp16/bf16/fp32), any rank >= 1, non-empty.
      bits: 2..8 (static).
      axis: the quantized axis (static); groups are consecutive elements along it.
      group_size: elements per group along ``axis``; 0 = the whole axis (static).  A length that is not a multiple
        raises unless ``valid_length`` or ``mask`` is given (then the trailing group is partial, padding masked).
      qparam_dtype: scale storage dtype: ``jnp.float16``/``jnp.bfloat16``/``jnp.float32`` or "fp16"/"bf16"/"fp32".
      valid_length: optional int or int array broadcastable to ``x.shape`` without ``axis``; positions ``>=`` it
        along ``axis`` neither influence the scale nor get a code (their codes are 0).
      mask: optional bool array broadcastable to ``x.shape``; False elements are excluded like padding.
    Returns:
      ``(SymmetricQuantized(codes int8 x.shape, scale [x.shape with axis -> n_groups]), status int32 like scale)``.
      A group with no valid element is an all-zero group (scale 1).
    """
    x, qmax, static = _prepare(x, bits, axis, group_size, qparam_dtype,
                               valid_length is not None or mask is not None, "quantize_symmetric")
    return _symmetric_core(x, qmax, valid_length, mask, **static)


def quantize_symmetric(x, bits: int = 8, axis: int = -1, group_size: int = 0, qparam_dtype=jnp.float32,
                       valid_length=None, mask=None) -> SymmetricQuantized:
    """Grouped symmetric quantization (see :func:`quantize_symmetric_with_status` for the arguments).

    On concrete inputs raises ``ValueError`` for non-finite input and for non-zero groups whose stored scale
    overflows, underflows to zero or is subnormal.  Under ``jit`` those checks are skipped (use the status form).
    """
    out, status = quantize_symmetric_with_status(x, bits, axis, group_size, qparam_dtype, valid_length, mask)
    if C.is_concrete(status):
        C.raise_for_status(status, "quantize_symmetric")
    return out


def dequantize_symmetric(codes, scale, axis: int = -1, group_size: int = 0, dtype=jnp.float32) -> jax.Array:
    """``x_hat = codes * scale`` with the per-group scale broadcast back along ``axis``.

    codes: integer array (int8); scale: ``codes.shape`` with ``axis`` -> ``ceil(n / G)``; returns ``dtype``.
    """
    axis, g = C.decode_groups_setup(codes, {"scale": scale}, axis, group_size, "dequantize_symmetric")
    return C.grouped_decode(jnp.asarray(codes), jnp.asarray(scale), None, axis=axis, group_size=g, shift_first=False,
                            dtype=np.dtype(dtype))


def quantize_symmetric_rows_with_status(x, bits: int = 8, qparam_dtype=jnp.float32):
    """Jit-safe per-row form: ``x`` float ``[M, K]`` -> ``(SymmetricQuantized(codes int8 [M, K], scale [M]),
    status int32 [M])``; ``ok = status == 0``.  Rank, emptiness, bits and dtype are still checked statically."""
    x, qmax, static = _prepare(x, bits, -1, 0, qparam_dtype, False, "quantize_symmetric_rows", ndim=2)
    out, status = _symmetric_core(x, qmax, None, None, **static)
    return SymmetricQuantized(out.codes, out.scale[:, 0]), status[:, 0]


def quantize_symmetric_rows(x, bits: int = 8, qparam_dtype=jnp.float32) -> SymmetricQuantized:
    """Per-token symmetric quantization of activation rows (design notes 0x02A).

    Args:
      x: float ``[M, K]``, finite, non-empty (fp16/bf16/fp32).
      bits: 2..8; ``qmax = 2**(bits-1) - 1``.
      qparam_dtype: fp16 or fp32 (bf16 also accepted) scale storage.
    Returns:
      ``SymmetricQuantized(codes int8 [M, K], scale qparam_dtype [M])``; ``X ~= codes * scale[:, None]``.
    Raises:
      ValueError: wrong rank / empty / bad bits or dtype (always); non-finite input or a non-zero row whose stored
      scale overflows, underflows or is subnormal (concrete inputs only; under ``jit`` use
      :func:`quantize_symmetric_rows_with_status`).
    """
    out, status = quantize_symmetric_rows_with_status(x, bits, qparam_dtype)
    if C.is_concrete(status):
        C.raise_for_status(status, "quantize_symmetric_rows")
    return out


def dequantize_symmetric_rows(codes, scale, dtype=jnp.float32) -> jax.Array:
    """``codes [M, K] * scale[:, None]`` in ``dtype`` (default float32)."""
    codes = jnp.asarray(codes)
    if codes.ndim != 2 or jnp.shape(scale) != codes.shape[:1]:
        raise ValueError(f"dequantize_symmetric_rows: expected codes [M, K] and scale [M], got {codes.shape} and "
                         f"{jnp.shape(scale)}")
    return dequantize_symmetric(codes, jnp.asarray(scale)[:, None], axis=-1, group_size=0, dtype=dtype)
