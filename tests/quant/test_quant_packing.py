"""Bit packing (LSB-first stream, uint8 and uint32 words) and offset-binary helpers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquant_jax.quant as Q
from quant_oracles import pack_stream

PACKERS = {8: (Q.pack_bits, Q.unpack_bits, np.uint8), 32: (Q.pack_bits_u32, Q.unpack_bits_u32, np.uint32)}


@given(bits=st.integers(1, 8), n=st.sampled_from([1, 3, 7, 8, 13, 32, 33]), lead=st.sampled_from([(), (2,), (2, 3)]),
       word=st.sampled_from([8, 32]), seed=st.integers(0, 2**32 - 1), axis_first=st.booleans())
@settings(max_examples=40)
def test_pack_matches_stream_oracle_and_round_trips(bits, n, lead, word, seed, axis_first):
    pack, unpack, wdtype = PACKERS[word]
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=lead + (n,)).astype(np.uint8)
    axis = 0 if axis_first else -1
    c = np.moveaxis(codes, -1, 0) if axis_first else codes
    packed = pack(c, bits, axis=axis)
    assert packed.dtype == wdtype
    assert packed.shape[axis] == -(-n * bits // word) == Q.packed_length(n, bits, word)
    pm = np.moveaxis(np.asarray(packed), 0, -1) if axis_first else np.asarray(packed)
    for idx in np.ndindex(*lead):
        assert [int(w) for w in pm[idx]] == pack_stream(codes[idx], bits, word)
    back = unpack(packed, bits, axis=axis, count=n)
    assert back.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(back), c)
    full = unpack(packed, bits, axis=axis)                        # without count: whole words, padding is zero
    assert full.shape[axis] == packed.shape[axis] * word // bits
    fm = np.moveaxis(np.asarray(full), 0, -1) if axis_first else np.asarray(full)
    assert not fm[..., n:].any()


def test_layout_examples():
    """Hand-checked bytes: element i at bit offset i*bits, little-endian within a byte."""
    np.testing.assert_array_equal(np.asarray(Q.pack_bits(np.array([1, 2, 3, 0, 3], np.uint8), 2)), [0b00111001, 3])
    np.testing.assert_array_equal(np.asarray(Q.pack_bits(np.array([0xA, 0x5, 0xF], np.uint8), 4)), [0x5A, 0x0F])
    np.testing.assert_array_equal(np.asarray(Q.pack_bits(np.array([1, 0, 1, 1, 0, 0, 0, 1, 1], np.uint8), 1)),
                                  [0b10001101, 1])
    # 3-bit: 8 elements fill 3 bytes; element 2 straddles bytes 0 and 1
    three = np.asarray(Q.pack_bits(np.array([7, 0, 5, 0, 0, 0, 0, 0], np.uint8), 3))
    np.testing.assert_array_equal(three, [0b01000111, 0b00000001, 0])
    np.testing.assert_array_equal(np.asarray(Q.pack_bits_u32(np.array([1, 2, 3, 4], np.uint8), 8)), [0x04030201])
    bytes_ = np.asarray(Q.pack_bits(np.arange(16, dtype=np.uint8) % 4, 2))
    words = np.asarray(Q.pack_bits_u32(np.arange(16, dtype=np.uint8) % 4, 2))
    assert bytes_.view("<u4")[0] == words[0]                      # u32 words = little-endian bytes


def test_offset_binary_round_trip():
    for bits in range(2, 9):
        qmax = 2 ** (bits - 1) - 1
        q = np.arange(-qmax, qmax + 1, dtype=np.int8)
        u = Q.to_offset_binary(q, bits)
        assert u.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(u), q.astype(np.int64) + 2 ** (bits - 1))
        back = Q.from_offset_binary(Q.unpack_bits(Q.pack_bits(u, bits), bits, count=q.size), bits)
        assert back.dtype == jnp.int8
        np.testing.assert_array_equal(np.asarray(back), q)


@pytest.mark.parametrize("call,match", [
    (lambda: Q.pack_bits(np.array([4], np.uint8), 2), "out of range"),
    (lambda: Q.pack_bits(np.array([-1], np.int8), 4), "out of range"),
    (lambda: Q.pack_bits(np.array([1.0], np.float32), 4), "integer"),
    (lambda: Q.pack_bits(np.array([1], np.uint8), 0), "bits"),
    (lambda: Q.pack_bits(np.array([1], np.uint8), 9), "bits"),
    (lambda: Q.pack_bits(np.uint8(1), 4), "rank"),
    (lambda: Q.unpack_bits(np.zeros(2, np.uint8), 4, count=5), "count"),
    (lambda: Q.unpack_bits(np.zeros(2, np.uint32), 4), "uint8"),
    (lambda: Q.unpack_bits_u32(np.zeros(2, np.uint8), 4), "uint32"),
    (lambda: Q.to_offset_binary(np.array([8], np.int8), 4), "out of range"),
    (lambda: Q.to_offset_binary(np.array([1], np.uint8), 4), "signed"),
    (lambda: Q.to_offset_binary(np.array([1], np.int8), 1), "bits"),
])
def test_packing_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_packing_masks_out_of_range_codes_under_jit():
    packed = jax.jit(lambda c: Q.pack_bits(c, 2))(jnp.array([5, 1, 2, 3], jnp.uint8))
    np.testing.assert_array_equal(np.asarray(Q.unpack_bits(packed, 2, count=4)), [1, 1, 2, 3])
