"""``kvq serve-bench``: replay a request trace through the continuous-batching engine (serving/engine.py).

The trace is a JSONL file (``engine.read_trace``) or a seeded synthetic one (Poisson arrivals).  The pool is sized
by ``--num-pages`` or by ``--hbm-gb`` (pages that fit the budget for this cache scheme: a quantized cache gets
more pages, hence more concurrent requests; the budget is one device's, so with ``--mesh model=M`` splitting the KV
heads the pool holds M times the pages).  Prints one JSON line: output tokens/s, TTFT and inter-token latency
p50/p99, peak concurrent requests, preemptions, prefix-cache hit tokens and the engine geometry.
"""
from __future__ import annotations

import json
import time

import jax
import numpy as np

from kvquant_jax import sharding as S
from kvquant_jax.cache import paged
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.models import load_model
from kvquant_jax.models.testing import random_params, tiny_config
from kvquant_jax.serving.engine import (ADMISSIONS, Engine, EngineConfig, Request, read_trace, summarize,
                                        synthetic_trace)


def page_bytes(scheme, cfg, page_size: int) -> int:
    """Bytes of one page across every layer's pools for ``scheme`` (shape arithmetic only, nothing allocated)."""
    shapes = jax.eval_shape(lambda: paged.init_paged(
        scheme, num_layers=cfg.num_layers, batch=1, num_pages=1, page_size=page_size, max_pages=1,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)[0])
    total = 0
    for lay, st in zip(shapes.layouts, shapes.groups):
        for f in lay:
            if f.kind == paged.PAGED:
                a = getattr(st, f.name)
                total += int(np.prod(a.shape)) // a.shape[1] * np.dtype(a.dtype).itemsize
    return total


