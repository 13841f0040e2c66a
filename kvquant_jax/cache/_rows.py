"""Row plumbing shared by the schemes: head-major writes, residual-ring windows, validity masks (all jit-friendly).

Everything here works on head-major arrays ``[B, H, N, ...]`` (``N`` = capacity rows, group rows or ring slots)
with per-sequence int32 ``[B]`` positions, and never transposes a capacity-sized buffer: writes are one scatter
into the buffer as stored, so a donated cache is updated in place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.abi.regions import INT_PAYLOADS, KVFormat, KVOperand, region
from kvquant_jax.quant._common import QuantStatus



def head_major(x: jax.Array) -> jax.Array:
    """``[B, T, H, D] -> [B, H, T, D]`` (only ever applied to the new rows, never to a cache buffer)."""
    return jnp.swapaxes(x, 1, 2)


def arange_rows(n: int) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32)


def new_row_mask(num_new: jax.Array, t: int) -> jax.Array:
    """bool ``[B, T]``: row ``t`` of sequence ``b`` is a real (non-padding) new row."""
    return arange_rows(t)[None, :] < num_new[:, None]


def write_rows(buf: jax.Array, rows: jax.Array, index: jax.Array, keep: jax.Array) -> jax.Array:
    """``buf[b, h, index[b, j]] = rows[b, h, j]`` where ``keep[b, j]``; other slots unchanged.

    buf: ``[B, H, N, ...]``; rows: ``[B, H, W, ...]`` (same trailing dims, cast to ``buf.dtype``);
    index, keep: ``[B, W]``.  Dropped rows are pointed out of bounds (``mode="drop"``).
    """
    b, h, n = buf.shape[:3]
    idx = jnp.where(keep, index, jnp.int32(n))
    bi = jnp.arange(b, dtype=jnp.int32)[:, None, None]
    hi = jnp.arange(h, dtype=jnp.int32)[None, :, None]
    return buf.at[bi, hi, idx[:, None, :]].set(rows.astype(buf.dtype), mode="drop")


def take_rows(buf: jax.Array, index: jax.Array) -> jax.Array:
    """``out[b, h, j] = buf[b, h, index[b, j]]`` for in-range ``index`` (``[B, W]``); ``buf [B, H, N, ...]``."""
    b, h = buf.shape[:2]
    bi = jnp.arange(b, dtype=jnp.int32)[:, None, None]
    hi = jnp.arange(h, dtype=jnp.int32)[None, :, None]
    return buf[bi, hi, index[:, None, :]]


def window(ring: jax.Array | None, new: jax.Array, base: jax.Array, lengths: jax.Array, num_new: jax.Array,
           width: int) -> jax.Array:
    """float32 rows of positions ``base[b] + j`` (``j < width``), head-major ``[B, H, width, D]``.

    A position below ``lengths[b]`` is read from the residual ring (slot ``p mod S``; the caller guarantees it is
    live there), one in ``[lengths, lengths + num_new)`` from the new rows ``new [B, H, T, D]``; anything beyond
    is zero (padding never reaches a quantizer).
    """
    t = new.shape[2]
    pos = base[:, None] + arange_rows(width)[None, :]                          # [B, W]
    rel = pos - lengths[:, None]
    out = take_rows(new, jnp.clip(rel, 0, t - 1)).astype(jnp.float32)
    if ring is not None and ring.shape[2] > 0:
        from_ring = take_rows(ring, pos % ring.shape[2]).astype(jnp.float32)
        out = jnp.where((rel < 0)[:, None, :, None], from_ring, out)
    live = (rel < num_new[:, None])[:, None, :, None]
    return jnp.where(live, out, jnp.float32(0))


def ring_write_new(ring: jax.Array, new: jax.Array, lengths: jax.Array, num_new: jax.Array,
                   frontier_after: jax.Array) -> jax.Array:
    """Put new row ``t`` (position ``p = lengths + t``) into ring slot ``p mod S`` iff it stays full precision at
    the new length, i.e. ``frontier_after <= p < lengths + num_new``.  ``new [B, H, T, D]``."""
    s = ring.shape[2]
    if s == 0:
        return ring
    t = new.shape[2]
    pos = lengths[:, None] + arange_rows(t)[None, :]
    keep = new_row_mask(num_new, t) & (pos >= frontier_after[:, None])
    return write_rows(ring, new, pos % s, keep)


def ring_restore(ring: jax.Array, rows: jax.Array, start: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Write given rows (``rows [B, H, T, D]``, row ``t`` = position ``start + t``) into ring slots for the positions
    in ``[lo, hi)`` (the ring's live span at the target length)."""
    s = ring.shape[2]
    if s == 0:
        return ring
    t = rows.shape[2]
    pos = start[:, None] + arange_rows(t)[None, :]
    keep = (pos >= lo[:, None]) & (pos < hi[:, None])
    return write_rows(ring, rows, pos % s, keep)


