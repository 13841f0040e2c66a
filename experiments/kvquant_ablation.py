"""KVQuant ablation on the serving path: Delta perplexity of WikiText-2 test segments through the real cache.

Calibration: ONE calibration forward+backward pass over seeded WikiText-2 VALIDATION windows
(:func:`kvquant_jax.calibration.fisher.collect`), then one fit per variant (bits, codebook, weighting, outliers,
sink, key stage) with :func:`kvquant_jax.calibration.kvquant.fit` -- exactly what ``kvq calibrate`` does per config.

Evaluation (:func:`kvquant_jax.eval.quantized_ppl.serving_nll`): each test segment is prefilled with ``--prefill``
tokens and the rest is decoded one token per forward (teacher-forced) through ``llama.forward`` with the cache, so
every scored prediction attends to the quantized history plus its own exact K/V -- the deployed decode step.
Delta ppl is against the same path with an fp32 cache.  KIVI (registry ``kivi2``/``kivi4``: G=32, fp16 qparams,
R=128 recent fp16 rows, and R=0) is measured on the same segments; bits per element are the measured ``nbytes`` of a
cache holding ``seq_len`` rows (and ``4096`` rows), over ``2 * L * Hkv * D * T`` elements.  ``--recon`` adds the
relative K (post-RoPE) / V reconstruction error of every config on the first test segment (rows after the first).

    python experiments/kvquant_ablation.py --out docs/results/kvquant
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

from kvquant_jax.cache.kvquant import KVQuantScheme, key_outlier_overflow
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.calibration import kvquant as KC
from kvquant_jax.calibration.fisher import KVActivations, collect
from kvquant_jax.data import load_corpus
from kvquant_jax.eval.policy import Policy
from kvquant_jax.eval.ppl import segments
from kvquant_jax.eval.quantized_ppl import serving_nll
from kvquant_jax.quant.ledger import measured_nbytes


@dataclasses.dataclass(frozen=True, eq=False)
class KVQuantPolicy(Policy):
    """A :class:`~kvquant_jax.eval.policy.Policy` whose fresh caches get the calibrated KVQuant state installed."""

    calibration: KC.KVQuantCalibration | None = None

    def init(self, cfg, batch: int, capacity: int):
        cache = super().init(cfg, batch, capacity)
        return cache if self.calibration is None else self.calibration.install(cache)


BASE = dict(k_bits=3, v_bits=3, outlier_fraction=0.01, sink=1, key_stage="pre_rope", codebook="nuq",
            weighting="fisher")
# (label, overrides of BASE, group)
# in priority order (the 2-bit ablations show the largest effects)
VARIANTS = [
    ("nuq4-1%", dict(k_bits=4, v_bits=4), "main"),
    ("nuq3-1%", dict(), "main"),
    ("nuq2-1%", dict(k_bits=2, v_bits=2), "main"),
    ("uniform2-1%", dict(k_bits=2, v_bits=2, codebook="uniform"), "nuq vs uniform"),
    ("nuq2-1% post-RoPE K", dict(k_bits=2, v_bits=2, key_stage="post_rope"), "pre vs post RoPE"),
    ("nuq2-1% unweighted", dict(k_bits=2, v_bits=2, weighting="uniform"), "fisher vs unweighted"),
    ("nuq2-0%", dict(k_bits=2, v_bits=2, outlier_fraction=0.0), "outliers"),
    ("nuq2-1% no sink", dict(k_bits=2, v_bits=2, sink=0), "sink"),
    ("uniform3-1%", dict(codebook="uniform"), "nuq vs uniform"),
    ("uniform4-1%", dict(k_bits=4, v_bits=4, codebook="uniform"), "nuq vs uniform"),
    ("nuq3-1% post-RoPE K", dict(key_stage="post_rope"), "pre vs post RoPE"),
    ("nuq3-1% unweighted", dict(weighting="uniform"), "fisher vs unweighted"),
    ("nuq3-0%", dict(outlier_fraction=0.0), "outliers"),
    ("nuq3-1% no sink", dict(sink=0), "sink"),
]
# KIVI as registered (G=32, R=128 fp16 recent rows), and without the recent window (R=0: closer in bits/element at
# short contexts, where the 128-row residual dominates KIVI's footprint)
BASELINES = [("kivi4", "kivi4"), ("kivi2", "kivi2"), ("kivi4 R=0", "kivi4:residual=0"),
             ("kivi2 R=0", "kivi2:residual=0")]


def bits_per_element(policy, cfg, length: int) -> float:
    """Measured cache bytes (all categories but metadata: lengths, positions) per K/V element, at ``length`` rows."""
    by = measured_nbytes(policy.init(cfg, 1, length))
    elems = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * length
    return 8 * (sum(by.values()) - by["metadata"]) / elems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--samples", type=int, default=16, help="calibration windows (validation split)")
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--segments", type=int, default=4, help="WikiText-2 test segments")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated labels to run (default: all)")
    ap.add_argument("--acts-cache", default=None, help="an .npz to reuse / store the calibration activations in")
    ap.add_argument("--report-only", action="store_true", help="rewrite report.md from results.jsonl + meta.json")
    ap.add_argument("--recon", action="store_true", help="only compute K/V reconstruction errors (recon.jsonl)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("KVQ_CACHE_DIR", "/tmp/kvqcache")
    from kvquant_jax.models import load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        write_report(out, json.loads((out / "meta.json").read_text()), rows)
        print(out / "report.md")
        return
    t_start = time.perf_counter()
    m = load_model(args.model)
    cfg, params = m.cfg, m.params
    cal_corpus = KC.load_calibration_corpus(None)
    cal_ids = m.tokenizer.encode(cal_corpus.text)
    test = load_corpus(None, split="test", fallback=False)
    segs = segments(m.tokenizer.encode(test.text), args.seq_len, args.segments)
    print(f"[kvquant] model {cfg.name} sha {cfg.sha256[:16]}; calibration {cal_corpus.name} ({len(cal_ids)} tokens); "
          f"eval {test.name}: {segs.shape[0]} x {segs.shape[1]} tokens", file=sys.stderr)

    t0 = time.perf_counter()
    key = f"{cfg.sha256}:{cal_corpus.sha256}:{args.samples}:{args.calib_len}:{args.seed}"
    cached = Path(args.acts_cache) if args.acts_cache else None
    if cached is not None and cached.exists() and str(np.load(cached)["key"]) == key:
        with np.load(cached) as z:
            acts = KVActivations(**{n: z[n] for n in ("k", "v", "grad_k", "grad_v", "starts")}, nll=float(z["nll"]))
    else:
        acts = collect(params, cfg, cal_ids, num_samples=args.samples, seq_len=args.calib_len, seed=args.seed,
                       batch_size=2)
        if cached is not None:
            np.savez(cached, key=key, nll=acts.nll, k=acts.k, v=acts.v, grad_k=acts.grad_k, grad_v=acts.grad_v,
                     starts=acts.starts)
    t_collect = time.perf_counter() - t0
    print(f"[kvquant] calibration forward+backward: {t_collect:.1f} s (mean NLL {acts.nll:.3f})", file=sys.stderr)
    corpus_rec = {"name": cal_corpus.name, "source": cal_corpus.source, "sha256": cal_corpus.sha256,
                  "split": "validation", "tokens": len(cal_ids)}

    if args.recon:
        recon(out, params, cfg, segs[:1], acts, corpus_rec, m.tokenizer.hash, args)
        return
    rows_path = out / "results.jsonl"
    done = {}
    if rows_path.exists():
        for line in rows_path.read_text().splitlines():
            r = json.loads(line)
            done[r["label"]] = r

    def evaluate(label, group, policy, extra):
        if label in done:
            return done[label]
        t1 = time.perf_counter()
        nll = serving_nll(params, cfg, segs, policy, args.prefill)
        row = {"label": label, "group": group, "nll": float(np.mean(nll)), "ppl": math.exp(float(np.mean(nll))),
               "predictions": int(nll.size), "segment_nll": np.asarray(nll, np.float64).mean(axis=-1).tolist(),
               "bits_per_element_T": bits_per_element(policy, cfg, args.seq_len),
               "bits_per_element_4096": bits_per_element(policy, cfg, 4096),
               "eval_seconds": round(time.perf_counter() - t1, 1), **extra}
        with rows_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        done[label] = row
        print(f"[kvquant] {label}: ppl {row['ppl']:.4f} ({row['eval_seconds']} s)", file=sys.stderr)
        return row

    only = None if args.only is None else {s.strip() for s in args.only.split(",")}
    rope = dict(rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
    base = evaluate("fp32", "baseline", Policy(schemes=(make_scheme("fp32", **rope),)), {})
    for label, spec in BASELINES:
        if only is None or label in only:
            evaluate(label, "kivi", Policy(schemes=(make_scheme(spec, **rope),)), {"scheme": spec})
    for label, over, group in VARIANTS:
        if only is not None and label not in only:
            continue
        if label in done:
            continue
        conf = KC.CalibrationConfig(num_samples=args.samples, seq_len=args.calib_len, seed=args.seed,
                                    **{**BASE, **over})
        t1 = time.perf_counter()
        cal = KC.build(KC.fit(acts, cfg, conf), cfg, conf, tokenizer_hash=m.tokenizer.hash, corpus=corpus_rec,
                       acts=acts)
        t_fit = time.perf_counter() - t1
        scheme: KVQuantScheme = cal.scheme()
        a = cal.arrays
        overflow = None
        if conf.key_stage == "pre_rope" and scheme.k_sparse_capacity:   # K outliers a row's capacity cannot hold
            ov = tot = 0
            for i in range(cfg.num_layers):
                k = acts.k[i][:, conf.sink:]
                ov += int(np.asarray(key_outlier_overflow(k, a["k_zero"][i], a["k_scale"][i],
                                                          scheme.k_sparse_capacity)).sum())
                tot += int(np.asarray(key_outlier_overflow(k, a["k_zero"][i], a["k_scale"][i], 0)).sum())
            overflow = ov / max(tot, 1)
        evaluate(label, group, KVQuantPolicy(schemes=(scheme,), calibration=cal),
                 {"calibration_id": cal.calibration_id, "config": {**BASE, **over},
                  "k_sparse_capacity": scheme.k_sparse_capacity, "v_outliers": scheme.v_outliers,
                  "fit_seconds": round(t_fit, 1), "k_outlier_rate_calib": float(a["k_outlier_rate"].mean()),
                  "k_overflow_fraction_calib": overflow,
                  "sse_k_vs_uniform": float(a["sse_k"].sum() / a["sse_k_uniform"].sum()),
                  "sse_v_vs_uniform": float(a["sse_v"].sum() / a["sse_v_uniform"].sum())})

    meta = {"command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]) if argv is None else str(argv),
            "model": cfg.name, "model_sha256": cfg.sha256, "tokenizer_hash": m.tokenizer.hash,
            "calibration_corpus": corpus_rec, "calibration_samples": args.samples, "calibration_len": args.calib_len,
            "calibration_nll": acts.nll, "calibration_seconds": round(t_collect, 1), "seed": args.seed,
            "eval_corpus": {"name": test.name, "sha256": test.sha256}, "segments": int(segs.shape[0]),
            "seq_len": args.seq_len, "prefill": args.prefill, "baseline_ppl": base["ppl"],
            "jax": jax.__version__, "backend": jax.default_backend(), "machine": platform.processor() or
            platform.machine(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "total_seconds": round(time.perf_counter() - t_start, 1)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    write_report(out, meta, list(done.values()))
    print(out / "report.md")


def recon(out: Path, params, cfg, seg, acts, corpus_rec, tok_hash, args) -> None:
    """Relative L2 reconstruction error of post-RoPE K and of V, per layer, rows 1..T-1 of one test segment."""
    import jax.numpy as jnp

    from kvquant_jax.cache import ops
    from kvquant_jax.eval.errors import exact_qkv

    _, k, v = (np.asarray(a)[:, 0] for a in exact_qkv(params, cfg, jnp.asarray(seg)))   # [L, T, H, D]
    t = k.shape[1]

    def errors(policy):
        cache = ops.append(policy.init(cfg, 1, t), [(k[i][None], v[i][None]) for i in range(cfg.num_layers)], t)
        ek, ev = [], []
        for i in range(cfg.num_layers):
            kk, vv, _ = (np.asarray(a) for a in ops.decode_reference(cache, i))
            kk, vv = kk[0].transpose(1, 0, 2)[1:], vv[0].transpose(1, 0, 2)[1:]
            ek.append(np.linalg.norm(kk - k[i, 1:]) / np.linalg.norm(k[i, 1:]))
            ev.append(np.linalg.norm(vv - v[i, 1:]) / np.linalg.norm(v[i, 1:]))
        return {"k_rel_err": float(np.mean(ek)), "v_rel_err": float(np.mean(ev)),
                "k_rel_err_max_layer": float(np.max(ek)), "v_rel_err_max_layer": float(np.max(ev))}

    rope = dict(rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
    rows = []
    for label, spec in BASELINES:
        rows.append({"label": label, **errors(Policy(schemes=(make_scheme(spec, **rope),)))})
    for label, over, _ in VARIANTS:
        conf = KC.CalibrationConfig(num_samples=args.samples, seq_len=args.calib_len, seed=args.seed,
                                    **{**BASE, **over})
        cal = KC.build(KC.fit(acts, cfg, conf), cfg, conf, tokenizer_hash=tok_hash, corpus=corpus_rec, acts=acts)
        rows.append({"label": label, **errors(KVQuantPolicy(schemes=(cal.scheme(),), calibration=cal))})
        print(f"[kvquant] recon {label}: {rows[-1]}", file=sys.stderr)
    (out / "recon.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def delta_cell(row: dict, base: dict) -> str:
    """``row``'s Δppl vs ``base`` with its paired bootstrap 95% CI when both rows kept per-segment NLLs."""
    if "segment_nll" not in row or "segment_nll" not in base or row is base:
        return f"{row['ppl'] - base['ppl']:+.4f}"
    from kvquant_jax.eval.stats import ppl_delta_ci

    ci = ppl_delta_ci(np.asarray(row["segment_nll"]), np.asarray(base["segment_nll"]))
    return f"{ci.delta:+.4f} [{ci.lo:+.4f}, {ci.hi:+.4f}]" + (" n.s." if ci.lo <= 0 <= ci.hi else "")


