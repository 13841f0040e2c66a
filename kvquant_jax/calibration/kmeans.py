"""Sensitivity-weighted 1-D k-means for non-uniform KV codebooks (design notes 0x07C), in JAX.

Objective: ``min_c sum_i w_i (x_i - c[a_i])^2`` over ``k = 2**bits`` signposts, ``a_i`` the nearest signpost with
the same tie rule as :func:`kvquant_jax.quant.nuq.nuq_encode` (a point exactly on a midpoint goes to the LOWER
signpost), so the clusters the solver optimizes are exactly the runtime code regions.  ``w_i`` is the diagonal
Fisher information of the activation (squared gradient of the LM loss), or 1 for unweighted k-means.

Algorithm: ``n_init`` weighted k-means++ seedings (point ``i`` is drawn with probability ``w_i D_i^2``, ``D_i`` the
distance to the nearest chosen centre), each refined by Lloyd iterations (assignment by ``searchsorted`` over the
sorted midpoints, centre = weighted mean of its cluster, an empty cluster keeps its centre) until no centre moves
more than ``tol`` (relative) or ``max_iter`` iterations; the run of lowest weighted SSE wins.  The points are
pre-aggregated into fine equal-width bins (see :func:`weighted_kmeans`), so a layer's million calibration values
cost one pass.  Binning, seeding and Lloyd are jitted functions of ``(x, w, key)``: a fixed seed gives
bit-identical codebooks.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.quant.nuq import check_codebook


class KMeansResult(NamedTuple):
    """``centers``: float32 ``[k]`` strictly increasing; ``sse``: weighted SSE of the returned centres;
    ``iterations``: Lloyd iterations of the winning run; ``points``: number of input points."""

    centers: np.ndarray
    sse: float
    iterations: int
    points: int


def assign(x: jax.Array, centers_sorted: jax.Array) -> jax.Array:
    """Index of the nearest centre (ties -> lower), centres sorted ascending (the nuq encode rule)."""
    c = centers_sorted
    mids = c[:-1] * jnp.float32(0.5) + c[1:] * jnp.float32(0.5)
    return jnp.searchsorted(mids, x, side="left", method="compare_all").astype(jnp.int32)


def weighted_sse(x, w, centers_sorted) -> jax.Array:
    """``sum_i w_i (x_i - c[a_i])^2`` under the nearest-signpost assignment."""
    a = assign(x, centers_sorted)
    return jnp.sum(w * jnp.square(x - centers_sorted[a]))


def _draw(p, u):
    """Index drawn with probability ``p / sum(p)`` by inverse CDF at ``u`` in [0, 1) (``p >= 0``, sum > 0)."""
    cdf = jnp.cumsum(p)
    i = jnp.searchsorted(cdf, u * cdf[-1], side="right")
    return jnp.minimum(i, p.shape[0] - 1)


def _seed(x, w, key, k: int):
    """Weighted k-means++ seeding: ``k`` centres drawn from the points (inverse-CDF draws from ``k`` uniforms)."""
    u = jax.random.uniform(key, (k,), jnp.float32)
    first = x[_draw(w, u[0])]
    centers = jnp.full((k,), first, jnp.float32)
    d2 = jnp.square(x - first)

    def body(j, carry):
        centers, d2 = carry
        p = w * d2
        p = jnp.where(jnp.sum(p) > 0, p, w)                     # every point already a centre: duplicate one
        c = x[_draw(p, u[j])]
        return centers.at[j].set(c), jnp.minimum(d2, jnp.square(x - c))

    centers, _ = jax.lax.fori_loop(1, k, body, (centers, d2))
    return jnp.sort(centers)


def _lloyd(x, w, centers, k: int, max_iter: int, tol: float):
    def cond(s):
        _, it, moved = s
        return (it < max_iter) & moved

    def body(s):
        c, it, _ = s
        a = assign(x, c)
        sw = jax.ops.segment_sum(w, a, num_segments=k)
        swx = jax.ops.segment_sum(w * x, a, num_segments=k)
        new = jnp.sort(jnp.where(sw > 0, swx / jnp.where(sw > 0, sw, 1.0), c))
        moved = jnp.max(jnp.abs(new - c)) > jnp.float32(tol) * (1 + jnp.max(jnp.abs(c)))
        return new, it + 1, moved

    c, it, _ = jax.lax.while_loop(cond, body, (centers, jnp.int32(0), jnp.bool_(True)))
    return c, it


@functools.partial(jax.jit, static_argnames=("nbins",))
def _bin(x, w, *, nbins: int):
    """Aggregate points into ``nbins`` equal-width bins over ``[min x, max x]``: per-bin weight ``W``, weighted
    sum ``S`` and weighted sum of squares ``Q`` (float32; each bin sums few points, so they stay accurate)."""
    lo, hi = jnp.min(x), jnp.max(x)
    width = jnp.maximum(hi - lo, jnp.float32(1e-30))
    b = jnp.clip(jnp.floor((x - lo) / width * nbins), 0, nbins - 1).astype(jnp.int32)
    seg = functools.partial(jax.ops.segment_sum, segment_ids=b, num_segments=nbins)
    return seg(w), seg(w * x), seg(w * x * x)


def _binned_sse(W, S, Q, centers_sorted):
    mean = S / jnp.where(W > 0, W, 1.0)
    c = centers_sorted[assign(mean, centers_sorted)]
    return jnp.sum(jnp.where(W > 0, Q - 2 * c * S + c * c * W, 0.0))


@functools.partial(jax.jit, static_argnames=("k", "n_init", "max_iter", "tol"))
def _kmeans(W, S, Q, key, *, k: int, n_init: int, max_iter: int, tol: float):
    """Weighted k-means over bin means (weights W); returns the best run's centres, iterations and SSE."""
    x = S / jnp.where(W > 0, W, 1.0)

    def one(key):
        c, it = _lloyd(x, W, _seed(x, W, key, k), k, max_iter, tol)
        return c, it, _binned_sse(W, S, Q, c)

    cs, its, sses = jax.lax.map(one, jax.random.split(key, n_init))
    best = jnp.argmin(sses)
    return cs[best], its[best], sses[best]


