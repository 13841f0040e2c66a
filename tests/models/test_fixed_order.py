"""The fixed-order numerics (``kvquant_jax.models.fixed_order``): its primitives (fixed tree sums, the IEEE-ops
exp, softmax / log-softmax), per-row results independent of the batch with no mesh, and the config / CLI switch
(refused with W8A8).  The mesh invariance is tests/sharding/test_sharded_model.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.models import fixed_order as FO
from kvquant_jax.models.llama import forward_nocache
from kvquant_jax.models.testing import random_params, tiny_config


def test_tree_sum_is_the_documented_pairwise_tree():
    p = jnp.asarray(np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32))
    q = [p[0] + p[4], p[1] + 0.0, p[2] + 0.0, p[3] + 0.0]                    # zero-padded to 8, halves added
    want = (q[0] + q[2]) + (q[1] + q[3])
    np.testing.assert_array_equal(np.asarray(jax.jit(FO.tree_sum)(p)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(FO.tree_sum(p.T, axis=-1)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(FO.tree_sum(p[:1])), np.asarray(p[0]))


def test_exp_softmax_and_log_softmax_match_the_library_ones():
    z = np.linspace(-87.0, 0.0, 100_001, dtype=np.float32)
    got = np.asarray(jax.jit(FO.exp_nonpositive)(z)).astype(np.float64)
    assert np.max(np.abs(got - np.exp(z.astype(np.float64))) / np.exp(z.astype(np.float64))) <= 2e-7
    assert float(FO.exp_nonpositive(jnp.float32(-1e30))) == 0.0 and float(FO.exp_nonpositive(jnp.float32(0))) == 1.0
    s = jnp.asarray(np.random.default_rng(1).standard_normal((4, 7, 300)).astype(np.float32) * 4)
    s = s.at[:, :, :10].set(-1e30)                                            # masked entries
    np.testing.assert_allclose(np.asarray(FO.softmax(s)), np.asarray(jax.nn.softmax(s)), rtol=2e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(FO.log_softmax(s[..., 10:])), np.asarray(jax.nn.log_softmax(s[..., 10:])),
                               rtol=2e-6, atol=2e-6)


def test_row_chunks_are_a_property_of_the_model():
    assert FO.row_chunks("o", 576, 9) == 9 and FO.row_chunks("down", 1536, 9) == 3
    assert FO.row_chunks("down", 128, 8) == 8 and FO.row_chunks("q", 576, 9) == 1


@pytest.mark.parametrize("dtype", ["fp32"])
def test_rows_do_not_depend_on_the_batch(dtype):
    """No mesh: each sequence's logits are the same bits in a batch of 8, 3 or 1 (fixed order), and within float32
    rounding of the default numerics."""
    cfg = tiny_config(vocab_size=128, num_heads=8, num_kv_heads=4, hidden_size=64, intermediate_size=128,
                      num_layers=2, head_dim=16)
    params = random_params(cfg, seed=1, dtype=dtype)
    fixed = FO.apply_numerics(cfg, "fixed_order")
    toks = jnp.asarray(np.random.default_rng(2).integers(3, 128, (8, 12)), jnp.int32)
    run = jax.jit(forward_nocache, static_argnames=("cfg",))
    ref = np.asarray(run(params, fixed, toks))
    for b in (3, 1):
        np.testing.assert_array_equal(np.asarray(run(params, fixed, toks[:b])), ref[:b], err_msg=f"batch {b}")
    fast = np.asarray(run(params, cfg, toks))
    tol = 1e-5 if dtype == "fp32" else 5e-2
    assert np.abs(fast - ref).max() <= tol * np.abs(fast).max()


def test_switch_config_cli_and_refusals():
    from kvquant_jax import cli
    from kvquant_jax.config import from_dict
    from kvquant_jax.models.w8a8 import W8A8Policy

    cfg = tiny_config()
    assert FO.apply_numerics(cfg, "fast") is cfg
    fixed = FO.apply_numerics(cfg, "fixed_order")
    assert FO.is_fixed_order(fixed.activation) and FO.apply_numerics(fixed, "fixed_order") is fixed
    with pytest.raises(ValueError, match="reduction must be one of"):
        FO.apply_numerics(cfg, "fastest")
    import dataclasses
    with pytest.raises(ValueError, match="does not combine with a W8A8"):
        FO.apply_numerics(dataclasses.replace(cfg, activation=W8A8Policy()), "fixed_order")
    assert cli.main(["ppl", "--reduction", "fixed_order", "--w8a8"]) == 2
    with pytest.raises(ValueError, match="model.reduction"):
        from_dict({"model": {"reduction": "fixed_order"}, "activation": {"enabled": True}})
    with pytest.raises(ValueError, match="model.reduction"):
        from_dict({"model": {"reduction": "exact"}})
    assert from_dict({"model": {"reduction": "fixed_order"}}).model.reduction == "fixed_order"
    from kvquant_jax.eval.rows import _stable_block, row_key   # a fixed-order row never resumes from a fast one
    base, fixed_cfg = from_dict({}), from_dict({"model": {"reduction": "fixed_order"}})
    spec = base.cache.scheme
    assert row_key(base, "ppl", "point", spec) != row_key(fixed_cfg, "ppl", "point", spec)
    # and the default leaves the keys of rows written before the option existed unchanged
    assert "reduction" not in _stable_block(base, "model", base.to_dict()["model"])
