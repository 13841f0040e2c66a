"""QServe per-(token, head) asymmetric INT4 with a FLOATING fp16 offset (design notes 0x09C).

For one token's head vector ``a`` (the elements along ``axis``, normally head_dim)::

    ideal_scale = (max(a) - min(a)) / 15                 float32
    scale       = fp16(ideal_scale)                       stored
    offset      = fp16(-min(a) / ideal_scale)             stored; NOT rounded to an integer, NOT clamped to [0, 15]
    codes       = clip(rint(a / float(scale) + float(offset)), 0, 15)      uint8 (the stored qparams are re-read)
    decoded     = (codes - offset) * scale

The offset is a floating value: for a positive-only range such as ``[1, 2]`` it is ``-15``, outside the code
alphabet, and clamping it would destroy the range; only the codes are clipped.  This is not the integer
zero-point convention of :mod:`kvquant_jax.quant.affine`.  Large ``|offset|`` (a range far from zero relative to
its width) loses fp16 precision in the offset itself; only a non-finite offset is rejected, as in the reference.

Degenerate heads (the reference rejects them; QServe's source does not define a fallback), ``degenerate=``:

* ``"raise"`` (default): a constant head (max == min) is flagged ``CONSTANT_RANGE``; a non-constant head whose
  stored scale underflows to 0 or is subnormal (width < 15 * fp16 tiny ~ 9.2e-4) is flagged
  ``SCALE_UNDERFLOW``/``SCALE_SUBNORMAL``.  The public function raises ``ValueError`` on concrete inputs.
* ``"sentinel"`` (a kvquant_jax extension, not QServe's): such heads store ``scale = 1``,
  ``offset = fp16(-(min + max) / 2)`` and codes 0, so they decode to the head's midpoint rounded to fp16 (exactly
  the constant for a constant head, error <= width / 2 + fp16 rounding otherwise).  Overflowing scales and
  non-finite offsets are still rejected.

Non-finite input is rejected under both policies.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.quant import _common as C

QSERVE_QMAX = 15
DEGENERATE_POLICIES = ("raise", "sentinel")


class QServeQuantized(NamedTuple):
    """``codes``: uint8 in [0, 15], ``x.shape``; ``scale``, ``offset``: fp16, ``x.shape`` without ``axis``."""

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array


@functools.partial(jax.jit, static_argnames=("axis", "qparam_dtype", "degenerate"))
def _qserve_core(x, *, axis, qparam_dtype, degenerate):
    g = C.to_groups(x, axis, x.shape[axis])
    mn, mx, _, all_finite = C.masked_range(g)
    width = mx - mn
    constant = width == 0
    ideal = C.exact_divide(width, QSERVE_QMAX)
    scale, eff, flags = C.store_qparam(jnp.where(constant, jnp.float32(0), ideal), qparam_dtype, ~constant)
    flags |= C.flag_if(~constant & ~jnp.isfinite(width), C.QuantStatus.SCALE_OVERFLOW)
    too_narrow = (flags & (C.QuantStatus.SCALE_UNDERFLOW | C.QuantStatus.SCALE_SUBNORMAL)) != 0
    offset = jnp.where(constant, jnp.float32(0), C.exact_divide(-mn, ideal))
    if degenerate == "raise":
        flags |= C.flag_if(constant, C.QuantStatus.CONSTANT_RANGE)
        degenerate_head = constant
    else:
        degenerate_head = constant | too_narrow
        flags = jnp.where(degenerate_head, flags & C.QuantStatus.SCALE_OVERFLOW, flags)
        scale = jnp.where(degenerate_head, jnp.float32(1), scale.astype(jnp.float32)).astype(qparam_dtype)
        eff = scale.astype(jnp.float32)
        offset = jnp.where(degenerate_head, -(mn + width * jnp.float32(0.5)), offset)
    offset = offset.astype(qparam_dtype)
    off_eff = offset.astype(jnp.float32)
    flags |= C.flag_if(~jnp.isfinite(off_eff), C.QuantStatus.ZERO_NONFINITE)
    status = C.finalize_status(flags, all_finite)
    u = jnp.clip(jnp.rint(C.exact_divide(g.values, eff[..., None]) + off_eff[..., None]), 0, QSERVE_QMAX)
    keep = ((status == 0) & ~degenerate_head)[..., None]
    codes = jnp.where(keep, u, jnp.float32(0)).astype(jnp.uint8)
    return QServeQuantized(C.from_groups(codes, g), scale[..., 0], offset[..., 0]), status[..., 0]


def quantize_qserve_with_status(x, axis: int = -1, degenerate: str = "raise", qparam_dtype=jnp.float16):
    """Jit-safe QServe KV4 quantization of every vector along ``axis``.

    Args:
      x: float ``[..., D, ...]`` (e.g. ``[B, T, Hkv, D]`` with ``axis=-1``), non-empty.
      axis: the head-dim axis (static); one (scale, offset) pair per vector along it.
      degenerate: "raise" or "sentinel" (static), see the module docstring.
      qparam_dtype: storage of scale/offset; fp16 is QServe's ABI (default).
    Returns:
      ``(QServeQuantized(codes uint8 x.shape, scale, offset [x.shape without axis]), status int32 like scale)``.
    """
    what = "quantize_qserve"
    x = C.check_float_input(x, what)
    if degenerate not in DEGENERATE_POLICIES:
        raise ValueError(f"{what}: degenerate must be one of {DEGENERATE_POLICIES}, got {degenerate!r}")
    axis = C.normalize_axis(axis, x.ndim, what)
    return _qserve_core(x, axis=axis, qparam_dtype=C.canonical_qparam_dtype(qparam_dtype), degenerate=degenerate)


def quantize_qserve(x, axis: int = -1, degenerate: str = "raise", qparam_dtype=jnp.float16) -> QServeQuantized:
    """QServe KV4 quantization (arguments as :func:`quantize_qserve_with_status`).

    Raises ``ValueError`` on concrete inputs that hold non-finite values, constant heads (policy "raise"),
    non-representable scales or non-finite offsets; under ``jit`` those checks are skipped.
    """
    out, status = quantize_qserve_with_status(x, axis, degenerate, qparam_dtype)
    if C.is_concrete(status):
        C.raise_for_status(status, "quantize_qserve")
    return out


def dequantize_qserve(codes, scale, offset, axis: int = -1, dtype=jnp.float32) -> jax.Array:
    """``(codes - offset) * scale`` with scale/offset (``codes.shape`` without ``axis``) broadcast along ``axis``."""
    codes = jnp.asarray(codes)
    axis = C.normalize_axis(axis, codes.ndim, "dequantize_qserve")
    want = codes.shape[:axis] + codes.shape[axis + 1:]
    if jnp.shape(scale) != want or jnp.shape(offset) != want:
        raise ValueError(f"dequantize_qserve: scale/offset shapes {jnp.shape(scale)}/{jnp.shape(offset)} do not "
                         f"match codes {codes.shape} without axis {axis}: {want}")
    s, o = jnp.expand_dims(jnp.asarray(scale), axis), jnp.expand_dims(jnp.asarray(offset), axis)
    return C.grouped_decode(codes, s, o, axis=axis, group_size=codes.shape[axis], shift_first=True,
                            dtype=np.dtype(dtype))