def ring_view(ring: jax.Array, capacity: int) -> jax.Array:
    """float32 ``[B, H, C, D]``: row ``i`` = ring slot ``i mod S`` (meaningful only where ``i`` is live)."""
    s = ring.shape[2]
    idx = jnp.arange(capacity, dtype=jnp.int32) % max(s, 1)
    return ring[:, :, idx].astype(jnp.float32)


def valid_rows(lengths: jax.Array, capacity: int) -> jax.Array:
    """bool ``[B, C]``: row ``i`` of sequence ``b`` is committed."""
    return arange_rows(capacity)[None, :] < lengths[:, None]


def rows_below(frontier: jax.Array, capacity: int) -> jax.Array:
    """bool ``[B, 1, C, 1]`` broadcastable mask of rows ``i < frontier[b]``."""
    return (arange_rows(capacity)[None, :] < frontier[:, None])[:, None, :, None]


def nbytes(*arrays) -> int:
    return int(sum(int(a.nbytes) for a in arrays))


def host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


# ----- quantizer status policy shared by the integer schemes -----
def split_status(status: jax.Array):
    """``(narrow, hard)`` bool masks of a quantizer status array.

    Cache policy (declared here, mirrored by the tests' shadow model): a non-zero group whose stored scale would
    underflow or be subnormal is *too narrow to encode*; the quantizers already give it all-zero codes, and the
    cache stores the exact sentinel scale 1 for it, so it decodes like a constant group (symmetric: to 0; affine
    "min": to its stored min).  Its error is below ``qmax * finfo(qparam).tiny`` (e.g. 7.8e-3 for int8 / fp16
    scales).  Every other flag (non-finite input, overflowing scale, non-finite min/offset) is *hard*: the append
    reports ``ok = False`` for that sequence and nothing is published.
    """
    narrow_bits = int(QuantStatus.SCALE_UNDERFLOW | QuantStatus.SCALE_SUBNORMAL)
    narrow = (status & jnp.int32(narrow_bits)) != 0
    hard = (status & jnp.int32(~narrow_bits)) != 0
    return narrow, hard


def sentinel_scale(scale: jax.Array, narrow: jax.Array) -> jax.Array:
    """Replace too-narrow groups' scales by the exact sentinel 1 (same dtype)."""
    return jnp.where(narrow, jnp.ones((), scale.dtype), scale)


def any_bad_rows(hard: jax.Array, row_keep: jax.Array) -> jax.Array:
    """bool ``[B]``: some kept row (``row_keep [B, W]``) has a hard flag; ``hard [B, H, W, ...]``."""
    h = hard.reshape(hard.shape[:3] + (-1,)).any(axis=(1, 3))            # [B, W]
    return jnp.any(h & row_keep, axis=1)


def materialize_packed(state, lengths, bits: int, decode):
    """Float32 ``(k, v, valid)`` of a layer whose ``k_codes/v_codes: uint8 [B, H, C, D*bits/8]`` carry
    ``k_scale/v_scale``; ``decode(codes, scale, head_dim) -> float32 [B, H, C, D]``.  Rows past ``lengths`` are 0."""
    head_dim = state.k_codes.shape[-1] * 8 // bits
    valid = valid_rows(lengths, state.k_codes.shape[2])
    m = valid[:, None, :, None]
    k = jnp.where(m, decode(state.k_codes, state.k_scale, head_dim), jnp.float32(0))
    v = jnp.where(m, decode(state.v_codes, state.v_scale, head_dim), jnp.float32(0))
    return k, v, valid


def packed_decode_regions(state, lengths, bits: int, scale: str, group: int = 0):
    """``([region], 0)``: one region over a layer whose K and V are ``k_codes / k_scale`` and ``v_codes / v_scale``
    of symmetric ``bits``-bit codes with ``scale`` ("token" or "head") qparams, read in place; None for widths the
    kernel ABI does not pack (``abi.regions.INT_PAYLOADS``: the scheme then uses its materialize view)."""
    payload = f"int{bits}"
    if payload not in INT_PAYLOADS:
        return None
    fmt = KVFormat(payload, scale, "symmetric", group)
    k = KVOperand(state.k_codes, state.k_scale, None, fmt)
    return [region(k, KVOperand(state.v_codes, state.v_scale, None, fmt), lengths)], 0


def per_row_ledger(batch: int, heads: int, rows: int, code_bytes: int, qparam_bytes: int) -> dict:
    """``ledger_layer`` of a layer whose K and V each store, per row and head, ``code_bytes`` of codes and
    ``qparam_bytes`` of qparams (per-token INT, QServe, and their kernel layouts)."""
    return {(cat, t): batch * heads * rows * n for t in "kv" for cat, n in (("codes", code_bytes),
                                                                          ("qparams", qparam_bytes))}


def packed_layer_nbytes(state) -> dict[str, int]:
    """Ledger categories of a layer whose K and V are ``k_codes / k_scale`` and ``v_codes / v_scale``."""
    return {"codes": nbytes(state.k_codes, state.v_codes), "qparams": nbytes(state.k_scale, state.v_scale)}
