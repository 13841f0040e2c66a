"""Shared tiny random model and config helpers for the evaluation tests."""
import numpy as np
import pytest

from eval_helpers import TINY


@pytest.fixture(scope="session")
def tiny():
    """(cfg, params) of a 2-layer random LLaMA (hidden 64, 4 q heads / 2 kv heads, head_dim 16)."""
    from kvquant_jax.models.testing import random_params, tiny_config

    cfg = tiny_config(**TINY, max_position=4096)
    return cfg, random_params(cfg, seed=0)


@pytest.fixture
def tokens():
    def make(b, t, seed=0):
        return np.random.default_rng(seed).integers(3, 300, size=(b, t)).astype(np.int32)

    return make
