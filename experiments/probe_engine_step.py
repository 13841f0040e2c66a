"""Where an engine step's time goes (issue M): host work vs each jitted forward, decode vs prefill, kernel vs view.

The H200 engine run of 2026-12-01 (docs/results/engine/) stepped at 145 ms (bf16, 54 slots) and 297 ms (int4, 128
slots) while the static loop decoded at 9-12 ms per token: this isolates the step.  For each (cache,
attention_impl) it builds the engine of ``bench_engine.py`` at the same KV budget, admits ``--slots`` requests of
``--prompt`` random tokens at once, and times every step split into the jitted forwards (blocked until ready;
decode ``[S, 1]`` and prefill ``[prefill_slots, chunk]`` separately) and the host rest (admission, page reserve,
bookkeeping).  ``--trace DIR`` also records a Perfetto trace of ``--trace-steps`` decode-only steps.

    python experiments/probe_engine_step.py --cache bf16 int4 --impl auto reference --out /tmp/probe.json
    python experiments/probe_engine_step.py --small          # CPU smoke run (tiny model)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

from kvquant_jax.cache.registry import make_scheme  # noqa: E402
from kvquant_jax.serving import engine as E  # noqa: E402
from kvquant_jax.serving.engine_cli import pages_for_budget  # noqa: E402


def probe(params, cfg, spec: str, impl: str, a) -> dict:
    scheme = make_scheme(spec, rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
    num_pages = pages_for_budget(scheme, cfg, a.page_size, a.hbm_gb * 2**30)
    per_req = -(-(a.prompt + a.decode_steps + 8) // a.page_size)
    slots = min(a.slots, num_pages // per_req)
    ec = E.EngineConfig(num_slots=slots, page_size=a.page_size, num_pages=num_pages, max_pages=per_req,
                        chunk=a.chunk, prefill_slots=a.prefill_slots, view_buckets=a.view_buckets,
                        attention_impl=impl, prefix_cache=a.prefix_cache)
    eng = E.Engine(params, cfg, scheme, ec)
    t0 = time.perf_counter()
    compile_s = eng.warmup()
    fwd = []                                       # (T, seconds) of every jitted forward, blocked until ready
    orig = eng._jit_step

    def timed(fn, *args, **kw):
        t = time.perf_counter()
        out = orig(fn, *args, **kw)
        jax.block_until_ready(out)
        fwd.append((int(args[1].shape[1]), time.perf_counter() - t))     # args: rows, tokens, ...
        return out

    eng._jit_step = timed
    rng = np.random.default_rng(0)
    for i in range(slots):
        eng.submit(E.Request(i, tuple(int(x) for x in rng.integers(3, cfg.vocab_size, a.prompt)),
                             max_new_tokens=a.decode_steps + 4, stop=(-1,)))
    steps = []
    decode_only = 0
    while decode_only < a.decode_steps:
        n0 = len(fwd)
        t = time.perf_counter()
        eng.step()
        wall = time.perf_counter() - t
        calls = fwd[n0:]
        kinds = {"decode" if tt == 1 else "prefill": s for tt, s in calls}
        steps.append({"wall": wall, "host": wall - sum(s for _, s in calls), **kinds})
        if "prefill" not in kinds:
            decode_only += 1
    trace = None
    if a.trace:
        d = os.path.join(a.trace, f"{spec}_{impl}")
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(a.trace_steps):
                eng.step()
        trace = d

    def med(key, only=None):
        xs = [s[key] for s in steps if key in s and (only is None or only(s))]
        return round(1e3 * float(np.median(xs)), 3) if xs else None

    dec = lambda s: "prefill" not in s          # noqa: E731
    mix = lambda s: "prefill" in s              # noqa: E731
    out = {"cache": spec, "impl": impl, "slots": slots, "prefix_cache": a.prefix_cache, "num_pages": num_pages, "prompt": a.prompt,
           "compile_s": round(compile_s, 1), "setup_s": round(time.perf_counter() - t0, 1), "steps": len(steps),
           "decode_only_steps": sum(map(dec, steps)),
           "ms_decode_only_wall": med("wall", dec), "ms_decode_only_forward": med("decode", dec),
           "ms_decode_only_host": med("host", dec), "ms_mixed_wall": med("wall", mix),
           "ms_mixed_decode_forward": med("decode", mix), "ms_mixed_prefill_forward": med("prefill", mix),
           "ms_mixed_host": med("host", mix), "paths": eng.paths, "trace": trace}
    print(json.dumps(out), flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b-shaped", choices=["llama3-8b-shaped", "tiny"])
    ap.add_argument("--cache", nargs="+", default=["bf16", "int4"])
    ap.add_argument("--impl", nargs="+", default=["auto", "reference"])
    ap.add_argument("--hbm-gb", type=float, default=16.0)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=12)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--prefill-slots", type=int, default=4)
    ap.add_argument("--view-buckets", type=int, default=2)
    ap.add_argument("--prefix-cache", action="store_true",
                    help="store every prefill chunk's full pages in the prefix cache (the engine default; the "
                         "prompts are random, so it only costs host time)")
    ap.add_argument("--trace", default=None, help="directory for Perfetto traces of decode-only steps")
    ap.add_argument("--trace-steps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="CPU smoke sizes")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.small:
        a.model, a.hbm_gb, a.slots, a.prompt, a.page_size, a.chunk, a.decode_steps = "tiny", 0.002, 4, 96, 32, 64, 3
    import bench_engine as BE
    params, cfg = BE.load(a.model, "float32" if a.small else "bfloat16")
    rows = []
    for spec in a.cache:
        for impl in a.impl:
            try:
                rows.append(probe(params, cfg, spec, impl, a))
            except Exception as e:                  # noqa: BLE001 -- report, go on with the next config
                rows.append({"cache": spec, "impl": impl, "error": f"{type(e).__name__}: {str(e)[:500]}"})
                print(json.dumps(rows[-1]), flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "args": vars(a),
                               "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
