"""Continuous batching on the paged quantized KV cache vs the static-batch loop, on one seeded Poisson trace.

    # H200 (issue M): LLaMA-3-8B shape (random bf16 weights), bf16 vs int4 on ONE trace and ONE set of weights,
    # capacity-bound (192 requests arrive within ~24 s, far faster than either cache serves them); the defaults
    # are the run-2 engine settings: reserve admission, 8 x 512 prefill tokens per step, no prefix cache for
    # random prompts (docs/results/engine/README.md, "Changes since run 1", has the arithmetic)
    python experiments/bench_engine.py --model llama3-8b-shaped --cache bf16 int4 \
        --requests 192 --rate 8 --prompt-len 512 8192 --output-len 64 1024 --hbm-gb 16 --slots 128 \
        --page-size 64 --chunk 512 --prefill-slots 8 --admission reserve --view-buckets 2 --max-seconds 300 \
        --no-static --compile-cache /tmp/kvq-jax-cache --out docs/results/engine
    # (at --rate 2 this trace is arrival-bound -- fewer requests in flight than a bf16 pool holds -- so no cache
    # can show its capacity; docs/results/engine/README.md)
    # CPU smoke run (tiny model, short requests; a minute)
    python experiments/bench_engine.py --small

For every (model, cache): the engine (``kvquant_jax.serving.engine``: admission by free pages -- ``--admission
reserve`` covers every admitted request's prompt + ``max_new_tokens``, so none is preempted -- one decode forward
``[slots, 1]`` through the paged kernel plus one prefill forward of ``--prefill-slots`` chunks per step, the
paged-direct forward (``attention.paged.PagedStep``: no contiguous view of the cache), preemption by recompute
under ``--admission optimistic``, prefix cache with ``--shared-prefix``) replays the trace in real time with a page pool of ``--hbm-gb`` of KV
(``engine_cli.pages_for_budget``: a quantized cache gets proportionally more pages).  Every step shape
(``Engine.compile_shapes``: bounded, bucketed) is compiled before the clock starts (``compile_s``).  The
static-batch loop (``serving.generate`` on a contiguous cache) serves the same trace in arrival order in batches
as large as the same budget holds at full length, each batch waiting for its last arrival and its longest output
(run once untimed first -- bounded by ``--max-seconds`` too -- so it pays no compilation in the timed run).
Reported: output tokens/s, TTFT p50/p99, inter-token latency p50/p99, peak concurrent requests, preemptions,
compiled shapes, the paths that served, and the int4 / bf16 engine throughput ratio (issue M target: >= 1.8 at
the same budget).  A config stopped by ``--max-seconds`` reports the tokens served so far (``partial``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvquant_jax.cache.registry import make_scheme  # noqa: E402
from kvquant_jax.quant.dtypes import storage_name  # noqa: E402
from kvquant_jax.serving import engine as E  # noqa: E402
from kvquant_jax.serving.engine_cli import page_bytes, pages_for_budget, serve_bench  # noqa: E402
from kvquant_jax.serving.generate import generate  # noqa: E402


def load(name: str, dtype: str):
    import bench_serving as BS

    if name == "llama3-8b-shaped":
        cfg = BS.llama3_8b_shaped()
        return BS.random_params(cfg, dtype=jnp.dtype(dtype)), cfg
    if name == "smollm2":       # the real model: cast_params takes a storage name ("bf16"), not "bfloat16"
        cfg, params = BS.load_smollm2(storage_name(dtype))
        return params, cfg
    cfg = BS.tiny()
    return BS.random_params(cfg, dtype=jnp.dtype(dtype)), cfg


def live_bytes() -> int:
    """Bytes of every live JAX array after a full garbage collection: checked before each config, so one config's
    page pool (or static-loop cache) cannot survive into the next one's budget unnoticed.  A config starts with the
    weights alone (and the trace's small host-side arrays): ``live_bytes_before`` in every row."""
    gc.collect()
    return int(sum(a.nbytes for a in jax.live_arrays()))


def device_memory() -> dict:
    """The device allocator's bytes in use now and its peak so far (``memory_stats``; {} where the backend has none,
    e.g. CPU): recorded after each config, so an allocator limit (KIVI-2 at 16 GiB, 2026-12-02) shows in the rows."""
    ms = jax.devices()[0].memory_stats() or {}
    return {k: int(ms[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in ms}


def static_batches(params, cfg, scheme, reqs, batch: int, chunk: int, max_seconds: float | None = None) -> dict:
    """The static-batch loop: arrival-order batches of ``batch``; a batch starts when its last request arrived
    and the previous batch finished; every request waits for the batch's longest output.  ``max_seconds``: no
    batch starts after that long (``partial``)."""
    results, t0, peak, partial = {}, time.perf_counter(), 0, False
    for i in range(0, len(reqs), batch):
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            partial = True
            break
        group = reqs[i:i + batch]
        now = time.perf_counter() - t0
        if group[-1].arrival > now:
            time.sleep(group[-1].arrival - now)
        start = time.perf_counter() - t0
        res = generate(params, cfg, [list(r.prompt) for r in group], max_new_tokens=max(r.max_new_tokens for r in group),
                       scheme=scheme, prefill_chunk=chunk, eos_id=-1)
        peak = max(peak, len(group))
        first = start + res.prefill_seconds
        step = res.decode_seconds / max(res.decode_steps - 1, 1)
        for r, toks in zip(group, res.tokens):
            n = min(len(toks), r.max_new_tokens)
            results[r.id] = E.Result(r.id, toks[:n], "length", r.arrival, first,
                                     [first + k * step for k in range(n)])
    return {**E.summarize(results, time.perf_counter() - t0, peak), "partial": partial,
            "finished": len(results)}


TABLE = ("model", "cache", "system", "output_tok_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
         "peak_concurrent", "preemptions", "finished", "partial", "num_pages", "admission", "step_shapes",
         "compile_s")


def table(rows) -> str:
    """The rows as a Markdown table (floats to 4 significant digits)."""
    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))
    out = ["| " + " | ".join(TABLE) + " |", "|" + "---|" * len(TABLE)]
    out += ["| " + " | ".join(cell(r.get(k)) for k in TABLE) + " |" for r in rows]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", default=["llama3-8b-shaped"], choices=["llama3-8b-shaped", "smollm2", "tiny"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache", nargs="+", default=["bf16", "int8", "int4", "kivi2"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[512, 8192])
    ap.add_argument("--output-len", type=int, nargs=2, default=[64, 1024])
    ap.add_argument("--shared-prefix", type=int, default=0)
    ap.add_argument("--hbm-gb", type=float, default=16.0, help="KV-cache budget (the same for every cache)")
    ap.add_argument("--slots", type=int, default=128, help="upper bound; capped per cache (see below)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512,
                    help="prefill tokens per step and prefilling request (with --prefill-slots: the per-step "
                         "prefill budget, default 8 x 512 = 4096 tokens; docs/results/engine/README.md)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-static", action="store_true", help="skip the static-batch baseline")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop each config (engine replay, static loop) after this long and report it as partial")
    ap.add_argument("--static-max-seconds", type=float, default=None,
                    help="the static loop's timed window (default --max-seconds); its untimed warm-up pass, which "
                         "compiles the batch shapes, may run 1.5x as long so it reaches every batch the timed pass does")
    ap.add_argument("--prefill-slots", type=int, default=8, help="requests prefilling a chunk per engine step")
    ap.add_argument("--admission", default="reserve", choices=E.ADMISSIONS,
                    help="reserve: admit only while the pool covers every request's prompt + max_new_tokens (no "
                         "preemption); optimistic: prompt + one page per running request (preempts by recompute)")
    ap.add_argument("--prefix-cache", default="auto", choices=["auto", "on", "off"],
                    help="store prompt pages for reuse; auto: on iff --shared-prefix > 0 (random prompts never "
                         "hit, and storing every chunk's pages costs host time per step)")
    ap.add_argument("--view-buckets", type=int, default=4, help="compiled view sizes per phase (max_pages / 2^k)")
    ap.add_argument("--forward", default="direct", choices=["direct", "view"],
                    help="paged-direct forward, or the whole-view gather/scatter reference path")
    ap.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache directory")
    ap.add_argument("--small", action="store_true", help="CPU smoke sizes (tiny model, short requests)")
    ap.add_argument("--out", default=None,
                    help="directory: results.jsonl (appended) + latest_run.md (this run's table; a hand-written "
                         "README.md there is left alone)")
    args = ap.parse_args(argv)
    if args.small:
        args.model, args.dtype, args.requests, args.rate = ["tiny"], "float32", 12, 20.0
        args.prompt_len, args.output_len, args.hbm_gb = [32, 256], [8, 48], 0.001
        args.slots, args.page_size, args.chunk, args.prefill_slots = 6, 32, 64, 4
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    prefix_cache = args.prefix_cache == "on" or (args.prefix_cache == "auto" and args.shared_prefix > 0)
    rows = []

    def emit(row):
        """Print a finished config's row and append it to ``--out``/results.jsonl at once (a stopped process keeps
        the configs it finished)."""
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "results.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")

    for model in args.model:
        params, cfg = load(model, args.dtype)
        weights = live_bytes()                           # the weights (and nothing of an earlier model)
        reqs = E.synthetic_trace(args.requests, rate=args.rate, prompt_range=tuple(args.prompt_len),
                                 output_range=tuple(args.output_len), vocab_size=cfg.vocab_size, seed=args.seed,
                                 shared_prefix=args.shared_prefix)
        reqs = [r.__class__(r.id, r.prompt, r.max_new_tokens, r.sampling, (-1,), r.arrival) for r in reqs]  # no EOS
        longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)
        for spec in args.cache:
            scheme = make_scheme(spec, rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
            budget = args.hbm_gb * 2**30
            num_pages = pages_for_budget(scheme, cfg, args.page_size, budget)
            # slots: at most twice the requests the pool can hold at the trace's mean length (more would only be
            # preempted); the paged-direct step itself holds no slots x context view
            mean_len = float(np.mean([len(r.prompt) + r.max_new_tokens for r in reqs]))
            slots = max(1, min(args.slots, int(2 * num_pages * args.page_size / mean_len)))
            ec = E.EngineConfig(num_slots=slots, page_size=args.page_size, num_pages=num_pages,
                                max_pages=-(-longest // args.page_size), chunk=args.chunk, seed=args.seed,
                                forward=args.forward, prefill_slots=args.prefill_slots,
                                view_buckets=args.view_buckets, admission=args.admission,
                                prefix_cache=prefix_cache)
            before = live_bytes()
            if before > weights + (1 << 20):         # recorded, not fatal: a device block is too dear to abort
                print(f"[bench_engine] WARNING: {before - weights} bytes beyond the weights are live before the "
                      f"{spec} config (an earlier config's pool survived?)", file=sys.stderr, flush=True)
            row = {"model": model, "cache": spec, "system": "engine", "hbm_gb": args.hbm_gb,
                   "page_bytes": page_bytes(scheme, cfg, args.page_size), "live_bytes_before": before,
                   **serve_bench(params, cfg, scheme, reqs, ec, realtime=True, max_seconds=args.max_seconds)}
            row["device_memory"] = device_memory()
            emit(row)
            if not args.no_static:
                per_seq = page_bytes(scheme, cfg, args.page_size) * -(-longest // args.page_size)
                batch = max(1, int(budget // per_seq))
                warm = [r.__class__(r.id, r.prompt, r.max_new_tokens, r.sampling, r.stop, 0.0) for r in reqs]
                static_s = args.static_max_seconds if args.static_max_seconds is not None else args.max_seconds
                before = live_bytes()
                t0 = time.perf_counter()                     # compile every batch shape (bounded, 1.5x the window)
                static_batches(params, cfg, scheme, warm, batch, args.chunk,
                               None if static_s is None else 1.5 * static_s)
                srow = {"model": model, "cache": spec, "system": "static", "hbm_gb": args.hbm_gb, "batch": batch,
                        "live_bytes_before": before,
                        "compile_s": round(time.perf_counter() - t0, 2),
                        "max_seconds": static_s,
                        **static_batches(params, cfg, scheme, reqs, batch, args.chunk, static_s)}
                emit(srow)
        del params
        jax.clear_caches()
        gc.collect()
    ratio = {}
    for model in args.model:
        tps = {r["cache"]: r["output_tok_per_s"] for r in rows if r["model"] == model and r["system"] == "engine"}
        if "int4" in tps and "bf16" in tps:
            ratio[model] = round(tps["int4"] / tps["bf16"], 3)
    print(table(rows))
    print(json.dumps({"int4_over_bf16_engine_tok_per_s": ratio, "target": 1.8}))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "latest_run.md"), "w") as f:
            f.write(f"# Engine benchmark\n\n`python experiments/bench_engine.py {' '.join(argv or sys.argv[1:])}`\n\n")
            f.write(table(rows) + "\n")
            f.write(f"\nint4 / bf16 engine output tokens/s: {ratio} (target >= 1.8)\n")
    return rows


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
