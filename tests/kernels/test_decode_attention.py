"""Pallas decode attention (GPU/Triton-structured kernel, Pallas interpreter on CPU) vs the float64 oracle.

Every case: 3 sequences with different live windows (full / offset start + end one past a block boundary / one
row), dead rows poisoned with NaN, 3 split-K programs per head (some empty), the current token's exact K/V in the
same softmax, GQA ratio cycling over 1/3/4/8.  Relative error bound 1e-3 (fp32 accumulation; measured ~1e-6).
"""
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi.regions import KVFormat, dense_operand, region
from kvquant_jax.abi.reference import decode_attention_reference
from kvquant_jax.attention.synthetic import PRESETS, kivi_formats, random_region
from pallas_kernels import decode_attention as da
from test_decode_attention_common import B, D, FORMATS, GQA, HKV, N, make_case, rel_err

TOL = 1e-3


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_parity_every_payload_and_scheme(rng, name):
    gqa = GQA[sorted(FORMATS).index(name) % len(GQA)]
    q, reg, kn, vn, ref = make_case(rng, name, gqa, 16)
    cfg = da.KernelConfig(block_t=16, num_splits=3)
    out = da.decode_attention(q, [reg], k_new=kn, v_new=vn, backend="gpu", interpret=True, config=cfg)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("gqa", GQA)
def test_parity_gqa_ratios_kivi_blocks_of_two_groups(rng, gqa):
    """KIVI keys with 32-row blocks = two 16-token channel groups per block (two softmax updates per block)."""
    q, reg, kn, vn, ref = make_case(rng, "kivi2", gqa, 32)
    out = da.decode_attention(q, [reg], k_new=kn, v_new=vn, backend="gpu", interpret=True,
                              config=da.KernelConfig(block_t=32, num_splits=2))
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("precision,unpack,tol", [("f32", "magic", 1e-5), ("bf16x2", "convert", 1e-4),
                                                  ("bf16", "magic", 5e-3)])
def test_precision_and_unpack_modes(rng, precision, unpack, tol):
    q, reg, kn, vn, ref = make_case(rng, "qserve", 4, 16, qparam_dtype=jnp.float16)
    cfg = da.KernelConfig(block_t=16, num_splits=2, precision=precision, unpack=unpack)
    out = da.decode_attention(q, [reg], k_new=kn, v_new=vn, backend="gpu", interpret=True, config=cfg)
    assert rel_err(out, ref) < tol


def test_bf16_query_single_pass_logits(rng):
    """A bf16 query is exact in the bf16 code dot (one pass); the output keeps the float32 accuracy of the rest."""
    q, reg, kn, vn, ref = make_case(rng, "int2", 4, 16, q_dtype=jnp.bfloat16, with_new=False)
    out = da.decode_attention(q, [reg], backend="gpu", interpret=True, out_dtype=jnp.float32,
                              config=da.KernelConfig(block_t=16, num_splits=2))
    assert out.dtype == jnp.float32
    assert rel_err(out, ref) < TOL


def test_several_regions_one_softmax(rng):
    """Two kernel regions (INT4 history + bf16 sink rows) and a small dense tail through the JAX path."""
    kf, vf = FORMATS["int4"]
    hist = random_region(rng, kf, vf, B, HKV, N, D, [0, 0, 0], [N, 20, 0])
    sink = random_region(rng, KVFormat("bf16"), KVFormat("bf16"), B, HKV, 32, D, [0, 0, 0], [4, 0, 32])
    tail = random_region(rng, KVFormat("fp32"), KVFormat("fp32"), B, HKV, 8, D, [0, 0, 0], [8, 3, 0])
    q = jnp.asarray(rng.standard_normal((B, HKV * 3, D)).astype(np.float32))
    kn = jnp.asarray(rng.standard_normal((B, HKV, D)).astype(np.float32))
    vn = jnp.asarray(rng.standard_normal((B, HKV, D)).astype(np.float32))
    ref = decode_attention_reference(np.asarray(q), [hist, sink, tail], k_new=kn, v_new=vn)
    out = da.decode_attention(q, [hist, sink, tail], k_new=kn, v_new=vn, backend="gpu", interpret=True,
                              config=da.KernelConfig(block_t=16, num_splits=2), small_rows=8)
    assert rel_err(out, ref) < TOL


def test_unsupported_region_falls_back_to_jax(rng):
    """head_dim 24 is not a power of two: the kernel declines and the region is attended in plain JAX."""
    k = jnp.asarray(rng.standard_normal((2, 1, 16, 24)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((2, 1, 16, 24)).astype(np.float32))
    reg = region(dense_operand(k), dense_operand(v), [16, 7])
    assert "power of two" in da.kernel_unsupported(reg, 24)
    q = jnp.asarray(rng.standard_normal((2, 2, 24)).astype(np.float32))
    out = da.decode_attention(q, [reg], backend="gpu", interpret=True)
    assert rel_err(out, decode_attention_reference(np.asarray(q), [reg])) < 1e-5


@pytest.mark.parametrize("fmt,d,want", [("int2", 32, "code-plane width 8"), ("int4", 16, "code-plane width 8"),
                                        ("int2", 64, None), ("int8", 16, None), ("bf16", 16, None)])
def test_compiled_gpu_refuses_mma_dimensions_below_16(rng, fmt, d, want):
    """A compiled Triton run needs every bf16 dot dimension >= 16 (the H200 gave wrong results below: see
    ``da.MMA_MIN``), so such regions are refused by name there -- and still taken when interpreted or on TPU."""
    kf = PRESETS[fmt][0]
    reg = random_region(rng, kf, kf, 1, 1, 64, d, [0], [40])
    assert da.kernel_unsupported(reg, d, "gpu") is None
    assert da.kernel_unsupported(reg, d, "tpu", compiled_gpu=True) is None
    got = da.kernel_unsupported(reg, d, "gpu", compiled_gpu=True)
    assert (got is None) if want is None else (want in got), got
    kivi = random_region(rng, *kivi_formats(2, 8, 32), 1, 1, 64, 64, [0], [40])
    assert "channel group 8" in da.kernel_unsupported(kivi, 64, "gpu", compiled_gpu=True)


def test_reference_twin_has_the_same_signature(rng):
    q, reg, kn, vn, ref = make_case(rng, "int8", 2, 16)
    out = da.decode_attention_reference(q, [reg], k_new=kn, v_new=vn, backend="gpu", interpret=True,
                                        config=da.KernelConfig(), small_rows=4, out_dtype=jnp.float32)
    assert rel_err(out, ref) < 1e-5


def test_bad_arguments_raise(rng):
    q, reg, kn, vn, _ = make_case(rng, "int4", 1, 16)
    with pytest.raises(ValueError, match="precision"):
        da.decode_attention(q, [reg], backend="gpu", interpret=True, config=da.KernelConfig(precision="tf32"))
    with pytest.raises(ValueError, match="unpack"):
        da.decode_attention(q, [reg], backend="gpu", interpret=True, config=da.KernelConfig(unpack="lut"))
    with pytest.raises(ValueError, match="backend"):
        da.decode_attention(q, [reg], backend="rocm", interpret=True)
    with pytest.raises(ValueError, match="configs for"):
        da.decode_attention(q, [reg], backend="gpu", interpret=True, config=[None, None])
    with pytest.raises(ValueError, match="no block size"):
        da._pick_block(48, 64, 32)
    assert da.kernel_unsupported(reg, D) is None