def write_report(out: Path, meta: dict, rows: list) -> None:
    base = next(r for r in rows if r["label"] == "fp32")
    rec = {}
    if (out / "recon.jsonl").exists():
        rec = {r["label"]: r for r in map(json.loads, (out / "recon.jsonl").read_text().splitlines())}
    rows = [{**r, **{k: v for k, v in rec.get(r["label"], {}).items() if k != "label"}} for r in rows]
    lines = [
        "# KVQuant on SmolLM2-135M-Instruct: serving-path Delta perplexity (WikiText-2 test)", "",
        f"Command: `{meta['command']}`  ",
        f"Date {meta['date']}, JAX {meta['jax']} on {meta['backend']} ({meta['machine']}), "
        f"total {meta['total_seconds']} s.", "",
        f"* Model `{meta['model']}` (sha256 `{meta['model_sha256'][:16]}`), tokenizer `{meta['tokenizer_hash']}`.",
        f"* Calibration: {meta['calibration_samples']} seeded windows x {meta['calibration_len']} tokens of "
        f"`{meta['calibration_corpus']['name']}` (sha256 `{meta['calibration_corpus']['sha256'][:16]}`), seed "
        f"{meta['seed']}; one forward+backward pass ({meta['calibration_seconds']} s), one fit per variant.",
        f"* Evaluation: the first {meta['segments']} contiguous {meta['seq_len']}-token segments of "
        f"`{meta['eval_corpus']['name']}` (sha256 `{meta['eval_corpus']['sha256'][:16]}`), no BOS; prefill "
        f"{meta['prefill']} token(s), then teacher-forced decode one token per `llama.forward` through the cache: "
        "every scored prediction reads the quantized history plus its own exact K/V. Delta is against the same "
        f"path with an fp32 cache (ppl {base['ppl']:.4f}).",
        "* bits/elem: measured cache `nbytes` (codes, qparams, codebooks, sparse slots, sink / residual rows; not "
        "lengths/positions) over `2 L Hkv D T` elements, at T = seq_len and T = 4096 (KIVI's fixed 128-row fp16 "
        "residual dominates at short T).",
        "* K / V err: relative L2 reconstruction error (post-RoPE K, V; mean over layers) on the first test segment, "
        "rows after the first (`--recon`). K outliers / overflow: fraction of calibration K coordinates outside the "
        "calibrated per-channel thresholds, and the share of them a row's sparse capacity cannot hold (they clip). "
        "SSE / uniform: Fisher-weighted (or unweighted) codebook error of the fitted signposts over the uniform "
        "grid's, on the calibration values.", "",
        f"* Delta [95% CI]: paired bootstrap over the segments (`eval.stats.ppl_delta_ci`, every row scores the same "
        f"{base['predictions']:,} tokens); rows from a run that kept no per-segment NLLs show no interval.", "",
        "| group | config | ppl | Delta ppl [95% CI] | bits/elem @T | bits/elem @4096 | K err | V err | "
        "K outliers (calib) | K overflow | SSE K / uniform | SSE V / uniform |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {"baseline": 0, "main": 1, "kivi": 2, "nuq vs uniform": 3, "pre vs post RoPE": 4,
             "fisher vs unweighted": 5, "outliers": 6, "sink": 7}
    for r in sorted(rows, key=lambda r: (order.get(r["group"], 9), r["label"])):
        def f(key, fmt="{:.3f}"):
            v = r.get(key)
            return "" if v is None else fmt.format(v)
        lines.append(f"| {r['group']} | {r['label']} | {r['ppl']:.4f} | {delta_cell(r, base)} | "
                     f"{f('bits_per_element_T', '{:.2f}')} | {f('bits_per_element_4096', '{:.2f}')} | "
                     f"{f('k_rel_err', '{:.4f}')} | {f('v_rel_err', '{:.4f}')} | "
                     f"{f('k_outlier_rate_calib', '{:.2%}')} | {f('k_overflow_fraction_calib', '{:.2%}')} | "
                     f"{f('sse_k_vs_uniform')} | {f('sse_v_vs_uniform')} |")
    notes = out / "notes.md"                       # hand-written reading of the numbers, kept across rewrites
    if notes.exists():
        lines += ["", notes.read_text().rstrip()]
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
