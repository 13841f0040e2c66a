"""``cache.layers`` rules naming layer types: ``local`` (sliding-window) / ``global`` layers, mixed with explicit
indices and ranges, resolved against the model; the evaluation policy's caches keep local layers in a window ring."""
import pytest

from kvquant_jax.config import ConfigError, from_dict
from kvquant_jax.eval.policy import build_policy
from kvquant_jax.models.testing import tiny_config, tiny_gemma_config


def _families(pol):
    return [(s.family, getattr(s, "bits", getattr(s, "k_bits", None))) for s in pol.schemes]


def test_local_bf16_global_kivi_and_the_reverse_with_an_explicit_layer():
    cfg = tiny_gemma_config()                                 # layers: local, local, global, local
    c = from_dict({"cache": {"scheme": "int8", "layers": [{"layers": "local", "scheme": "bf16"},
                                                          {"layers": "global", "scheme": "kivi2:group_size=8,v_group_size=16,"
                                                                                         "residual=8"}]}})
    assert [s.family for s in build_policy(c.cache, cfg).schemes] == ["full", "full", "kivi", "full"]
    c = from_dict({"cache": {"scheme": "bf16", "layers": [{"layers": ["local", 2], "scheme": "int4"},
                                                          {"layers": "0-0", "scheme": "int8"}]}})
    assert _families(build_policy(c.cache, cfg)) == [("per_token", 8), ("per_token", 4), ("per_token", 4),
                                                     ("per_token", 4)]
    cache = build_policy(c.cache, cfg).init(cfg, 1, 32)
    assert [type(s).__name__ for s, _, _ in cache.schemes] == ["WindowScheme", "WindowScheme", "PerTokenScheme",
                                                               "WindowScheme"]


def test_layer_type_errors():
    c = from_dict({"cache": {"scheme": "int8", "layers": [{"layers": "local", "scheme": "bf16"}]}})
    with pytest.raises(ValueError, match=r"cache.layers\[0\].layers: model tiny-random has no local layers"):
        build_policy(c.cache, tiny_config())
    with pytest.raises(ConfigError, match=r"cache.layers\[0\].layers: .*layer type 'local' / 'global'.*'sliding'"):
        from_dict({"cache": {"scheme": "int8", "layers": [{"layers": "sliding", "scheme": "bf16"}]}})
    with pytest.raises(ConfigError, match=r"cache.layers\[0\].layers\[1\]"):
        from_dict({"cache": {"scheme": "int8", "layers": [{"layers": ["local", "x-y"], "scheme": "bf16"}]}})
