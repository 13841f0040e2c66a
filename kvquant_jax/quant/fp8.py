"""FP8 (E4M3 ``float8_e4m3fn`` / E5M2 ``float8_e5m2``) with an external per-tensor or per-head scale (0x0A, 0x0AA).

``code = saturate(x / scale)`` cast to FP8 (round to nearest even), ``x_hat = float(code) * scale``.

Saturating cast: values whose magnitude exceeds the format's largest finite value (448 for E4M3, 57344 for E5M2)
are clipped to +-max before the cast (a plain cast would give NaN for ``e4m3fn``, which has no infinity, and
+-inf for E5M2).  +-Inf inputs therefore saturate too, and NaN stays NaN; the public :func:`quantize_fp8` rejects
non-finite input on concrete arrays instead.

The scale is metadata that must travel with the cache (0x0AA): :class:`Fp8Scale` carries the float32 value
(shape ``[]`` per tensor, ``[H]`` per head) and its ``source``: ``"uncalibrated"`` (the 1.0 default, a
representation choice, not an observed range fit), ``"warmup"`` or ``"calibrated"``.  ``Fp8Scale`` is a pytree
whose ``source`` is static metadata, so it can cross ``jit`` boundaries.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.quant import _common as C

FP8_FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
SCALE_SOURCES = ("uncalibrated", "warmup", "calibrated")


def fp8_dtype(fmt: str):
    """``"e4m3"`` -> ``jnp.float8_e4m3fn``, ``"e5m2"`` -> ``jnp.float8_e5m2``."""
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8 format must be one of {sorted(FP8_FORMATS)}, got {fmt!r}")
    return FP8_FORMATS[fmt]


def fp8_max(fmt: str) -> float:
    """Largest finite value of the format: 448.0 (e4m3) or 57344.0 (e5m2)."""
    return float(jnp.finfo(fp8_dtype(fmt)).max)


@dataclasses.dataclass(frozen=True)
class Fp8Scale:
    """An FP8 scale and where it came from.

    Attributes:
      value: float32 ``[]`` (per tensor) or ``[H]`` (per head); finite, positive, normal.
      source: "uncalibrated" | "warmup" | "calibrated" (static pytree metadata).
    """

    value: jax.Array
    source: str = "uncalibrated"

    def __post_init__(self):
        if self.source not in SCALE_SOURCES:
            raise ValueError(f"Fp8Scale.source must be one of {SCALE_SOURCES}, got {self.source!r}")

    @property
    def calibrated(self) -> bool:
        return self.source != "uncalibrated"


jax.tree_util.register_dataclass(Fp8Scale, data_fields=["value"], meta_fields=["source"])


def uncalibrated_fp8_scale(num_heads: int | None = None) -> Fp8Scale:
    """Scale 1.0 (per tensor, or ``[num_heads]`` ones), marked ``"uncalibrated"``."""
    shape = () if num_heads is None else (int(num_heads),)
    return Fp8Scale(jnp.ones(shape, jnp.float32), "uncalibrated")


def observe_absmax(x, head_axis: int | None = None) -> jax.Array:
    """float32 max|x| over everything (``head_axis=None``, shape ``[]``) or over all axes but ``head_axis`` (``[H]``)."""
    x = jnp.asarray(x)
    mag = jnp.abs(x.astype(jnp.float32))
    if head_axis is None:
        return jnp.max(mag)
    head_axis = C.normalize_axis(head_axis, x.ndim, "observe_absmax")
    return jnp.max(mag, axis=tuple(a for a in range(x.ndim) if a != head_axis))


def fp8_scale_from_absmax(amax, fmt: str = "e4m3", source: str = "warmup") -> Fp8Scale:
    """Scale that maps ``amax`` to the format's max: ``amax / fp8_max(fmt)`` (float32); ``amax == 0`` -> 1.0.

    ``amax`` is ``[]`` or ``[H]`` (see :func:`observe_absmax`); ``source`` is "warmup" or "calibrated".  On concrete
    input, a non-finite or negative ``amax`` or a resulting subnormal scale raises ``ValueError``.
    """
    if source not in ("warmup", "calibrated"):
        raise ValueError(f"fp8_scale_from_absmax: source must be 'warmup' or 'calibrated', got {source!r}")
    amax = jnp.asarray(amax, jnp.float32)
    value = jnp.where(amax == 0, jnp.float32(1), C.exact_divide(amax, fp8_max(fmt)))
    if C.is_concrete(amax):
        a = np.asarray(amax)
        if not np.isfinite(a).all() or (a < 0).any():
            raise ValueError("fp8_scale_from_absmax: amax must be finite and non-negative")
        _check_scale_value(value, "fp8_scale_from_absmax")
    return Fp8Scale(value, source)


def _check_scale_value(value, what: str) -> None:
    if C.is_concrete(value):
        v = np.asarray(value, dtype=np.float64)
        if not np.isfinite(v).all() or (v < np.finfo(np.float32).tiny).any():
            raise ValueError(f"{what}: scale must be finite, positive and a normal float32, got {v}")


def _broadcast_scale(scale, ndim: int, head_axis: int | None, what: str) -> jax.Array:
    value = jnp.asarray(scale.value if isinstance(scale, Fp8Scale) else scale, jnp.float32)
    if value.ndim == 0:
        return value
    if value.ndim != 1 or head_axis is None:
        raise ValueError(f"{what}: a per-head scale must be 1-D and needs head_axis; got shape {value.shape}, "
                         f"head_axis={head_axis}")
    head_axis = C.normalize_axis(head_axis, ndim, what)
    return value.reshape((1,) * head_axis + (-1,) + (1,) * (ndim - head_axis - 1))


def quantize_fp8(x, scale, fmt: str = "e4m3", head_axis: int | None = None) -> jax.Array:
    """Saturating FP8 encode: ``clip(x / scale, -max, max).astype(fp8)``.

    Args:
      x: float array, any rank, non-empty.
      scale: :class:`Fp8Scale` or float32 array, ``[]`` per tensor or ``[H]`` per head.
      fmt: "e4m3" or "e5m2".
      head_axis: the axis of ``x`` of size H a per-head scale is broadcast along (required for per-head).
    Returns:
      ``x.shape`` array of ``float8_e4m3fn`` / ``float8_e5m2``.  Pair it with the scale's ``source`` metadata.
    Raises:
      ValueError: bad format/shape (always); non-finite ``x`` or a non-positive/non-finite/subnormal scale
      (concrete inputs only).
    """
    what = "quantize_fp8"
    fp8_dtype(fmt)
    x = C.check_float_input(x, what, min_ndim=0)
    s = _broadcast_scale(scale, x.ndim, head_axis, what)
    C.check_finite(x, what)
    _check_scale_value(s, what)
    return _encode_fp8(x, s, fmt=fmt)


@functools.partial(jax.jit, static_argnames=("fmt",))
def _encode_fp8(x, scale, *, fmt: str) -> jax.Array:
    hi = jnp.float32(fp8_max(fmt))
    return jnp.clip(C.exact_divide(x.astype(jnp.float32), scale), -hi, hi).astype(fp8_dtype(fmt))


def dequantize_fp8(codes, scale, head_axis: int | None = None, dtype=jnp.float32) -> jax.Array:
    """``float(codes) * scale`` (scale ``[]`` or ``[H]`` along ``head_axis``), in ``dtype``."""
    codes = jnp.asarray(codes)
    s = _broadcast_scale(scale, codes.ndim, head_axis, "dequantize_fp8")
    return (codes.astype(jnp.float32) * s).astype(dtype)
