"""``llama.forward(..., logits_at=)`` returns the logits of one position per row: equal to the full forward's logits
at those positions (the rest of the forward -- cache, ok -- unchanged), for the plain and the fixed-order head."""
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.interface import init_cache
from kvquant_jax.models.fixed_order import FixedOrderLinear
from kvquant_jax.models.llama import forward
from kvquant_jax.models.testing import random_params, tiny_config


@pytest.mark.parametrize("fixed", [False, True])
def test_logits_at_equals_the_full_forward_at_those_positions(fixed):
    cfg = tiny_config()
    linear = FixedOrderLinear.for_config(cfg) if fixed else None
    params = random_params(cfg, seed=3, dtype="fp32")
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 9)), jnp.int32)
    num_new = jnp.asarray([9, 4, 1], jnp.int32)
    at = num_new - 1

    def cache():
        c = init_cache(FullPrecisionScheme(), num_layers=cfg.num_layers, batch=3, capacity=16,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        return c.replace(lengths=jnp.asarray([0, 2, 5], jnp.int32))

    full, c_full, ok_full = forward(params, cfg, tokens, cache(), num_new, linear=linear)
    one, c_one, ok_one = forward(params, cfg, tokens, cache(), num_new, linear=linear, logits_at=at)
    assert one.shape == (3, 1, cfg.vocab_size)
    want = np.take_along_axis(np.asarray(full), np.asarray(at)[:, None, None], axis=1)
    np.testing.assert_allclose(np.asarray(one), want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(one)[0, 0], np.asarray(full)[0, 0])     # row 0 asked for position 8, not 0
    np.testing.assert_array_equal(np.asarray(c_one.lengths), np.asarray(c_full.lengths))
    assert bool(ok_one) and bool(ok_full)
