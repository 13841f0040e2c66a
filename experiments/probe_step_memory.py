"""Memory of the engine at the LLaMA-3-8B ``bench_engine`` geometry, from shapes only (no weights allocated).

Per cache scheme: the pool geometry ``bench_engine.py`` builds (``--hbm-gb`` 16, 128 slots, page 64, chunk 512, 8
prefill slots, 2 view buckets, the seed-0 trace of 192 requests), the bytes ``paged.init_paged`` allocates (and
what the pre-fix eager ``init_cache`` at the pool's batch built on top: per-sequence fields at ``num_pages + 1``,
KIVI-2's residual rings 2.67 + 2.69 GiB a layer -- the H200 OOM), and the jitted paged-direct step
(``engine._step_direct``) compiled at that geometry with XLA's memory analysis and its biggest HLO buffers
(``--layers`` 1-2 keeps a CPU compile short; everything else is the 8B shape).

    PYTHONPATH=. python experiments/probe_step_memory.py --init --cache bf16 int4 int8 kivi2
    PYTHONPATH=. python experiments/probe_step_memory.py --cache int4 kivi2 --layers 2 --phase decode
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvquant_jax.attention import paged as paged_attention  # noqa: E402
from kvquant_jax.cache import paged  # noqa: E402
from kvquant_jax.cache.registry import make_scheme  # noqa: E402
from kvquant_jax.serving import engine as E  # noqa: E402
from kvquant_jax.serving.engine_cli import pages_for_budget  # noqa: E402

DT = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1, "s32": 4, "pred": 1, "u32": 4, "s8": 1, "f64": 8, "s64": 8}


def biggest(hlo: str, n: int = 12):
    """(bytes, line) of the largest array-shaped instruction results in the optimized HLO text."""
    out = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]", line)
        if not m or m.group(3) not in DT:
            continue
        dims = [int(x) for x in m.group(4).split(",") if x]
        out.append((int(np.prod(dims)) * DT[m.group(3)], line.strip()[:400]))
    out.sort(key=lambda x: -x[0])
    seen, res = set(), []
    for b, l in out:
        if l in seen:
            continue
        seen.add(l)
        res.append((b, l))
        if len(res) >= n:
            break
    return res


def geometry(spec, cfg, a):
    scheme = make_scheme(spec, rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
    num_pages = pages_for_budget(scheme, cfg, a.page_size, a.hbm_gb * 2**30)
    reqs = E.synthetic_trace(a.requests, rate=a.rate, prompt_range=(512, 8192), output_range=(64, 1024),
                             vocab_size=cfg.vocab_size, seed=0)
    longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)
    mean_len = float(np.mean([len(r.prompt) + r.max_new_tokens for r in reqs]))
    slots = max(1, min(a.slots, int(2 * num_pages * a.page_size / mean_len)))
    ec = E.EngineConfig(num_slots=slots, page_size=a.page_size, num_pages=num_pages,
                        max_pages=-(-longest // a.page_size), chunk=a.chunk, prefill_slots=a.prefill_slots,
                        view_buckets=a.view_buckets, admission="reserve", prefix_cache=False,
                        attention_impl=a.impl)
    return scheme, ec


def init_report(spec, a) -> dict:
    """Bytes of the pools ``init_paged`` holds vs the fields an eager ``init_cache`` at the pool's batch would
    also build (``jax.eval_shape``: nothing allocated)."""
    import bench_serving as BS
    from kvquant_jax.cache.interface import init_cache
    cfg = BS.llama3_8b_shaped()
    scheme, ec = geometry(spec, cfg, a)
    off, lay = paged.field_layouts(scheme, ec.page_size, cfg.num_kv_heads, cfg.head_dim)
    big = jax.eval_shape(lambda: init_cache(scheme, num_layers=cfg.num_layers, batch=ec.num_pages + 1,
                                            capacity=off + ec.page_size, num_kv_heads=cfg.num_kv_heads,
                                            head_dim=cfg.head_dim, layer_groups="per_layer"))
    kinds, per_layer = {}, {}
    for st in big.groups:
        for f in lay:
            x = getattr(st, f.name)
            kinds[f.kind] = kinds.get(f.kind, 0) + x.size * x.dtype.itemsize
            if f.kind != paged.PAGED:
                per_layer[f.name] = [list(x.shape), str(x.dtype), round(x.size * x.dtype.itemsize / 2**30, 3)]
    row = {"cache": spec, "num_pages": ec.num_pages, "slots": ec.num_slots, "max_pages": ec.max_pages,
           "pool_GiB": round(kinds.get(paged.PAGED, 0) / 2**30, 2),
           "eager_init_extra_GiB": round(sum(v for k, v in kinds.items() if k != paged.PAGED) / 2**30, 2),
           "extra_fields_per_layer": per_layer}
    print(json.dumps(row), flush=True)
    return row


def probe(spec, a):
    import bench_serving as BS
    cfg = BS.llama3_8b_shaped()
    scheme, ec = geometry(spec, cfg, a)          # pool geometry from the FULL 32-layer model
    cfg = cfg.__class__(**{**cfg.__dict__, "num_layers": a.layers}) if a.layers != cfg.num_layers else cfg
    params = jax.eval_shape(lambda: BS.random_params(cfg, dtype=jnp.bfloat16))
    cache = jax.eval_shape(lambda: paged.init_paged(
        scheme, num_layers=cfg.num_layers, batch=ec.num_slots, num_pages=ec.num_pages, page_size=ec.page_size,
        max_pages=ec.max_pages, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        layer_groups=a.layer_groups)[0])
    ladder = E.view_ladder(ec.max_pages, ec.view_buckets)
    # window pages as Engine._window_pages computes them (host arithmetic on a concrete small cache object)
    c = cache
    rows = {"decode": ec.num_slots, "prefill": min(ec.prefill_slots, ec.num_slots)}[a.phase]
    t = 1 if a.phase == "decode" else ec.chunk
    lengths = np.arange(c.row_offset, c.capacity, dtype=np.int64)
    worst = np.max(c.pages_needed(np.minimum(lengths + t, c.capacity)) - paged.window_first(c, lengths))
    win = E.bucket(max(int(worst), 1), c.max_pages)
    view = ladder[-1] if a.view is None else a.view
    S, M = ec.num_slots, ec.max_pages
    sds = jax.ShapeDtypeStruct
    args = (params, cfg, cache, sds((rows,), jnp.int32), sds((rows, t), jnp.int32), sds((rows,), jnp.int32),
            sds((rows, M), jnp.bool_), sds((rows,), jnp.int32), sds((rows,), jnp.float32), sds((rows,), jnp.int32),
            sds((rows,), jnp.float32), sds((2,), jnp.uint32), sds((rows,), jnp.int32), sds((rows,), jnp.int32))
    t0 = time.perf_counter()
    lowered = E._step_direct.lower(*args, attention_impl=a.impl, view_pages=view, window_pages=win,
                                   host_state=sds((S, M + 1), jnp.int32))
    comp = lowered.compile()
    ma = comp.memory_analysis()
    hlo = comp.as_text()
    pool_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache))
    row = {"cache": spec, "phase": a.phase, "layers": a.layers, "impl": a.impl, "slots": S,
           "num_pages": ec.num_pages, "max_pages": M, "ladder": ladder, "view_pages": view, "window_pages": win,
           "rows": rows, "T": t, "cache_bytes": pool_bytes,
           "argument_bytes": ma.argument_size_in_bytes, "output_bytes": ma.output_size_in_bytes,
           "alias_bytes": ma.alias_size_in_bytes, "temp_bytes": ma.temp_size_in_bytes,
           "compile_s": round(time.perf_counter() - t0, 1), "paths": dict(("/".join(k), v) for k, v in paged_attention.PATHS.items())}
    print(json.dumps(row), flush=True)
    for b, l in biggest(hlo, a.top):
        print(f"  {b / 2**30:8.3f} GiB  {l}")
    if a.dump:
        with open(f"{a.dump}/{spec}_{a.phase}_{a.layers}.hlo", "w") as f:
            f.write(hlo)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", nargs="+", default=["int4", "kivi2"])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--phase", default="decode", choices=["decode", "prefill"])
    ap.add_argument("--impl", default="kernel")
    ap.add_argument("--layer-groups", default="per_layer")
    ap.add_argument("--view", type=int, default=None)
    ap.add_argument("--hbm-gb", type=float, default=16.0)
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--prefill-slots", type=int, default=8)
    ap.add_argument("--view-buckets", type=int, default=2)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--init", action="store_true", help="report init_paged's allocations only (no compile)")
    a = ap.parse_args(argv)
    for spec in a.cache:
        (init_report if a.init else probe)(spec, a)


if __name__ == "__main__":
    main()