def strictly_increasing(c: np.ndarray) -> np.ndarray:
    """Sort and nudge duplicates up by one float32 ulp so the result is a valid codebook."""
    c = np.sort(np.asarray(c, np.float32))
    for i in range(1, c.size):
        if c[i] <= c[i - 1]:
            c[i] = np.nextafter(c[i - 1], np.float32(np.inf))
    return c


def weighted_kmeans(x, w=None, *, bits: int, seed: int = 0, n_init: int = 4, max_iter: int = 100,
                    tol: float = 1e-6, nbins: int = 1 << 14) -> KMeansResult:
    """Fit a ``2**bits``-signpost codebook to points ``x`` with weights ``w`` (None: unweighted).

    The points are first aggregated into ``nbins`` equal-width bins over their range (one pass; a bin's points
    share one assignment, so the objective is exact up to a position error below one bin width, ``range / nbins``);
    seeding and Lloyd iterations then run over the bin means weighted by the bin weights.

    Args:
      x, w: 1-D arrays of equal length (``w >= 0``, finite, not all zero).
      bits: 1..8.  seed: PRNG seed of the k-means++ seedings.
    Returns :class:`KMeansResult` (``sse`` with the weights scaled to max 1).
    Raises ``ValueError`` naming the problem for empty / non-finite / mismatched input or all-zero weights.
    """
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"weighted_kmeans: bits must be an int in [1, 8], got {bits!r}")
    x = np.asarray(x, np.float32).reshape(-1)
    w = np.ones_like(x) if w is None else np.asarray(w, np.float32).reshape(-1)
    if x.size == 0:
        raise ValueError("weighted_kmeans: no points")
    if w.shape != x.shape:
        raise ValueError(f"weighted_kmeans: {x.size} points but {w.size} weights")
    if not np.isfinite(x).all():
        raise ValueError("weighted_kmeans: non-finite points")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weighted_kmeans: weights must be finite and >= 0")
    if not (w > 0).any():
        raise ValueError("weighted_kmeans: all weights are zero")
    for name, v in (("n_init", n_init), ("max_iter", max_iter), ("nbins", nbins)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"weighted_kmeans: {name} must be a positive int, got {v!r}")
    w = w / np.float32(w.max())                       # scale-free objective; keeps float32 sums in range
    n = 1 << max(int(x.size - 1).bit_length(), 10)    # pad to a power of two (zero weight): few compilations
    xp = np.full(n, x[0], np.float32)
    wp = np.zeros(n, np.float32)
    xp[: x.size], wp[: x.size] = x, w
    W, S, Q = _bin(jnp.asarray(xp), jnp.asarray(wp), nbins=nbins)
    c, it, _ = _kmeans(W, S, Q, jax.random.PRNGKey(seed), k=2 ** int(bits), n_init=n_init, max_iter=max_iter,
                       tol=float(tol))
    centers = strictly_increasing(np.asarray(c))
    check_codebook(centers, "weighted_kmeans")
    sse = float(_binned_sse(W, S, Q, jnp.asarray(centers)))
    return KMeansResult(centers=centers, sse=sse, iterations=int(it), points=int(x.size))
