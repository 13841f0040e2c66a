"""The decode-attention oracle: decoding of every payload vs independent decoders, and the one-softmax semantics."""
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi import reference as R
from kvquant_jax.abi.regions import KVFormat, KVOperand, Region, check_query, dense_operand, region
from kvquant_jax.attention.synthetic import PRESETS, grouped_formats, kivi_formats, random_region
from kvquant_jax.quant.packing import pack_bits


def _naive_attention(q, keys, values, valid, scale):
    """Per (batch, query head) loop over an explicit key list: the textbook definition, float64."""
    b, hq, d = q.shape
    hkv = keys.shape[1]
    g = hq // hkv
    out = np.zeros((b, hq, d))
    for bi in range(b):
        for h in range(hq):
            kv = h // g
            idx = np.nonzero(valid[bi])[0]
            if idx.size == 0:
                continue
            s = np.array([q[bi, h] @ keys[bi, kv, i] for i in idx]) * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[bi, h] = sum(pi * values[bi, kv, i] for pi, i in zip(p, idx))
    return out


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_unpack_matches_packer(rng, bits):
    codes = rng.integers(0, 2 ** bits, (3, 5, 16))
    packed = np.asarray(pack_bits(jnp.asarray(codes, jnp.int32), bits, axis=-1))
    np.testing.assert_array_equal(R.unpack_codes(packed, bits), codes)
    np.testing.assert_array_equal(np.asarray(R.unpack_codes(jnp.asarray(packed), bits, jnp)), codes)


