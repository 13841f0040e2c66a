"""W8A8 live activations on SmolLM2: perplexity of W8A8 / SmoothQuant, and KV4 with / without SmoothAttention.

Every number is WikiText-2 TEST perplexity (transformers' convention, as ``kvq ppl``: no BOS, contiguous
``seq_len`` segments from the start of the split); calibration statistics (SmoothQuant activation maxima,
SmoothAttention key maxima) come only from WikiText-2 VALIDATION windows.

W8A8 rows (plain forward, one segment per forward, i.e. the prefill path T > 1 of ``W8A8Policy``):
  fp32                    the float model
  w8a16                   weight-only INT8 (per-output-channel), float activations
  w8a8                    + per-token INT8 activations on all 7 block linears (q k v o gate up down)
  w8a8+sq(alpha)          SmoothQuant folded into the norms (q/k/v, gate/up) before weight quantization
  w8a8+sq(alpha)+down/o   SmoothQuant also on the down_proj input (via w_up) and the o_proj input (via w_v)
  w8a8 (unfused norm)     fuse_norm=False: float RMSNorm, then one activation quantization per projection
  ... [embed x (1+i*2^-20)]  sensitivity rows (--perturbations N): the same config with the float embedding table
                          scaled by 1 + i * 2^-20, i = 1..N (a change far below any quantization step)
KV4 rows (float weights/activations, the quantized-cache fast path ``make_nll_fn`` with ``--kv-chunk``):
  <scheme>, <scheme>+smoothattention (lambda = pair-max(post-RoPE |K|)^0.5, folded into W_q / W_k)

    KVQ_CACHE_DIR=/tmp/kvqcache python experiments/w8a8_ppl.py --out docs/results/w8a8
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from kvquant_jax.calibration import smoothattention as SA
from kvquant_jax.calibration import smoothquant as SQ
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.data import load_corpus
from kvquant_jax.eval.ppl import perplexity, token_nll
from kvquant_jax.eval.quantized_ppl import make_nll_fn
from kvquant_jax.models import load_model
from kvquant_jax.models.llama import forward_nocache
from kvquant_jax.models.w8a8 import W8A8Policy, quantize_params


def log(*a):
    print(*a, file=sys.stderr, flush=True)


@functools.partial(jax.jit, static_argnames=("cfg", "linear"))
def _nll(params, cfg, tokens, linear=None):
    return token_nll(forward_nocache(params, cfg, tokens, linear=linear), tokens)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--calib-windows", type=int, default=8)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.8])
    ap.add_argument("--kv-schemes", nargs="+", default=["qserve4", "int4"])
    ap.add_argument("--kv-chunk", type=int, default=128)
    ap.add_argument("--perturbations", type=int, default=3,
                    help="sensitivity rows: W8A8 and W8A8+SQ(first alpha) with the embeddings scaled by 1 + i*2^-20")
    ap.add_argument("--sa-alpha", type=float, default=0.5)
    ap.add_argument("--out", default=None, help="directory for results.json (optional)")
    args = ap.parse_args(argv)

    t_all = time.perf_counter()
    m = load_model()
    cfg, p = m.cfg, m.params
    test = load_corpus(None, split="test", fallback=False)
    ids = m.tokenizer.encode(test.text)
    calib, calib_rec = SQ.validation_windows(m.tokenizer, args.calib_windows, args.calib_len)
    t0 = time.perf_counter()
    stats = SQ.collect_stats(p, cfg, calib)
    log(f"[w8a8] stats on {calib.shape} validation tokens in {time.perf_counter() - t0:.1f}s")

    def ppl(params, linear=None, nll_fn=None):
        fn = nll_fn or (lambda pp, c, t: _nll(pp, c, t, linear=linear))
        r = perplexity(params, cfg, ids, seq_len=args.seq_len, max_segments=args.segments, nll_fn=fn)
        return r.ppl, r.seconds

    rows = []

    def add(table, name, value, seconds, **extra):
        rows.append({"table": table, "name": name, "ppl": value, "seconds": round(seconds, 1), **extra})
        base = next(r["ppl"] for r in rows if r["name"] == "fp32")
        log(f"[w8a8] {table:5s} {name:28s} ppl {value:.4f}  dppl {value - base:+.4f}  ({seconds:.0f}s)")

    v, s = ppl(p)
    add("w8a8", "fp32", v, s)
    pol = W8A8Policy()
    v, s = ppl(quantize_params(p, pol), linear=W8A8Policy(prefill="w8a16"))
    add("w8a8", "w8a16 (weight-only)", v, s)
    v, s = ppl(quantize_params(p, pol), linear=pol)
    add("w8a8", "w8a8", v, s)
    v, s = ppl(quantize_params(p, pol), linear=dataclasses.replace(pol, fuse_norm=False))
    add("w8a8", "w8a8 (unfused norm)", v, s)
    for a in args.alphas:
        for sites in (("qkv", "gate_up"), SQ.SITES):
            sp = SQ.smooth_params(p, cfg, stats, SQ.SmoothQuantConfig(alpha=a, sites=sites))
            name = f"w8a8+sq(a={a})" + ("" if len(sites) == 2 else "+down/o")
            v, s = ppl(quantize_params(sp, pol), linear=pol)
            add("w8a8", name, v, s, alpha=a, sites=list(sites))

    def perturbed(params, i):
        return {**params, "embed": params["embed"] * jnp.float32(1.0 + i * 2.0 ** -20)}

    for i in range(1, args.perturbations + 1):
        v, s = ppl(perturbed(quantize_params(p, pol), i), linear=pol)
        add("w8a8", f"w8a8 [embed x (1+{i}*2^-20)]", v, s, perturbation=i)
    if args.alphas and args.perturbations:
        a = args.alphas[0]
        sp = SQ.smooth_params(p, cfg, stats, SQ.SmoothQuantConfig(alpha=a, sites=("qkv", "gate_up")))
        for i in range(1, args.perturbations + 1):
            v, s = ppl(perturbed(quantize_params(sp, pol), i), linear=pol)
            add("w8a8", f"w8a8+sq(a={a}) [embed x (1+{i}*2^-20)]", v, s, perturbation=i, alpha=a)

    p_sa = SA.smooth_attention(p, cfg, stats, alpha=args.sa_alpha, key_stage="post_rope")
    for spec in args.kv_schemes:
        scheme = make_scheme(spec, rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
        fn = make_nll_fn(scheme, chunk=args.kv_chunk)
        v, s = ppl(p, nll_fn=fn)
        add("kv4", spec, v, s, chunk=args.kv_chunk)
        v, s = ppl(p_sa, nll_fn=fn)
        add("kv4", f"{spec}+smoothattention", v, s, chunk=args.kv_chunk, sa_alpha=args.sa_alpha)

    base = rows[0]["ppl"]
    for r in rows:
        r["dppl"] = r["ppl"] - base
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "jax": jax.__version__, "device": jax.default_backend(), "python": platform.python_version(),
           "model": m.path, "model_sha256": cfg.sha256, "test_corpus": {"name": test.name, "sha256": test.sha256},
           "seq_len": args.seq_len, "segments": args.segments, "scored_tokens": args.segments * (args.seq_len - 1),
           "calibration": calib_rec, "argv": sys.argv[1:], "total_seconds": round(time.perf_counter() - t_all, 1),
           "rows": rows}
    print("| table | config | ppl | Δppl vs fp32 |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['table']} | {r['name']} | {r['ppl']:.3f} | {r['dppl']:+.3f} |")
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "results.json").write_text(json.dumps(out, indent=1))
        log(f"[w8a8] wrote {d / 'results.json'}")


if __name__ == "__main__":
    main()
