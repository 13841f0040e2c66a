"""Shared machinery of the quantization primitives: status flags, argument checks, group views, qparam storage.

The jit-safe / raising split
----------------------------
Every quantizer exists in two forms:

* ``quantize_*_with_status(...) -> (quantized, status)``: a pure, jit-able function.  ``status`` is an int32 array
  of :class:`QuantStatus` bit flags, one per qparam group (same shape as the scale), ``0`` meaning OK.  Groups with
  a non-zero status have all-zero codes; their qparams are whatever the arithmetic produced (do not decode them).
* ``quantize_*(...)``: the public function.  Static problems (rank, emptiness, ``bits``, dtypes, group sizes)
  raise ``ValueError`` always, also while tracing.  Value problems (NaN/Inf, a scale that overflows, underflows to
  zero or is subnormal) can only be seen on concrete arrays: when every array argument is concrete the public
  function raises ``ValueError`` naming the problem; under ``jit`` (tracers) it cannot raise and returns the same
  values as the ``_with_status`` form without the flags.  Callers that quantize inside ``jit`` and must not accept
  a bad group should call the ``_with_status`` form and act on ``status``.

All qparam arithmetic runs in float32 (inputs in fp16/bf16/fp32 are widened exactly), whatever the JAX x64 mode.
"""
from __future__ import annotations

import enum
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.quant.dtypes import DTYPES
from kvquant_jax.quant.tracing import is_tracer

QPARAM_DTYPES = {name: np.dtype(d) for name, d in DTYPES.items()}


class QuantStatus(enum.IntFlag):
    """Per-group status bits returned by the ``*_with_status`` quantizers (int32 arrays; 0 = OK)."""

    OK = 0
    NONFINITE_INPUT = 1      # the group holds NaN or +-Inf
    SCALE_OVERFLOW = 2       # the stored scale (or the range it is derived from) is not finite
    SCALE_UNDERFLOW = 4      # a non-zero range whose stored scale rounded to zero
    SCALE_SUBNORMAL = 8      # stored scale below finfo(qparam dtype).tiny: unsafe under flush-to-zero
    CONSTANT_RANGE = 16      # constant (or too narrow) group rejected by a "raise" degenerate policy (QServe)
    ZERO_NONFINITE = 32      # the stored zero-point / min / offset is not finite


def describe_status(status) -> list[str]:
    """Names of the flags set anywhere in a concrete ``status`` array (empty list when all groups are OK)."""
    combined = int(np.bitwise_or.reduce(np.asarray(status, dtype=np.int64).ravel(), initial=0))
    return [flag.name for flag in QuantStatus if flag and combined & flag]


_STATUS_MESSAGES = {
    QuantStatus.NONFINITE_INPUT: "non-finite input (NaN/Inf)",
    QuantStatus.SCALE_OVERFLOW: "stored scale overflows the qparam dtype (non-finite)",
    QuantStatus.SCALE_UNDERFLOW: "stored scale underflows to zero for a non-zero range",
    QuantStatus.SCALE_SUBNORMAL: "stored scale is subnormal (FTZ-unsafe)",
    QuantStatus.CONSTANT_RANGE: "constant or too narrow range (degenerate group) under policy 'raise'",
    QuantStatus.ZERO_NONFINITE: "stored zero-point/min/offset is not finite",
}




def is_concrete(*arrays) -> bool:
    """True when no argument is a JAX tracer (so values can be inspected and errors raised)."""
    return not is_tracer(arrays)


def raise_for_status(status, what: str) -> None:
    """Raise ``ValueError`` describing every flag set in a concrete ``status`` array; return silently if all OK."""
    status = np.asarray(status)
    bad = status != 0
    if not bad.any():
        return
    combined = int(np.bitwise_or.reduce(status[bad].astype(np.int64)))
    problems = [msg for flag, msg in _STATUS_MESSAGES.items() if combined & flag]
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{what}: {'; '.join(problems)} in {int(bad.sum())} group(s), first at group index {first}")


def check_bits(bits, lo: int, hi: int, what: str) -> int:
    """``bits`` must be a Python int (not bool) in ``[lo, hi]``."""
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)) or not lo <= bits <= hi:
        raise ValueError(f"{what}: bits must be an integer in [{lo}, {hi}], got {bits!r}")
    return int(bits)


def canonical_qparam_dtype(dtype) -> np.dtype:
    """Accept ``jnp.float16``/``"fp16"``/``np.float16`` (and bf16, fp32); return the NumPy dtype."""
    if isinstance(dtype, str) and dtype in QPARAM_DTYPES:
        return QPARAM_DTYPES[dtype]
    try:
        d = np.dtype(dtype)
    except TypeError as err:
        raise ValueError(f"qparam_dtype must be one of fp16, bf16, fp32; got {dtype!r}") from err
    if d not in QPARAM_DTYPES.values():
        raise ValueError(f"qparam_dtype must be one of fp16, bf16, fp32; got {d}")
    return d


