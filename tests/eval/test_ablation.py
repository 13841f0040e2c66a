"""The simulated KIVI axis-ablation scheme against the real KIVI cache (an independent implementation of the
same quantizer + closure rule): identical values for KIVI's axes, and for the swapped axes after swapping K/V."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.axis_ablation import AxisAblationScheme
from kvquant_jax.quant.ledger import LedgerShape, ledger

B, H, D, C = 2, 2, 16, 40


def _fill(scheme, k, v, steps):
    """Prefill ``steps[0]`` rows, then one-row appends: returns materialized (k, v, valid) at the end."""
    st = scheme.init_layer(B, C, H, D)
    lengths = jnp.zeros((B,), jnp.int32)
    pos = 0
    append = jax.jit(scheme.append_layer)
    for n in steps:
        st = append(st, lengths, jnp.asarray(k[:, pos:pos + n]), jnp.asarray(v[:, pos:pos + n]),
                                 jnp.full((B,), n, jnp.int32))
        lengths = lengths + n
        pos += n
    return [np.asarray(x) for x in jax.jit(scheme.materialize_layer)(st, lengths)]


@pytest.mark.parametrize("residual, residual_dtype", [(0, "fp32"), (16, "fp16")])
def test_kivi_axes_match_kivi(rng, residual, residual_dtype):
    k = rng.standard_normal((B, 30, H, D)).astype(np.float32) * 3
    v = rng.standard_normal((B, 30, H, D)).astype(np.float32)
    steps = [13] + [1] * 17
    common = dict(group_size=8, residual=residual, residual_dtype=residual_dtype)
    ref = _fill(KIVIScheme(k_bits=2, v_bits=4, v_group_size=8, **common), k, v, steps)
    sim = _fill(AxisAblationScheme(k_axis="channel", v_axis="token", k_bits=2, v_bits=4, token_group_size=8,
                                   **common), k, v, steps)
    for a, b in zip(ref, sim):
        np.testing.assert_array_equal(a, b)
    # swapped axes: K per token / V per channel is KIVI with the roles of K and V exchanged
    ref_sw = _fill(KIVIScheme(k_bits=4, v_bits=2, v_group_size=8, **common), v, k, steps)
    sim_sw = _fill(AxisAblationScheme(k_axis="token", v_axis="channel", k_bits=2, v_bits=4, token_group_size=8,
                                      **common), k, v, steps)
    np.testing.assert_array_equal(sim_sw[0], ref_sw[1])
    np.testing.assert_array_equal(sim_sw[1], ref_sw[0])
    assert np.abs(sim_sw[0][:, :, :30] - np.swapaxes(k, 1, 2)).max() > 0     # it does quantize


def test_logical_bits_match_the_kivi_ledger():
    for length in (1, 37, 200):
        kivi = KIVIScheme(k_bits=2, v_bits=2, group_size=32, v_group_size=32, residual=64)
        shape = LedgerShape(num_layers=1, batch=1, num_kv_heads=1, head_dim=64, length=length, capacity=256)
        led = ledger(kivi, shape).logical
        sim = AxisAblationScheme(k_bits=2, v_bits=2, group_size=32, token_group_size=32, residual=64)
        bits = sim.logical_bits(length, 64)
        for c in ("codes", "qparams", "residual"):
            assert bits[c] * 2 * length * 64 / 8 == pytest.approx(led[c]), (length, c)


@pytest.mark.parametrize("kw, msg", [
    (dict(k_axis="head"), "k_axis"), (dict(residual=20, group_size=8), "multiple of group_size"),
    (dict(v_bits=9), "v_bits"), (dict(qparam_dtype="fp64"), "qparam_dtype")])
def test_bad_ablation_settings_raise(kw, msg):
    with pytest.raises(ValueError, match=msg):
        AxisAblationScheme(**kw)
