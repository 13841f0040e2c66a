"""Asymmetric (affine) group quantization along any axis with any group size (design notes 0x02C, 0x06, 0x04A).

Unsigned codes ``u in [0, Q]``, ``Q = 2**bits - 1``, ``1 <= bits <= 8``, stored ``uint8``.  The group layout is
chosen by ``axis`` and ``group_size`` (0 = the whole axis); for ``x: [B, H, T, D]``:

    per-tensor              x.reshape(-1), axis=0, group_size=0
    per-token (per head)    axis=3, group_size=0            scale [B, H, T, 1]
    per-token-group         axis=3, group_size=G_d          scale [B, H, T, D // G_d]
    per-channel             axis=2, group_size=0            scale [B, H, 1, D]
    per-channel over G tok. axis=2, group_size=G            scale [B, H, T // G, D]   (KIVI keys)
    per-head                x moved to [B, H, T*D], axis=2

Two zero conventions (``zero=``):

* ``"min"`` (KIVI): ``scale = (max - min) / Q`` and ``min`` are both stored in the qparam dtype (round to nearest
  even); ``u = clip(rint((x - min_s) / scale_s), 0, Q)``; ``x_hat = u * scale + min``.  A stored min that is
  zero is always ``+0`` (a group holding both ``-0`` and ``+0``, or a tiny negative min that underflows in the
  qparam dtype, would otherwise store a platform-dependent sign bit).
* ``"int"`` (integer zero-point): the range is first widened to contain 0 (``lo = min(min, 0)``,
  ``hi = max(max, 0)``) so that 0.0 is exactly representable and the zero-point lies in the alphabet;
  ``scale = (hi - lo) / Q`` stored; ``z = clip(rint(-lo / scale_s), 0, Q)`` stored ``uint8``;
  ``u = clip(rint(x / scale_s) + z, 0, Q)``; ``x_hat = (u - z) * scale``.

Qparams are derived in float32 (``max - min`` is one float32 subtraction), so a stored scale may differ from a
float64 reference by at most one unit in the last place of the qparam dtype; codes always use the STORED qparams.
Inside the stored range the round-trip error is at most ``scale / 2`` (plus float32 rounding); elements outside it
(possible only through qparam rounding) are clipped.

Constant groups (``max == min``, including all-zero groups and, for ``"int"``, only the all-zero group because
the range contains 0): ``scale = 1`` (exact sentinel), codes 0, and ``min = the constant`` (``"min"``; decodes to
the constant rounded to the qparam dtype, i.e. exactly when it is representable) or ``z = 0`` (``"int"``; decodes
to exactly 0).  A group with no valid element is a constant group at 0.

Partial trailing groups: rejected with ``ValueError`` unless ``valid_length`` (or ``mask``) is given; then masked
elements never influence qparams and get code 0.  Non-constant groups whose stored scale overflows, underflows to
zero or is subnormal, and non-finite stored mins / non-finite inputs, are rejected (``ValueError`` on concrete
inputs, status flags in :func:`quantize_affine_with_status`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.quant import _common as C

ZERO_CONVENTIONS = ("min", "int")


class AffineQuantized(NamedTuple):
    """``codes``: uint8, ``x.shape``; ``scale``: qparam dtype, ``x.shape`` with ``axis`` -> ``n_groups``;
    ``zero_or_min``: same shape as scale -- the floating min (qparam dtype) for ``zero="min"``, the integer
    zero-point (uint8) for ``zero="int"``."""

    codes: jax.Array
    scale: jax.Array
    zero_or_min: jax.Array


def affine_qmax(bits: int) -> int:
    """Largest unsigned code ``2**bits - 1``."""
    return 2 ** C.check_bits(bits, 1, 8, "affine quantization") - 1


@functools.partial(jax.jit, static_argnames=("axis", "group_size", "qparam_dtype", "zero"))
def _affine_core(x, qmax, valid_length, mask, *, axis, group_size, qparam_dtype, zero):
    """``qmax`` is a traced float32 scalar (one compilation serves every bit width)."""
    g = C.to_groups(x, axis, group_size, valid_length, mask)
    xv = g.values
    mn, mx, _, all_finite = C.masked_range(g)
    if zero == "int":
        mn, mx = jnp.minimum(mn, jnp.float32(0)), jnp.maximum(mx, jnp.float32(0))
    constant = mx == mn
    width = mx - mn
    ideal = jnp.where(constant, jnp.float32(1), C.exact_divide(width, qmax))
    scale, eff, flags = C.store_qparam(ideal, qparam_dtype, ~constant)
    flags |= C.flag_if(~constant & ~jnp.isfinite(width), C.QuantStatus.SCALE_OVERFLOW)
    if zero == "min":
        zero_stored = mn.astype(qparam_dtype)
        # canonical +0: a group holding both -0 and +0 has no defined min sign (XLA and NumPy pick differently)
        zero_stored = jnp.where(zero_stored == 0, jnp.zeros_like(zero_stored), zero_stored)
        flags |= C.flag_if(~jnp.isfinite(zero_stored.astype(jnp.float32)), C.QuantStatus.ZERO_NONFINITE)
        u = jnp.rint(C.exact_divide(xv - zero_stored.astype(jnp.float32)[..., None], eff[..., None]))
    else:
        zp = jnp.clip(jnp.rint(C.exact_divide(-mn, eff)), 0, qmax)
        zero_stored = jnp.where(constant | ~jnp.isfinite(zp), jnp.float32(0), zp).astype(jnp.uint8)
        u = jnp.rint(C.exact_divide(xv, eff[..., None])) + zero_stored.astype(jnp.float32)[..., None]
    status = C.finalize_status(flags, all_finite)
    keep = ((status == 0) & ~constant)[..., None]
    if g.valid is not None:
        keep = keep & g.valid
    codes = jnp.where(keep, jnp.clip(u, 0, qmax), jnp.float32(0)).astype(jnp.uint8)
    out = AffineQuantized(C.from_groups(codes, g), C.qparam_from_groups(scale, g), C.qparam_from_groups(zero_stored, g))
    return out, C.qparam_from_groups(status, g)


def quantize_affine_with_status(x, bits: int, axis: int = -1, group_size: int = 0, qparam_dtype=jnp.float16,
                                zero: str = "min", valid_length=None, mask=None):
    """Jit-safe affine group quantization. Returns ``(AffineQuantized, status)``.

    Args:
      x: float array (fp16/bf16/fp32), rank >= 1, non-empty.
      bits: 1..8 (static).
      axis, group_size: the grouped axis and elements per group (0 = whole axis), static.
      qparam_dtype: fp16 (default) / bf16 / fp32 storage of scale (and of min for ``zero="min"``).
      zero: "min" (KIVI, floating min) or "int" (integer zero-point), static.
      valid_length: optional int / int array broadcastable to ``x.shape`` without ``axis``; positions ``>=`` it
        along ``axis`` are excluded from qparams and get code 0.  Required for a partial trailing group.
      mask: optional bool array broadcastable to ``x.shape``; False elements are excluded likewise.
    Returns:
      ``(AffineQuantized(codes uint8, scale, zero_or_min), status int32 [scale.shape])``.
    """
    what = "quantize_affine"
    x = C.check_float_input(x, what)
    bits = C.check_bits(bits, 1, 8, what)
    if zero not in ZERO_CONVENTIONS:
        raise ValueError(f"{what}: zero must be one of {ZERO_CONVENTIONS}, got {zero!r}")
    axis = C.normalize_axis(axis, x.ndim, what)
    group_size = C.resolve_group_size(x.shape[axis], group_size, valid_length is not None or mask is not None, what)
    return _affine_core(x, jnp.float32(2 ** bits - 1), valid_length, mask, axis=axis, group_size=group_size,
                        qparam_dtype=C.canonical_qparam_dtype(qparam_dtype), zero=zero)


def quantize_affine(x, bits: int, axis: int = -1, group_size: int = 0, qparam_dtype=jnp.float16, zero: str = "min",
                    valid_length=None, mask=None) -> AffineQuantized:
    """Affine group quantization (arguments as :func:`quantize_affine_with_status`).

    Raises ``ValueError`` on static problems always and, on concrete inputs, on non-finite values and on
    non-representable stored qparams.  Under ``jit`` the value checks are skipped.
    """
    out, status = quantize_affine_with_status(x, bits, axis, group_size, qparam_dtype, zero, valid_length, mask)
    if C.is_concrete(status):
        C.raise_for_status(status, "quantize_affine")
    return out


def dequantize_affine(codes, scale, zero_or_min, axis: int = -1, group_size: int = 0, zero: str = "min",
                      dtype=jnp.float32) -> jax.Array:
    """Decode: ``u * scale + min`` (``zero="min"``) or ``(u - z) * scale`` (``zero="int"``), in ``dtype``.

    codes: uint8 ``[..., n, ...]``; scale, zero_or_min: ``codes.shape`` with ``axis`` -> ``ceil(n / group_size)``.
    """
    what = "dequantize_affine"
    if zero not in ZERO_CONVENTIONS:
        raise ValueError(f"{what}: zero must be one of {ZERO_CONVENTIONS}, got {zero!r}")
    axis, g = C.decode_groups_setup(codes, {"scale": scale, "zero_or_min": zero_or_min}, axis, group_size, what)
    return C.grouped_decode(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(zero_or_min), axis=axis, group_size=g,
                            shift_first=zero == "int", dtype=np.dtype(dtype))
