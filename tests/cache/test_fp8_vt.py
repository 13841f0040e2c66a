"""The FP8 transposed-V layout (fp8_e4m3_vt / fp8_e5m2_vt): bytes against the layout-1 FP8 scheme's codes (same
quantizer, same scales under every scale source), the Mosaic kernels' operands against ``prepare_region`` of the
layout-1 region, decode through the fused entry point (its plain-JAX partials on CPU) against the float64 oracle,
dispatch routing, schema and bad input."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi import transposed_v as tv
from kvquant_jax.abi.reference import decode_attention_reference
from kvquant_jax.abi.regions import dense_operand, region
from kvquant_jax.attention import dispatch
from kvquant_jax.cache.fp8_vt import FP8TransposedVScheme
from kvquant_jax.cache.registry import make_scheme
from pallas_kernels import decode_attention_mgpu as mg

from cache_helpers import ragged_twins

B, H, D, C = 3, 2, 16, 32
SPECS = {
    "e4m3-uncalibrated": "fp8_e4m3",
    "e4m3-warmup-head": "fp8_e4m3:scales=warmup,axis=head",
    "e5m2-warmup-tensor": "fp8_e5m2:scales=warmup",
    "e4m3-calibrated-head": {"name": "fp8_e4m3", "scales": "calibrated", "axis": "head", "k_scales": [0.02, 0.05],
                             "v_scales": [0.01, 0.03], "calibration_id": "test"},
}


def _vt_spec(spec):
    if isinstance(spec, dict):
        return dict(spec, name=spec["name"] + "_vt")
    name, _, rest = spec.partition(":")
    return f"{name}_vt" + (f":{rest}" if rest else "")


def _appends(spec, seed=0):
    """Ragged multi-row and one-row appends into the transposed-V scheme and the layout-1 FP8 scheme of the same
    spec; returns both schemes, both final states and the lengths."""
    vt, ref = make_scheme(_vt_spec(spec)), make_scheme(spec)
    (s_vt, s_ref), lengths = ragged_twins((vt, ref), B, H, D, C, seed)
    return vt, ref, s_vt, s_ref, lengths


@pytest.mark.parametrize("name", sorted(SPECS))
def test_bytes_and_scales_are_the_layout_1_codes(name):
    """K rows and V columns hold exactly the bytes of the layout-1 FP8 codes (V transposed); never-written slots
    hold byte 0; the scales (warm-up, calibrated, uncalibrated) are the layout-1 scheme's."""
    vt, _, s_vt, s_ref, lengths = _appends(SPECS[name])
    live = np.arange(C)[None, :] < np.asarray(lengths)[:, None]                       # [B, C]
    live4 = live[:, None, :, None]
    kb = np.asarray(s_ref.k).view(np.uint8)
    vb = np.asarray(s_ref.v).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(s_vt.k_codes), np.where(live4, kb, 0))
    np.testing.assert_array_equal(np.asarray(s_vt.v_codes), np.swapaxes(np.where(live4, vb, 0), 2, 3))
    np.testing.assert_array_equal(np.asarray(s_vt.k_scale), np.asarray(s_ref.k_scale))
    np.testing.assert_array_equal(np.asarray(s_vt.v_scale), np.asarray(s_ref.v_scale))
    assert s_vt.k_codes.dtype == jnp.uint8 and s_vt.v_codes.shape == (B, H, D, C)
    assert float(np.asarray(s_vt.k_scale).max()) != 1.0 or name.endswith("uncalibrated")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_values_equal_the_layout_1_scheme(name):
    vt, ref, s_vt, s_ref, lengths = _appends(SPECS[name], seed=1)
    for x, y in zip(vt.materialize_layer(s_vt, lengths), ref.materialize_layer(s_ref, lengths)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    vt.validate_layer(s_vt, lengths)
    assert vt.layer_nbytes(s_vt) == ref.layer_nbytes(s_ref)
    assert vt.ledger_layer(B, H, D, C, logical=False, capacity=C) == ref.ledger_layer(B, H, D, C, logical=False,
                                                                                         capacity=C)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_kernel_operands_are_prepare_region_of_the_layout_1_region(fmt):
    """What the Mosaic kernels read from the cache in place is what ``prepare_region`` makes of the layout-1 FP8
    region (the operands the kernels' device parity covers): codes, V transposed, per-head scales, bounds."""
    spec = f"fp8_{fmt}:scales=warmup,axis=head"
    vt, ref, s_vt, s_ref, lengths = _appends(spec, seed=2)
    got = mg.transposed_v_operands(vt.kernel_format, s_vt, lengths)
    regs, _ = ref.decode_regions(s_ref, lengths)
    want = mg.prepare_region(regs[0])
    live = (np.arange(C)[None, :] < np.asarray(lengths)[:, None]).repeat(H, 0)       # [B*H, C]
    for a, b, axis in ((got.k, want.k, 1), (got.v, want.v, 2)):
        assert a.dtype == b.dtype and a.shape == b.shape
        m = live[:, :, None] if axis == 1 else live[:, None, :]
        np.testing.assert_array_equal(np.where(m, np.asarray(a, np.float32), 0),
                                      np.where(m, np.asarray(b, np.float32), 0))
    np.testing.assert_array_equal(np.asarray(got.k_head_scale), np.asarray(want.k_head_scale))
    np.testing.assert_array_equal(np.asarray(got.v_head_scale), np.asarray(want.v_head_scale))
    assert got.k_scale is None and got.kf == want.kf and got.vf == want.vf
    np.testing.assert_array_equal(np.asarray(got.end), np.asarray(lengths))


@pytest.mark.parametrize("name", ["e4m3-warmup-head", "e5m2-warmup-tensor"])
def test_fused_decode_matches_the_float64_oracle(name):
    vt, _, s_vt, _, lengths = _appends(SPECS[name], seed=3)
    rng = np.random.default_rng(4)
    g = 3
    q = jnp.asarray(rng.normal(0, 1, (B, H * g, D)), jnp.float32)
    k_new = jnp.asarray(rng.normal(0, 1, (B, H, D)), jnp.float32)
    v_new = jnp.asarray(rng.normal(0, 1, (B, H, D)), jnp.float32)
    dispatch.SERVED.clear()
    out = dispatch.decode_attention(q, vt, s_vt, lengths, k_new, v_new, impl="kernel")
    assert any(k[0] == "decode_attention_transposed_v" for k in dispatch.SERVED), dispatch.SERVED
    k, v, _ = vt.materialize_layer(s_vt, lengths)
    want = decode_attention_reference(np.asarray(q), [region(dense_operand(k), dense_operand(v), lengths)],
                                      k_new=np.asarray(k_new), v_new=np.asarray(v_new))
    err = np.abs(np.asarray(out, np.float64) - want).max() / np.abs(want).max()
    assert err < 1e-5, err


def test_dispatch_auto_on_cpu_serves_the_reference_and_says_why():
    vt, _, s_vt, _, lengths = _appends("fp8_e4m3", seed=5)
    q = jnp.ones((B, H * 2, D), jnp.bfloat16)
    dispatch.SERVED.clear()
    out = dispatch.decode_attention(q, vt, s_vt, lengths, impl="auto")
    assert out.shape == q.shape and np.isfinite(np.asarray(out, np.float32)).all()
    (key,) = [k for k in dispatch.SERVED if "TransposedVFormat" in k[1]]
    assert key[0] == "reference" and "no native TransposedVFormat kernel on cpu" in dispatch.SERVED[key]
    assert "fp8='e4m3'" in key[1]


def test_config_checks_read_the_fp8_format():
    """The launch-plan checks the dispatcher runs on a GPU (CPU-checkable): FP8's default block (64 tokens) and the
    head_dim rule; the format the kernels see is FP8 with per-head scales."""
    vt = make_scheme("fp8_e4m3_vt")
    st = vt.init_layer(2, 256, 2, 128)
    assert mg.transposed_v_kv_format(vt.kernel_format) == mg.KVFormat("e4m3", "head")
    assert mg.transposed_v_config_unsupported(vt.kernel_format, st, 128, 4) is None
    assert "head_dim 96" in mg.transposed_v_config_unsupported(vt.kernel_format, vt.init_layer(2, 256, 2, 96), 96, 4)
    assert "block_t" in (mg.transposed_v_config_unsupported(vt.kernel_format, vt.init_layer(2, 96, 2, 128), 128, 4)
                         or "")


def test_schema_differs_from_layout_1_and_names_the_layout():
    a, b = make_scheme("fp8_e4m3_vt:scales=warmup").schema, make_scheme("fp8_e4m3:scales=warmup").schema
    assert a != b and a.scheme == "fp8_vt" and dict(a.extra)["physical_layout"] == tv.FP8_LAYOUT_TAG
    assert dict(a.extra)["scale_source"] == "warmup" and a.kernel_family == "mosaic_gpu_swap_ab"
    assert a.key == b.key and a.value == b.value


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="FP8 codes are 8 bits with float32 per-head scales"):
        tv.TransposedVFormat(bits=4, qparam_dtype="fp32", fp8="e4m3")
    with pytest.raises(ValueError, match="fp8 must be"):
        tv.TransposedVFormat(bits=8, qparam_dtype="fp32", fp8="e3m4")
    with pytest.raises(ValueError, match="calibration_id"):
        FP8TransposedVScheme(scales="calibrated")
    vt = make_scheme("fp8_e4m3_vt")
    st = vt.init_layer(1, 8, 1, 4)
    k = np.ones((1, 2, 1, 4), np.float32)
    k[0, 1, 0, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite input"):         # as the layout-1 FP8 scheme: eager input
        vt.append_layer_with_status(st, jnp.zeros((1,), jnp.int32), k, k, jnp.array([2], jnp.int32))
    vt.validate_layer(st, jnp.zeros((1,), jnp.int32))                   # the old state is untouched and valid
