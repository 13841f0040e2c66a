"""Shared tiny random model and config helpers for the evaluation tests."""
import numpy as np
import pytest

TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
            vocab_size=320)


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


def tiny_yaml(**blocks) -> str:
    """A YAML config on the random model and the built-in corpus with tiny task sizes."""
    import yaml

    cfg = {
        "name": "tiny",
        "model": {"name": "random", "random": {k: v for k, v in TINY.items()}},
        "data": {"corpus": "builtin"},
        "tasks": {"ppl": {"seq_len": 48, "max_segments": 2, "chunk": 16},
                  "serving_ppl": {"prefill": 16, "decode": 12},
                  "kv_error": {"seq_len": 40, "prefill": 16, "probes": 3, "position_bins": 4},
                  "agreement": {"prompt_tokens": 12, "new_tokens": 8},
                  "passkey": {"enabled": False, "lengths": [320], "depths": [0.0, 1.0], "max_new_tokens": 3,
                              "batch_size": 2},
                  "bytes": {"length": 64}},
    }
    for k, v in blocks.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            for kk, vv in v.items():
                if isinstance(vv, dict) and isinstance(cfg[k].get(kk), dict):
                    cfg[k][kk] = {**cfg[k][kk], **vv}
                else:
                    cfg[k][kk] = vv
        else:
            cfg[k] = v
    return yaml.safe_dump(cfg, sort_keys=False)