def pages_for_budget(scheme, cfg, page_size: int, hbm_bytes: float) -> int:
    """Pages of ``page_size`` rows that fit ``hbm_bytes`` of KV cache."""
    n = int(hbm_bytes // page_bytes(scheme, cfg, page_size))
    if n < 1:
        raise ValueError(f"a KV budget of {hbm_bytes / 2**30:.3f} GiB holds no page of {page_size} rows")
    return n


def serve_bench(params, cfg, scheme, requests, engine_config, *, realtime: bool = True, warmup: bool = True,
                max_seconds: float | None = None, mesh=None) -> dict:
    """Run ``requests`` through a fresh :class:`~kvquant_jax.serving.engine.Engine`; returns ``summarize``'s
    dict plus the geometry, the compiled step shapes and which path served each phase.  ``warmup`` first
    compiles every step shape (``Engine.warmup``; its seconds are reported as ``compile_s``, not timed).
    ``max_seconds``: stop stepping once the run took that long (``partial``: True; the summary covers the tokens
    served so far, ``finished`` counts completed requests).  ``mesh``: a ``(data=1, model)`` mesh the engine runs
    on (``Engine(mesh=)``: pools split over KV heads), None: one device."""
    eng = Engine(params, cfg, scheme, engine_config, mesh=mesh)
    for r in requests:                                   # refuse a trace with a request that can never run
        eng.check(r)
    compile_s = eng.warmup() if warmup else 0.0
    t0 = time.perf_counter()
    for _ in eng.stream(requests, realtime=realtime, max_seconds=max_seconds):
        pass
    seconds = time.perf_counter() - t0
    partial = eng.stopped
    out = summarize(eng.results, seconds, eng.peak_running)
    out.update(partial=partial, finished=sum(bool(r.reason) for r in eng.results.values()),
               submitted=len(eng.results), steps=eng.steps, compile_s=round(compile_s, 2),
               step_shapes=len(eng.step_shapes), num_pages=engine_config.num_pages,
               page_size=engine_config.page_size, num_slots=engine_config.num_slots, chunk=engine_config.chunk,
               forward=engine_config.forward, admission=engine_config.admission,
               prefill_slots=engine_config.prefill_slots, prefix_cache=engine_config.prefix_cache, paths=eng.paths,
               mesh=None if mesh is None else ",".join(f"{k}={v}" for k, v in mesh.shape.items()),
               family=getattr(scheme, "family", "full") if scheme is not None else "full")
    return out


def _load_model(name: str, dtype: str):
    if name == "tiny":
        cfg = tiny_config(max_position=4096)
        return random_params(cfg, seed=0, dtype=dtype), cfg
    m = load_model(name if name != "smollm2" else None, dtype=dtype)
    return m.params, m.cfg


def cmd_serve_bench(args) -> None:
    mesh = None if args.mesh is None else S.make_mesh(S.parse_mesh(args.mesh))
    params, cfg = _load_model(args.model, args.dtype)
    scheme = None if args.cache is None else make_scheme(args.cache, rope_theta=cfg.rope_theta,
                                                         rope_pairing=cfg.rope_pairing)
    if args.trace:
        reqs = read_trace(args.trace)
    else:
        reqs = synthetic_trace(args.synthetic, rate=args.rate, prompt_range=tuple(args.prompt_len),
                               output_range=tuple(args.output_len), vocab_size=cfg.vocab_size, seed=args.seed,
                               shared_prefix=args.shared_prefix)
    if not reqs:
        raise ValueError("serve-bench: the trace holds no request")
    longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)
    max_pages = args.max_pages or -(-longest // args.page_size)
    if args.num_pages is None and args.hbm_gb is None:
        raise ValueError("serve-bench: give --num-pages or --hbm-gb")
    # --hbm-gb is the KV budget of ONE device: on a mesh that splits the KV heads M ways every device holds 1/M of
    # each page, so the pool holds M times the pages (one device's bytes = the budget); replicated heads: as one
    split = 1 if mesh is None else int(mesh.shape[S.MODEL])
    if not S.kv_heads_sharded(cfg.num_kv_heads, split):
        split = 1
    num_pages = args.num_pages or pages_for_budget(scheme or make_scheme("fp32"), cfg, args.page_size,
                                                   args.hbm_gb * 2**30 * split)
    ec = EngineConfig(num_slots=args.slots, page_size=args.page_size, num_pages=num_pages, max_pages=max_pages,
                      chunk=args.chunk, prefix_cache=not args.no_prefix_cache, seed=args.seed,
                      attention_impl=args.attention, forward=args.forward, prefill_slots=args.prefill_slots,
                      view_buckets=args.view_buckets, admission=args.admission)
    out = serve_bench(params, cfg, scheme, reqs, ec, realtime=not args.no_realtime, max_seconds=args.max_seconds,
                      mesh=mesh)
    print(json.dumps({"model": args.model, "cache_spec": args.cache or "fp32", **out}))


def add_parsers(sub) -> None:
    p = sub.add_parser("serve-bench", help="replay a request trace through the continuous-batching engine "
                                           "(paged quantized KV cache)")
    p.add_argument("--model", default="smollm2", help="'tiny' (random tiny model), 'smollm2', or a model path")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--cache", default=None, help="cache scheme spec (registry name, e.g. int4, kivi2)")
    p.add_argument("--trace", default=None, help="JSONL trace (id, arrival, prompt, max_new_tokens, ...)")
    p.add_argument("--synthetic", type=int, default=16, help="requests of a synthetic Poisson trace (no --trace)")
    p.add_argument("--rate", type=float, default=4.0, help="synthetic arrivals per second")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    p.add_argument("--shared-prefix", type=int, default=0, help="common prompt prefix tokens (prefix cache)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--hbm-gb", type=float, default=None,
                   help="size the pool to this KV budget (GiB per device) instead")
    p.add_argument("--max-pages", type=int, default=None, help="pages per sequence (default: the longest request)")
    p.add_argument("--chunk", type=int, default=64, help="prefill tokens per step and slot")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--no-realtime", action="store_true", help="submit every request at once (ignore arrivals)")
    p.add_argument("--attention", default="auto", choices=["auto", "reference", "kernel"])
    p.add_argument("--forward", default="direct", choices=["direct", "view"],
                   help="paged-direct forward (default) or the whole-view gather/scatter reference path")
    p.add_argument("--prefill-slots", type=int, default=4, help="requests prefilling a chunk per step")
    p.add_argument("--view-buckets", type=int, default=4, help="compiled view sizes per phase")
    p.add_argument("--admission", default=EngineConfig.admission, choices=ADMISSIONS,
                   help="optimistic: prompt + one page per running request (may preempt); reserve: every "
                        "request's prompt + max_new_tokens (never preempts)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop the replay after this long (partial)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default=None,
                   help="device mesh 'model=M' (data must be 1): tensor parallel, page pools split over KV heads "
                        "(--hbm-gb is then each device's KV budget: M times the pages when the KV heads split M ways; CPU: "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    p.set_defaults(func=cmd_serve_bench)
