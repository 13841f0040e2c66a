"""Dense-and-sparse outlier split with per-vector thresholds (KVQuant, design notes 0x07D).

Semantics: FULL-VALUE REPLACEMENT with EXACT HOLES.  A coordinate kept in the sparse path stores its full value;
the dense path is made to decode to exactly 0 there (:func:`apply_holes`), so the reconstruction is
``where(kept, sparse_value, dense_decoded)`` (:func:`merge_dense_sparse`) -- never a full value added to an
unmasked dense approximation.  (No additive-correction variant is provided.)

Vectors are the 1-D slices along ``axis`` (a V token row for per-token thresholds, a K channel for per-channel
ones).  A coordinate is an outlier iff ``x < lower`` or ``x > upper``; ``lower``/``upper`` broadcast against
``x`` (per-vector thresholds: ``x.shape`` with ``axis`` -> 1; scalars allowed).

Fixed capacity per vector: at most ``capacity`` outliers are kept.  Overflow policy: the ``capacity`` outliers
of largest ``|x|`` are kept (ties -> lower coordinate); the others stay in the DENSE path (they are ordinary dense
values: the dense quantizer must cover them) and are counted in ``overflow``.  Kept slots are sorted by
ascending coordinate; unused slots hold index ``-1`` and value 0.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvquant_jax.quant import _common as C


class SparseOutliers(NamedTuple):
    """Fixed-capacity per-vector outliers (``...`` = ``x.shape`` without ``axis``).

    indices: int32 ``[..., capacity]`` coordinates along ``axis``, ascending, ``-1`` for unused slots.
    values: ``[..., capacity]`` full values in ``x.dtype`` (0 in unused slots).
    count: int32 ``[...]`` kept outliers.  overflow: int32 ``[...]`` outliers left in the dense path.
    """

    indices: jax.Array
    values: jax.Array
    count: jax.Array
    overflow: jax.Array


class DenseSparseSplit(NamedTuple):
    """dense: ``x`` with kept outliers set to 0; dense_mask: bool ``x.shape``, False exactly at kept outliers
    (pass it as ``mask=`` to a dense quantizer so kept outliers do not stretch its range); sparse: the outliers."""

    dense: jax.Array
    dense_mask: jax.Array
    sparse: SparseOutliers


def outlier_mask(x, lower, upper) -> jax.Array:
    """bool ``x.shape``: ``x < lower`` or ``x > upper``."""
    x = jnp.asarray(x)
    lo = jnp.asarray(lower).astype(x.dtype)
    hi = jnp.asarray(upper).astype(x.dtype)
    return (x < lo) | (x > hi)


def magnitude_thresholds(x, num_outliers: int, axis: int = -1):
    """Per-vector symmetric thresholds that flag at most ``num_outliers`` coordinates per vector.

    ``t`` = the ``(num_outliers + 1)``-th largest ``|x|`` of the vector, returned as ``(-t, t)`` with ``axis`` kept
    as size 1; strictly larger magnitudes are outliers (ties at ``t`` stay dense).
    """
    x = C.check_float_input(x, "magnitude_thresholds")
    axis = C.normalize_axis(axis, x.ndim, "magnitude_thresholds")
    n = x.shape[axis]
    if isinstance(num_outliers, bool) or not isinstance(num_outliers, int) or not 0 <= num_outliers < n:
        raise ValueError(f"magnitude_thresholds: num_outliers must be an int in [0, {n - 1}], got {num_outliers!r}")
    mag = jnp.moveaxis(jnp.abs(x), axis, -1)
    t = jax.lax.top_k(mag, num_outliers + 1)[0][..., -1:]
    t = jnp.moveaxis(t, -1, axis)
    return -t, t


def split_dense_sparse(x, lower, upper, capacity: int, axis: int = -1) -> DenseSparseSplit:
    """Split ``x`` into a dense part with exact holes and fixed-capacity sparse outliers along ``axis``.

    Args:
      x: float array, rank >= 1.  lower, upper: thresholds broadcastable to ``x``.
      capacity: static slots per vector (1 <= capacity <= x.shape[axis]).
    Returns:
      :class:`DenseSparseSplit`; see the module docstring for the overflow policy.
    """
    what = "split_dense_sparse"
    x = C.check_float_input(x, what)
    axis = C.normalize_axis(axis, x.ndim, what)
    n = x.shape[axis]
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= n:
        raise ValueError(f"{what}: capacity must be an int in [1, {n}], got {capacity!r}")
    C.check_finite(x, what)
    return _split_core(x, jnp.asarray(lower), jnp.asarray(upper), capacity=capacity, axis=axis)


@functools.partial(jax.jit, static_argnames=("capacity", "axis"))
def _split_core(x, lower, upper, *, capacity: int, axis: int) -> DenseSparseSplit:
    n = x.shape[axis]
    is_out = jnp.moveaxis(outlier_mask(x, lower, upper), axis, -1)
    xm = jnp.moveaxis(x, axis, -1)
    score = jnp.where(is_out, jnp.abs(xm).astype(jnp.float32), jnp.float32(-1))
    top_score, top_idx = jax.lax.top_k(score, capacity)             # largest |x| first, ties -> lower index
    used = top_score >= 0
    idx = jnp.sort(jnp.where(used, top_idx, jnp.int32(n)), axis=-1)  # ascending, unused (n) last
    used = idx < n
    indices = jnp.where(used, idx, jnp.int32(-1))
    values = jnp.where(used, jnp.take_along_axis(xm, jnp.minimum(idx, n - 1), axis=-1), jnp.zeros((), x.dtype))
    count = jnp.sum(used, axis=-1, dtype=jnp.int32)
    overflow = jnp.sum(is_out, axis=-1, dtype=jnp.int32) - count
    sparse = SparseOutliers(indices, values, count, overflow)
    kept = _kept_mask(indices, n)
    dense = jnp.moveaxis(jnp.where(kept, jnp.zeros((), x.dtype), xm), -1, axis)
    return DenseSparseSplit(dense, jnp.moveaxis(~kept, -1, axis), sparse)


def _kept_mask(indices: jax.Array, n: int) -> jax.Array:
    """bool ``[..., n]`` (axis last): coordinate is a kept outlier."""
    return jnp.any(indices[..., None, :] == jnp.arange(n, dtype=jnp.int32)[:, None], axis=-1)


def _scatter_values(sparse: SparseOutliers, n: int, dtype) -> jax.Array:
    """``[..., n]`` (axis last) with the kept full values at their coordinates and 0 elsewhere."""
    hit = sparse.indices[..., None, :] == jnp.arange(n, dtype=jnp.int32)[:, None]      # [..., n, cap]
    return jnp.sum(jnp.where(hit, sparse.values.astype(dtype)[..., None, :], jnp.zeros((), dtype)), axis=-1)


def _check_sparse(dense, sparse: SparseOutliers, axis: int, what: str):
    dense = jnp.asarray(dense)
    axis = C.normalize_axis(axis, dense.ndim, what)
    lead = tuple(jnp.moveaxis(dense, axis, -1).shape[:-1])
    if tuple(sparse.indices.shape[:-1]) != lead or sparse.values.shape != sparse.indices.shape:
        raise ValueError(f"{what}: sparse indices/values {sparse.indices.shape}/{sparse.values.shape} do not match "
                         f"dense {dense.shape} along axis {axis}")
    return dense, axis


@functools.partial(jax.jit, static_argnames=("axis", "add_values"))
def _holes_core(dense, sparse: SparseOutliers, *, axis: int, add_values: bool) -> jax.Array:
    dm = jnp.moveaxis(dense, axis, -1)
    n = dm.shape[-1]
    out = jnp.where(_kept_mask(sparse.indices, n), jnp.zeros((), dense.dtype), dm)
    if add_values:
        out = out + _scatter_values(sparse, n, dense.dtype)
    return jnp.moveaxis(out, -1, axis)


def apply_holes(dense_decoded, sparse: SparseOutliers, axis: int = -1) -> jax.Array:
    """Set the dense reconstruction to exactly 0 at every kept outlier coordinate."""
    dense, axis = _check_sparse(dense_decoded, sparse, axis, "apply_holes")
    return _holes_core(dense, sparse, axis=axis, add_values=False)


def sparse_to_dense(sparse: SparseOutliers, length: int, axis: int = -1, dtype=jnp.float32) -> jax.Array:
    """The sparse path alone as a dense array: full values at kept coordinates, 0 elsewhere (``axis`` of size
    ``length``)."""
    out = _scatter_values(sparse, int(length), dtype)
    return jnp.moveaxis(out, -1, C.normalize_axis(axis, out.ndim, "sparse_to_dense"))


def merge_dense_sparse(dense_decoded, sparse: SparseOutliers, axis: int = -1) -> jax.Array:
    """Full reconstruction: holes in the dense path plus full sparse values (= replacement at kept coordinates)."""
    dense, axis = _check_sparse(dense_decoded, sparse, axis, "merge_dense_sparse")
    return _holes_core(dense, sparse, axis=axis, add_values=True)