def check_float_input(x, what: str, ndim: int | None = None, min_ndim: int = 1) -> jax.Array:
    """Convert to a JAX array and check it is floating, of the required rank and non-empty (static checks)."""
    if not isinstance(x, jax.Array):
        x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{what}: expected a floating-point array, got dtype {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{what}: expected a {ndim}-D array, got rank {x.ndim} with shape {x.shape}")
    if x.ndim < min_ndim:
        raise ValueError(f"{what}: expected rank >= {min_ndim}, got rank {x.ndim}")
    if x.size == 0:
        raise ValueError(f"{what}: empty input of shape {x.shape}")
    return x


def check_finite(x, what: str) -> None:
    """Raise ``ValueError`` if a concrete ``x`` holds NaN/Inf (no-op on tracers)."""
    if is_concrete(x) and not bool(np.isfinite(np.asarray(x, dtype=np.float64)).all()):
        raise ValueError(f"{what}: non-finite input (NaN/Inf)")


def normalize_axis(axis: int, ndim: int, what: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ValueError(f"{what}: axis {axis!r} out of range for rank {ndim}")
    return int(axis) % ndim


def resolve_group_size(length: int, group_size: int, partial_ok: bool, what: str) -> int:
    """``group_size`` 0 means the whole axis.  A partial trailing group is rejected unless ``partial_ok``."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 0:
        raise ValueError(f"{what}: group_size must be a non-negative integer, got {group_size!r}")
    g = int(group_size) or length
    if length % g and not partial_ok:
        raise ValueError(f"{what}: axis length {length} is not a multiple of group_size {g} (partial trailing "
                         f"group); pass valid_length to mask it or choose a dividing group size")
    return g


class Groups(NamedTuple):
    """A float32 view ``[..., n_groups, G]`` of ``x`` with the quantized axis moved last and split into groups.

    ``valid`` is a bool array of the same shape, or ``None`` when every element is valid.  Padding of a partial
    trailing group is invalid.  ``axis``/``length``/``size`` are static Python ints.
    """

    values: jax.Array
    valid: jax.Array | None
    axis: int
    length: int
    size: int


def to_groups(x: jax.Array, axis: int, group_size: int, valid_length=None, mask=None) -> Groups:
    """Group ``x`` along ``axis`` (already normalized) in groups of ``group_size`` (already resolved)."""
    n = x.shape[axis]
    n_groups = -(-n // group_size)
    pad = n_groups * group_size - n
    xm = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    lead = xm.shape[:-1]
    valid = None
    if mask is not None:
        m = jnp.broadcast_to(jnp.asarray(mask, dtype=jnp.bool_), x.shape)
        valid = jnp.moveaxis(m, axis, -1)
    if valid_length is not None:
        vl = jnp.broadcast_to(jnp.asarray(valid_length, dtype=jnp.int32), lead)
        in_range = jnp.arange(n, dtype=jnp.int32) < vl[..., None]
        valid = in_range if valid is None else valid & in_range
    if pad:
        xm = jnp.pad(xm, [(0, 0)] * len(lead) + [(0, pad)])
        pad_valid = jnp.arange(n + pad) < n
        valid = jnp.broadcast_to(pad_valid, lead + (n + pad,)) if valid is None else jnp.pad(
            valid, [(0, 0)] * len(lead) + [(0, pad)])
    shape = lead + (n_groups, group_size)
    return Groups(xm.reshape(shape), None if valid is None else valid.reshape(shape), axis, n, group_size)


def from_groups(grouped: jax.Array, g: Groups) -> jax.Array:
    """Inverse of :func:`to_groups` for an element-wise result (codes): drop padding, move the axis back."""
    flat = grouped.reshape(grouped.shape[:-2] + (-1,))[..., : g.length]
    return jnp.moveaxis(flat, -1, g.axis)


def qparam_from_groups(p: jax.Array, g: Groups) -> jax.Array:
    """``[..., n_groups]`` per-group qparam -> the layout of ``x`` with ``axis`` replaced by ``n_groups``."""
    return jnp.moveaxis(p, -1, g.axis)


def expand_qparam(p: jax.Array, axis: int, group_size: int, length: int) -> jax.Array:
    """Repeat a per-group qparam (``axis`` of size ``n_groups``) ``group_size`` times along ``axis``, crop."""
    rep = jnp.repeat(p, group_size, axis=axis)
    return jax.lax.slice_in_dim(rep, 0, length, axis=axis)


@functools.partial(jax.jit, static_argnames=("axis", "group_size", "shift_first", "dtype"))
def grouped_decode(values, scale, shift, *, axis: int, group_size: int, shift_first: bool, dtype):
    """Affine decode with per-group qparams broadcast back along ``axis``, in float32, cast to ``dtype``.

    ``values``: codes (or LUT values) of the full shape; ``scale``/``shift``: ``axis`` of size ``n_groups``
    (``shift`` may be None).  ``shift_first``: ``(v - shift) * scale``; otherwise ``v * scale + shift``.
    """
    n = values.shape[axis]
    v = values.astype(jnp.float32)
    s = expand_qparam(scale.astype(jnp.float32), axis, group_size, n)
    if shift is None:
        return (v * s).astype(dtype)
    z = expand_qparam(shift.astype(jnp.float32), axis, group_size, n)
    return ((v - z) * s if shift_first else v * s + z).astype(dtype)


def decode_groups_setup(codes, params, axis: int, group_size: int, what: str):
    """Validate a decoder's arrays and return ``(axis, group_size)`` resolved against the codes' shape."""
    codes = jnp.asarray(codes)
    if codes.ndim == 0:
        raise ValueError(f"{what}: codes must have rank >= 1")
    axis = normalize_axis(axis, codes.ndim, what)
    n = codes.shape[axis]
    g = resolve_group_size(n, group_size, partial_ok=True, what=what)
    n_groups = -(-n // g)
    want = codes.shape[:axis] + (n_groups,) + codes.shape[axis + 1:]
    for name, p in params.items():
        if tuple(jnp.shape(p)) != want:
            raise ValueError(f"{what}: {name} has shape {tuple(jnp.shape(p))}, expected {want} for codes "
                             f"{codes.shape} with axis={axis}, group_size={g}")
    return axis, g


def masked_range(g: Groups):
    """Per-group ``(min, max, any_valid, all_finite)``; invalid elements are ignored (``min=max=0`` if none)."""
    x = g.values
    finite = jnp.isfinite(x)
    if g.valid is None:
        mn, mx = jnp.min(x, axis=-1), jnp.max(x, axis=-1)
        any_valid = jnp.ones(mn.shape, jnp.bool_)
        all_finite = jnp.all(finite, axis=-1)
    else:
        mn = jnp.min(jnp.where(g.valid, x, jnp.inf), axis=-1)
        mx = jnp.max(jnp.where(g.valid, x, -jnp.inf), axis=-1)
        any_valid = jnp.any(g.valid, axis=-1)
        all_finite = jnp.all(finite | ~g.valid, axis=-1)
        mn = jnp.where(any_valid, mn, jnp.float32(0))
        mx = jnp.where(any_valid, mx, jnp.float32(0))
    return mn, mx, any_valid, all_finite


def nonzero_bits(x: jax.Array) -> jax.Array:
    """Element is not +-0, decided on the float32 bit pattern (so denormals-are-zero hardware cannot hide it)."""
    return (jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) & jnp.uint32(0x7FFFFFFF)) != 0


def store_qparam(ideal: jax.Array, dtype: np.dtype, nonzero: jax.Array):
    """Round a float32 scale to the qparam dtype; flag overflow, underflow to zero and subnormals.

    Returns ``(stored, effective_float32, flags)``.  ``nonzero`` marks groups whose real scale is non-zero
    (for those a stored zero is an underflow).
    """
    stored = ideal.astype(dtype)
    eff = stored.astype(jnp.float32)
    tiny = jnp.float32(jnp.finfo(dtype).tiny)
    flags = jnp.where(~jnp.isfinite(eff), jnp.int32(QuantStatus.SCALE_OVERFLOW), jnp.int32(0))
    flags |= jnp.where(nonzero & (eff == 0), jnp.int32(QuantStatus.SCALE_UNDERFLOW), jnp.int32(0))
    flags |= jnp.where((eff != 0) & (jnp.abs(eff) < tiny), jnp.int32(QuantStatus.SCALE_SUBNORMAL), jnp.int32(0))
    return stored, eff, flags


def exact_divide(a: jax.Array, b) -> jax.Array:
    """Correctly rounded float32 ``a / b`` with ``b`` broadcast to ``a``'s shape.

    XLA's algebraic simplifier rewrites a division by a constant or by a broadcast into a multiplication by the
    reciprocal, which is NOT correctly rounded (1 ulp off for ~1/3 of float32 quotients).  Stored scales and codes
    are defined by true division, so the broadcast divisor is hidden behind an optimization barrier.
    """
    b = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, jnp.float32), a.shape))
    return a / b


def flag_if(cond: jax.Array, flag: QuantStatus) -> jax.Array:
    return jnp.where(cond, jnp.int32(flag), jnp.int32(0))


def finalize_status(flags: jax.Array, all_finite: jax.Array) -> jax.Array:
    """Non-finite input dominates: report it alone instead of the scale problems it causes."""
    return jnp.where(all_finite, flags, jnp.int32(QuantStatus.NONFINITE_INPUT))
