"""Host-side invariant checks used by ``validate_layer`` implementations (NumPy; never on the hot path).

Every check looks only at rows / groups / ring slots that the committed lengths expose: invisible slots may hold
anything (the frontier rule lets a rejected append leave garbage there).
"""
from __future__ import annotations

import numpy as np

from kvquant_jax.cache._rows import host


def _rows_mask(lengths, n: int, frontier=None) -> np.ndarray:
    """bool ``[B, n]``: row ``i`` is below ``frontier`` (default: below ``lengths``)."""
    lim = host(lengths if frontier is None else frontier).astype(np.int64)
    return np.arange(n)[None, :] < lim[:, None]


def finite_rows(what: str, arr, lengths, frontier=None, axis_rows: int = 2) -> None:
    """Rows ``i < frontier`` (default ``lengths``) of ``arr [B, H, N, ...]`` (rows on ``axis_rows``) are finite."""
    a = host(arr).astype(np.float64)
    a = np.moveaxis(a, axis_rows, 2)
    mask = _rows_mask(lengths, a.shape[2], frontier)
    for b in range(a.shape[0]):
        rows = a[b][:, mask[b]]
        if rows.size and not np.isfinite(rows).all():
            raise ValueError(f"{what}: sequence {b} exposes non-finite stored values")


def positive_normal(what: str, arr, lengths, frontier=None, tiny: float | None = None) -> None:
    """Visible scales are finite, positive and at least ``tiny`` (the qparam dtype's smallest normal)."""
    a = host(arr)
    t = float(np.finfo(a.dtype).tiny) if tiny is None else tiny
    a = a.astype(np.float64)
    mask = _rows_mask(lengths, a.shape[2], frontier)
    for b in range(a.shape[0]):
        s = a[b][:, mask[b]]
        if s.size and not (np.isfinite(s).all() and (s >= t).all()):
            raise ValueError(f"{what}: sequence {b} exposes a scale that is not a finite positive normal number")


def codes_in_range(what: str, codes, lengths, lo: int, hi: int, frontier=None) -> None:
    """Visible unpacked codes (``[B, H, N, D]`` uint8) lie in ``[lo, hi]``."""
    c = host(codes).astype(np.int64)
    mask = _rows_mask(lengths, c.shape[2], frontier)
    for b in range(c.shape[0]):
        v = c[b][:, mask[b]]
        if v.size and (v.min() < lo or v.max() > hi):
            raise ValueError(f"{what}: sequence {b} exposes codes outside [{lo}, {hi}] "
                             f"(min {v.min()}, max {v.max()})")


def ring_finite(what: str, ring, lo, hi) -> None:
    """Live ring slots (positions ``[lo, hi)``, slot ``p mod S``) are finite."""
    r = host(ring).astype(np.float64)
    s = r.shape[2]
    lo, hi = host(lo).astype(np.int64), host(hi).astype(np.int64)
    for b in range(r.shape[0]):
        if hi[b] - lo[b] > s:
            raise ValueError(f"{what}: sequence {b} needs {hi[b] - lo[b]} live ring slots but the ring has {s}")
        slots = np.arange(lo[b], hi[b]) % max(s, 1)
        if slots.size and not np.isfinite(r[b][:, slots]).all():
            raise ValueError(f"{what}: sequence {b} exposes a non-finite residual row")


def unpack_codes(packed, bits: int) -> np.ndarray:
    """Host-side unpack of little-endian packed codes along the last axis (``uint8 [..., n*bits/8]``)."""
    p = host(packed).astype(np.uint8)
    stream = np.unpackbits(p, axis=-1, bitorder="little")
    n = stream.shape[-1] // bits
    stream = stream[..., : n * bits].reshape(p.shape[:-1] + (n, bits)).astype(np.int64)
    return (stream << np.arange(bits)).sum(axis=-1)


def static_scales(what: str, scale, *, per_tensor: bool, uncalibrated: bool) -> None:
    """A per-layer scale set ``float32 [Hkv]`` (FP8 / static-INT scales, no batch axis) is finite, positive and
    normal; equal over heads when ``per_tensor``; all 1.0 when ``uncalibrated``."""
    s = np.asarray(scale, np.float64)
    if not (np.isfinite(s).all() and (s >= np.finfo(np.float32).tiny).all()):
        raise ValueError(f"{what} scale must be finite, positive and normal, got {s}")
    if per_tensor and s.size and not (s == s.reshape(-1)[0]).all():
        raise ValueError(f"{what}: a per-tensor scale differs between heads: {s}")
    if uncalibrated and not (s == 1).all():
        raise ValueError(f"{what}: uncalibrated scales must be 1.0, got {s}")


# ----- static fields (construction-time checks of frozen scheme / config dataclasses) -----
def choice(what: str, obj, names, choices, *, listing: str | None = None, no_bool: bool = False) -> None:
    """Each field ``names`` of ``obj`` is one of ``choices`` (``no_bool``: and not a bool, since True == 1);
    raises ``ValueError("{what}: {name} must be {listing or 'one of ' + choices}, got {value!r}")``."""
    for name in (names,) if isinstance(names, str) else names:
        v = getattr(obj, name)
        if (no_bool and isinstance(v, bool)) or v not in choices:
            raise ValueError(f"{what}: {name} must be {listing or f'one of {choices}'}, got {v!r}")


def ints_at_least(what: str, obj, names, low: int) -> None:
    """Each field ``names`` of ``obj`` is an int (not a bool) ``>= low`` (0: "non-negative", 1: "positive")."""
    kind = {0: "a non-negative int", 1: "a positive int"}.get(low, f"an int >= {low}")
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{what}: {name} must be {kind}, got {v!r}")