def _decode_by_hand(op: KVOperand, d: int) -> np.ndarray:
    """Element-by-element decode straight from the layout description in docs/architecture.md."""
    f = op.fmt
    data = np.asarray(op.data)
    b, h, n = data.shape[:3]
    out = np.zeros((b, h, n, d))
    scale = None if op.scale is None else np.asarray(op.scale, np.float64)
    zero = None if op.zero is None else np.asarray(op.zero, np.float64)
    for idx in np.ndindex(b, h, n):
        for i in range(d):
            if not f.is_int:
                x = float(data[idx + (i,)].astype(np.float64))
                out[idx + (i,)] = x * (scale[idx[1]] if f.scale == "head" else 1.0)
                continue
            byte = int(data[idx + (i * f.bits // 8,)])
            u = (byte >> ((i * f.bits) % 8)) & (2 ** f.bits - 1)
            if f.scale == "head":
                s, z = scale[idx[1]], None
            elif f.scale == "token":
                gi = i // (d // scale.shape[-1])
                s, z = scale[idx + (gi,)], None if zero is None else zero[idx + (gi,)]
            else:
                s, z = scale[idx[0], idx[1], idx[2] // f.group, i], zero[idx[0], idx[1], idx[2] // f.group, i]
            if f.zero == "symmetric":
                out[idx + (i,)] = (u - 2 ** (f.bits - 1)) * s
            elif f.zero == "offset":
                out[idx + (i,)] = (u - z) * s
            else:
                out[idx + (i,)] = u * s + z
    return out


FORMATS = dict(PRESETS, int4g=grouped_formats(4, 8), int1=grouped_formats(1, 0), kivi2=kivi_formats(2, 4, 8),
               kivi4=kivi_formats(4, 4, 0))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_matches_layout_spec(rng, name):
    kf, vf = FORMATS[name]
    reg = random_region(rng, kf, vf, 2, 2, 8, 16, [0, 0], [8, 8], poison=False)
    for op in (reg.k, reg.v):
        np.testing.assert_allclose(R.dequantize_operand(op, 16), _decode_by_hand(op, 16), rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.asarray(R.dequantize_operand(op, 16, jnp, jnp.float32)),
                                   _decode_by_hand(op, 16), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["bf16", "int4", "qserve", "kivi2"])
@pytest.mark.parametrize("gqa", [1, 3])
def test_oracle_is_one_softmax_over_all_regions(rng, name, gqa):
    """Two regions + the current token == the textbook softmax over the concatenated key list."""
    kf, vf = FORMATS[name]
    b, hkv, d = 3, 2, 16
    r1 = random_region(rng, kf, vf, b, hkv, 8, d, [0, 2, 0], [8, 5, 0])
    r2 = random_region(rng, KVFormat("fp32"), KVFormat("fp32"), b, hkv, 4, d, [0, 0, 0], [3, 4, 0])
    q = rng.standard_normal((b, hkv * gqa, d))
    kn, vn = rng.standard_normal((b, hkv, d)), rng.standard_normal((b, hkv, d))
    got = R.decode_attention_reference(q, [r1, r2], k_new=kn, v_new=vn)
    keys, values, valid = [], [], []
    for r in (r1, r2):
        n = r.k.data.shape[2]
        keys.append(_decode_by_hand(r.k, d))
        values.append(_decode_by_hand(r.v, d))
        rows = np.arange(n)[None]
        valid.append((rows >= np.asarray(r.start)[:, None]) & (rows < np.asarray(r.end)[:, None]))
    keys = np.concatenate(keys + [kn[:, :, None]], axis=2)
    values = np.concatenate(values + [vn[:, :, None]], axis=2)
    valid = np.concatenate(valid + [np.ones((b, 1), bool)], axis=1)
    keys = np.where(valid[:, None, :, None], keys, 0.0)        # dead rows are poisoned with NaN
    values = np.where(valid[:, None, :, None], values, 0.0)
    want = _naive_attention(q, keys, values, valid, 1 / np.sqrt(d))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    got32 = R.decode_attention_jnp(jnp.asarray(q, jnp.float32), [r1, r2], k_new=jnp.asarray(kn, jnp.float32),
                                   v_new=jnp.asarray(vn, jnp.float32))
    assert np.linalg.norm(np.asarray(got32) - want) / np.linalg.norm(want) < 1e-5


def test_region_split_is_invisible(rng):
    """Cutting one region's live window into two regions changes nothing (one softmax, not two)."""
    kf, vf = FORMATS["int4"]
    reg = random_region(rng, kf, vf, 2, 2, 16, 16, [0, 3], [16, 11], poison=False)
    q = rng.standard_normal((2, 4, 16))
    cut = np.array([5, 7], np.int32)
    a = Region(k=reg.k, v=reg.v, start=reg.start, end=jnp.asarray(cut))
    b = Region(k=reg.k, v=reg.v, start=jnp.asarray(cut), end=reg.end)
    np.testing.assert_allclose(R.decode_attention_reference(q, [a, b]), R.decode_attention_reference(q, [reg]),
                               rtol=1e-12, atol=1e-14)


def test_degenerate_cases(rng):
    d = 8
    k = jnp.asarray(rng.standard_normal((2, 1, 4, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 1, 4, d)), jnp.float32)
    q = rng.standard_normal((2, 2, d))
    reg = region(dense_operand(k), dense_operand(v), [1, 0])
    out = R.decode_attention_reference(q, [reg])
    np.testing.assert_allclose(out[0], np.repeat(np.asarray(v)[0, :, 0], 2, axis=0), rtol=1e-6)  # one key: its value
    np.testing.assert_array_equal(out[1], 0.0)                                                     # no key: zeros
    kn = np.zeros((2, 1, d))
    vn = rng.standard_normal((2, 1, d))
    out = R.decode_attention_reference(q, [reg], k_new=kn, v_new=vn)
    np.testing.assert_allclose(out[1], np.repeat(vn[1], 2, axis=0), rtol=1e-12)                  # only k_new


def test_bad_inputs_raise(rng):
    kf, vf = FORMATS["int4"]
    reg = random_region(rng, kf, vf, 2, 2, 8, 16, [0, 0], [8, 8])
    with pytest.raises(ValueError, match="multiple of Hkv"):
        check_query(jnp.zeros((2, 3, 16)), [reg])
    with pytest.raises(ValueError, match="expected shape"):
        check_query(jnp.zeros((2, 4, 32)), [reg])
    with pytest.raises(ValueError, match="both k_new and v_new"):
        check_query(jnp.zeros((2, 4, 16)), [reg], k_new=jnp.zeros((2, 2, 16)))
    with pytest.raises(ValueError, match="needs scale"):
        KVFormat("int4")
    with pytest.raises(ValueError, match="channel"):
        KVFormat("int2", "channel", "min", 0)
    bad = Region(k=KVOperand(reg.k.data, None, None, reg.k.fmt), v=reg.v, start=reg.start, end=reg.end)
    with pytest.raises(ValueError, match="scale is required"):
        check_query(jnp.zeros((2, 4, 16)), [bad])
