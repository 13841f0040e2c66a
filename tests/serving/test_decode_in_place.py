"""The jitted decode loop updates the donated cache in place: no per-step copy of the cache."""
import jax
import jax.numpy as jnp
import pytest

from kvquant_jax.cache.interface import init_cache
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.models.testing import random_params, tiny_config
from kvquant_jax.serving.generate import decode_loop
from kvquant_jax.serving.sampling import SamplingParams


def _compiled_memory(spec, num_layers):
    cfg = tiny_config(num_layers=num_layers, head_dim=32, num_heads=3, num_kv_heads=1)
    scheme = make_scheme(spec, rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
    cache = init_cache(scheme, num_layers=num_layers, batch=4, capacity=2048, num_kv_heads=1, head_dim=32)
    cache_bytes = sum(a.nbytes for a in jax.tree.leaves(cache))
    ma = decode_loop.lower(random_params(cfg), cfg, jnp.zeros((4,), jnp.int32), cache, jax.random.PRNGKey(0),
                           max_new=4, sampling=SamplingParams(), eos_id=2).compile().memory_analysis()
    return cache_bytes, ma


@pytest.mark.parametrize("spec", ["fp32", "kivi2"])
def test_decode_loop_aliases_cache_and_temp_does_not_grow_with_layers(spec):
    small_bytes, small = _compiled_memory(spec, 2)
    big_bytes, big = _compiled_memory(spec, 6)
    assert big.alias_size_in_bytes >= big_bytes          # the whole cache is donated and aliased to the output
    # A per-step copy of the cache would add ~big_bytes - small_bytes of temporaries; a layer-local workspace does not.
    assert big.temp_size_in_bytes - small.temp_size_in_bytes < 0.25 * (big_bytes - small_bytes)
