"""CPU serving timings for docs/benchmarks.md: model load, `kvq ppl` 8x1024, prefill and steady-state decode.

    python experiments/bench_cpu_serving.py [--cache SCHEME ...] [--out FILE.json]

Decode tokens/s is measured on a second, already-compiled run (compile time reported separately).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import jax
import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", nargs="*", default=["fp32"])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ppl-segments", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from kvquant_jax.cache.registry import make_scheme
    from kvquant_jax.data import load_corpus
    from kvquant_jax.eval.ppl import perplexity
    from kvquant_jax.models import load_model
    from kvquant_jax.serving.generate import generate

    rows = {"date": datetime.date.today().isoformat(), "jax": jax.__version__, "backend": jax.default_backend(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    t0 = time.perf_counter()
    m = load_model()
    rows["load_s"] = time.perf_counter() - t0
    corpus = load_corpus(None)
    ids = m.tokenizer.encode(corpus.text)
    res = perplexity(m.params, m.cfg, ids, seq_len=1024, max_segments=args.ppl_segments)
    rows["ppl_8x1024"] = {"ppl": res.ppl, "seconds_incl_compile": res.seconds, "corpus": corpus.name}
    prompt = ids[: args.prompt_len]
    rows["decode"] = {}
    for spec in args.cache:
        scheme = make_scheme(spec, rope_theta=m.cfg.rope_theta, rope_pairing=m.cfg.rope_pairing)
        kw = dict(max_new_tokens=args.new_tokens, scheme=scheme, capacity=args.prompt_len + args.new_tokens + 64,
                  eos_id=-1)  # never stop early: time exactly new_tokens steps
        first = generate(m.params, m.cfg, [prompt] * args.batch, **kw)
        second = generate(m.params, m.cfg, [prompt] * args.batch, **kw)
        steps = second.decode_steps - 1
        rows["decode"][spec] = {
            "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "prefill_s_compiled": second.prefill_seconds, "prefill_s_first": first.prefill_seconds,
            "decode_tok_per_s": args.batch * steps / second.decode_seconds,
            "decode_ms_per_step": 1e3 * second.decode_seconds / steps,
            "first_run_decode_s_incl_compile": first.decode_seconds}
        print(spec, json.dumps(rows["decode"][spec]))
    print(json.dumps(rows, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
