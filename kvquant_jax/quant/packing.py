"""Bit packing of unsigned codes (layout fixed in docs/architecture.md) and offset-binary helpers.

Layout: along ``axis`` the codes form one little-endian bit stream, element ``i`` occupying bits
``[i*bits, (i+1)*bits)``, least significant bit first.  Stream bit ``j`` is bit ``j % W`` of word ``j // W``
(``W = 8`` for :func:`pack_bits` ``uint8`` bytes, ``W = 32`` for :func:`pack_bits_u32` ``uint32`` words), so a
``uint32`` word holds the same bits as the four bytes it would be on a little-endian machine.

* ``bits`` in {1, 2, 4, 8}: elements never straddle a word; byte ``k`` holds elements
  ``k*(8/bits) ...`` with element ``i`` at shift ``(i % (8/bits)) * bits``.
* ``bits`` in {3, 5, 6, 7}: supported with the same stream definition; an element may straddle two words
  (e.g. 3-bit: 8 elements fill 3 bytes; element 2 uses bits 6-7 of byte 0 and bit 0 of byte 1).

The packed axis has ``ceil(n * bits / W)`` words; padding bits are zero.  :func:`unpack_bits` returns
``floor(words * W / bits)`` codes unless ``count`` (the original length) is given.  Codes must lie in
``[0, 2**bits)``: the packers mask them (jit-safe) and raise ``ValueError`` on concrete out-of-range input.

Signed symmetric codes ``q in [-(2**(b-1) - 1), 2**(b-1) - 1]`` are stored offset-binary ``u = q + 2**(b-1)``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.quant import _common as C


def _check_codes(codes, bits: int, what: str) -> jax.Array:
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"{what}: codes must be an integer array, got dtype {codes.dtype}")
    if codes.ndim == 0:
        raise ValueError(f"{what}: codes must have rank >= 1")
    if C.is_concrete(codes) and codes.size:
        c = np.asarray(codes).astype(np.int64)
        if c.min() < 0 or c.max() >= 2 ** bits:
            raise ValueError(f"{what}: codes out of range [0, {2 ** bits - 1}] for bits={bits} "
                             f"(min {c.min()}, max {c.max()}); signed codes need to_offset_binary first")
    return codes


def _pack(codes, bits: int, axis: int, word_bits: int, what: str) -> jax.Array:
    bits = C.check_bits(bits, 1, 8, what)
    codes = _check_codes(codes, bits, what)
    return _pack_core(codes, bits=bits, axis=C.normalize_axis(axis, codes.ndim, what), word_bits=word_bits)


@functools.partial(jax.jit, static_argnames=("bits", "axis", "word_bits"))
def _pack_core(codes, *, bits: int, axis: int, word_bits: int) -> jax.Array:
    word = jnp.uint8 if word_bits == 8 else jnp.uint32
    c = jnp.moveaxis(codes, axis, -1).astype(jnp.uint32) & jnp.uint32(2 ** bits - 1)
    lead, n = c.shape[:-1], c.shape[-1]
    n_words = -(-n * bits // word_bits)
    if word_bits % bits == 0:                       # no straddling: shift each element into its word
        per = word_bits // bits
        c = jnp.pad(c, [(0, 0)] * len(lead) + [(0, n_words * per - n)]).reshape(lead + (n_words, per))
        shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
        packed = jnp.sum(c << shifts, axis=-1, dtype=jnp.uint32)
    else:                                           # general stream: explode to bits, regroup into words
        stream = (c[..., None] >> jnp.arange(bits, dtype=jnp.uint32)) & jnp.uint32(1)
        stream = stream.reshape(lead + (n * bits,))
        stream = jnp.pad(stream, [(0, 0)] * len(lead) + [(0, n_words * word_bits - n * bits)])
        weights = jnp.left_shift(jnp.uint32(1), jnp.arange(word_bits, dtype=jnp.uint32))
        packed = jnp.sum(stream.reshape(lead + (n_words, word_bits)) * weights, axis=-1, dtype=jnp.uint32)
    return jnp.moveaxis(packed.astype(word), -1, axis)


def _unpack(packed, bits: int, axis: int, count, word_bits: int, what: str) -> jax.Array:
    bits = C.check_bits(bits, 1, 8, what)
    packed = jnp.asarray(packed)
    want = jnp.uint8 if word_bits == 8 else jnp.uint32
    if packed.dtype != want:
        raise ValueError(f"{what}: packed words must be {np.dtype(want).name}, got {packed.dtype}")
    if packed.ndim == 0:
        raise ValueError(f"{what}: packed must have rank >= 1")
    axis = C.normalize_axis(axis, packed.ndim, what)
    n_words = packed.shape[axis]
    capacity = n_words * word_bits // bits
    if count is None:
        count = capacity
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or not 0 <= count <= capacity:
        raise ValueError(f"{what}: count must be an integer in [0, {capacity}] for {n_words} words of "
                         f"{word_bits} bits at bits={bits}, got {count!r}")
    return _unpack_core(packed, bits=bits, axis=axis, count=int(count), word_bits=word_bits)


@functools.partial(jax.jit, static_argnames=("bits", "axis", "count", "word_bits"))
def _unpack_core(packed, *, bits: int, axis: int, count: int, word_bits: int) -> jax.Array:
    w = jnp.moveaxis(packed, axis, -1).astype(jnp.uint32)
    lead, n_words = w.shape[:-1], w.shape[-1]
    capacity = n_words * word_bits // bits
    mask = jnp.uint32(2 ** bits - 1)
    if word_bits % bits == 0:
        per = word_bits // bits
        shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
        codes = ((w[..., None] >> shifts) & mask).reshape(lead + (n_words * per,))
    else:
        stream = (w[..., None] >> jnp.arange(word_bits, dtype=jnp.uint32)) & jnp.uint32(1)
        stream = stream.reshape(lead + (n_words * word_bits,))[..., : capacity * bits]
        weights = jnp.left_shift(jnp.uint32(1), jnp.arange(bits, dtype=jnp.uint32))
        codes = jnp.sum(stream.reshape(lead + (capacity, bits)) * weights, axis=-1, dtype=jnp.uint32)
    return jnp.moveaxis(codes[..., :count].astype(jnp.uint8), -1, axis)


def packed_length(n: int, bits: int, word_bits: int = 8) -> int:
    """Words needed for ``n`` codes of ``bits`` bits: ``ceil(n * bits / word_bits)``."""
    return -(-int(n) * C.check_bits(bits, 1, 8, "packed_length") // int(word_bits))


def pack_bits(codes, bits: int, axis: int = -1) -> jax.Array:
    """Pack unsigned codes (any integer dtype, values in ``[0, 2**bits)``) into ``uint8`` along ``axis``.

    bits: 1..8.  Output: ``codes.shape`` with ``axis`` -> ``ceil(n * bits / 8)``.
    """
    return _pack(codes, bits, axis, 8, "pack_bits")


def unpack_bits(packed, bits: int, axis: int = -1, count: int | None = None) -> jax.Array:
    """Inverse of :func:`pack_bits`: ``uint8`` words -> ``uint8`` codes; ``count`` = original length (static)."""
    return _unpack(packed, bits, axis, count, 8, "unpack_bits")


def pack_bits_u32(codes, bits: int, axis: int = -1) -> jax.Array:
    """Like :func:`pack_bits` into ``uint32`` words: ``axis`` -> ``ceil(n * bits / 32)``."""
    return _pack(codes, bits, axis, 32, "pack_bits_u32")


def unpack_bits_u32(packed, bits: int, axis: int = -1, count: int | None = None) -> jax.Array:
    """Inverse of :func:`pack_bits_u32` (returns ``uint8`` codes)."""
    return _unpack(packed, bits, axis, count, 32, "unpack_bits_u32")


def to_offset_binary(q, bits: int) -> jax.Array:
    """Signed codes ``q`` (int8, ``|q| <= 2**(bits-1) - 1`` narrow, ``-2**(bits-1)`` tolerated) ->
    ``uint8 u = q + 2**(bits-1)``.  bits: 2..8.  Raises on concrete out-of-range codes."""
    bits = C.check_bits(bits, 2, 8, "to_offset_binary")
    q = jnp.asarray(q)
    if not jnp.issubdtype(q.dtype, jnp.signedinteger):
        raise ValueError(f"to_offset_binary: expected signed integer codes, got dtype {q.dtype}")
    half = 2 ** (bits - 1)
    if C.is_concrete(q) and q.size:
        qq = np.asarray(q).astype(np.int64)
        if qq.min() < -half or qq.max() > half - 1:
            raise ValueError(f"to_offset_binary: codes out of range [{-half}, {half - 1}] for bits={bits}")
    return (q.astype(jnp.int32) + jnp.int32(half)).astype(jnp.uint8)


def from_offset_binary(u, bits: int) -> jax.Array:
    """``uint8`` offset-binary codes -> ``int8 q = u - 2**(bits-1)``.  bits: 2..8."""
    bits = C.check_bits(bits, 2, 8, "from_offset_binary")
    u = jnp.asarray(u)
    if not jnp.issubdtype(u.dtype, jnp.integer):
        raise ValueError(f"from_offset_binary: expected integer codes, got dtype {u.dtype}")
    return (u.astype(jnp.int32) - jnp.int32(2 ** (bits - 1))).astype(jnp.int8)
