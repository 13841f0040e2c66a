import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.serving.sampling import SamplingParams, sample


def test_greedy_is_argmax():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 50)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(sample(logits, jax.random.PRNGKey(0), SamplingParams())),
                                  np.argmax(np.asarray(logits), -1))


def test_top_k_and_top_p_support():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((1, 40)).astype(np.float32) * 3
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    draw = jax.jit(jax.vmap(lambda k, sp=SamplingParams(1.0, 5, 1.0): sample(jnp.asarray(logits), k, sp)))
    got = set(np.asarray(draw(keys)).ravel().tolist())
    assert got <= set(np.argsort(-logits[0])[:5].tolist()) and len(got) > 1
    p = np.exp(logits[0] - logits[0].max())
    p /= p.sum()
    order = np.argsort(-p)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(p[order]), 0.7) + 1)].tolist())
    draw = jax.jit(jax.vmap(lambda k: sample(jnp.asarray(logits), k, SamplingParams(1.0, 0, 0.7))))
    got = set(np.asarray(draw(keys)).ravel().tolist())
    assert got <= nucleus and len(got) >= 1


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
