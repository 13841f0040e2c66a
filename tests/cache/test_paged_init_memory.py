"""``paged.init_paged`` allocates only the arrays the paged cache holds (the KIVI-2 engine OOM, 2026-12).

The pools used to come from an eager ``init_cache`` at the pool's batch (``num_pages + 1``), which also built every
*per-sequence* field at that batch and then dropped it: KIVI-2's residual rings at the LLaMA-3-8B ``bench_engine``
geometry (10923 pages x 8 KV heads x 128 / 129 ring rows x 128, fp16) are 2.67 + 2.69 GiB per layer -- the
allocations the H200's BFC allocator failed on every ~10 s -- and 171 GiB over 32 layers for a 16 GiB pool.  bf16
and int4 have no per-sequence field, so they never showed it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from kvquant_jax.cache import paged
from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.registry import make_scheme

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _concrete_bytes(tree) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree) if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer))


@pytest.mark.parametrize("layer_groups", ["runs", "per_layer"])
def test_init_paged_builds_no_per_sequence_field_at_pool_batch(monkeypatch, layer_groups):
    """Every concrete array a KIVI ``init_layer`` produces during ``init_paged`` is part of the cache: nothing is
    built at the pool's batch beyond the pools themselves (the rings stay at ``batch`` sequences)."""
    scheme = make_scheme({"name": "kivi2", "group_size": 8, "v_group_size": 8, "residual": 32})
    made = []
    orig = KIVIScheme.init_layer

    def spy(self, batch, capacity, num_kv_heads, head_dim):
        st = orig(self, batch, capacity, num_kv_heads, head_dim)
        made.append((batch, _concrete_bytes(st), _concrete_bytes((st.k_res, st.v_res))))
        return st

    monkeypatch.setattr(KIVIScheme, "init_layer", spy)
    num_pages, batch = 255, 2
    cache, _ = paged.init_paged(scheme, num_layers=2, batch=batch, num_pages=num_pages, page_size=16, max_pages=4,
                                num_kv_heads=2, head_dim=32, layer_groups=layer_groups)
    ring_bytes_at_pool = sum(r for b, _, r in made if b == num_pages + 1)
    assert ring_bytes_at_pool == 0, f"residual rings built at the pool's batch: {ring_bytes_at_pool} bytes"
    assert sum(c for _, c, _ in made) <= paged.measured_nbytes(cache)
    for g in cache.groups:                         # the layout is unchanged: pools [L_g, P + 1, ...], rings [L_g, B, ...]
        assert g.k_codes.shape[1] == num_pages + 1 and g.k_res.shape[1] == batch and g.v_res.shape[1] == batch
        assert np.all(np.asarray(g.k_scale) == 1) and not np.any(np.asarray(g.k_res))


def test_init_paged_peak_host_memory_is_the_pool():
    """Behavioural: the process's peak RSS while building a KIVI-2 pool whose rings at the pool's batch would be
    ~0.5 GiB (and ~1 GiB transiently) stays within a small multiple of the pool's own ~25 MB."""
    code = textwrap.dedent("""
        import json, resource, jax, jax.numpy as jnp
        from kvquant_jax.cache import paged
        from kvquant_jax.cache.registry import make_scheme
        s = make_scheme("kivi2")
        jax.block_until_ready(jnp.zeros(8) + 1)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cache, _ = paged.init_paged(s, num_layers=1, batch=4, num_pages=1023, page_size=32, max_pages=4,
                                    num_kv_heads=8, head_dim=128, layer_groups="per_layer")
        jax.block_until_ready(cache)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"delta": (after - before) * 1024, "cache": paged.measured_nbytes(cache)}))
    """)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["cache"] < 64 << 20
    assert r["delta"] < r["cache"] + (256 << 20), f"peak RSS grew {r['delta'] >> 20} MiB for a {r['cache'] >> 20} MiB cache"
