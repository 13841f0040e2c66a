"""IntactKV / PrefixQuant ablation on SmolLM2 (issue H): delta-ppl of quantized KV caches with and without prefix rows.

Variants (each on the same WikiText-2 TEST segments; calibration only ever reads the VALIDATION split):
  none                 [BOS] + text, every row (BOS included) stored under the body scheme
  intactkv-extracted   [BOS] rows extracted from the full-precision model, text rows under the body scheme
  intactkv-calibrated  the same [BOS] rows calibrated (Optax, STE) against that body scheme
  prefixquant          discovered outlier tokens + [BOS] as a hidden full-precision prefix, text rows under the body
Body schemes: fp32 (reference), KIVI-2, per-token INT3 / INT4, static per-tensor INT4 (scales fitted on body rows of
the validation split, prefix rows excluded).  Scored: next-token NLL of text[1:] (the same predictions in every
variant), every segment read through the real cache (``llama.forward`` over ``start_request``), token by token by
default (``--eval-chunk 1``: teacher-forced decode, each prediction reads the stored history).

    python experiments/intactkv_ablation.py --out docs/results/intactkv
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.interface import init_cache
from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.prefix import model_identity, save_artifact, start_request
from kvquant_jax.cache.static_int import StaticIntScheme, load_static_scales, per_token_int
from kvquant_jax.calibration import intactkv as ikv
from kvquant_jax.calibration import prefixquant as pq
from kvquant_jax.data import load_corpus
from kvquant_jax.eval import quantized_ppl
from kvquant_jax.models import load_model
from kvquant_jax.models.llama import forward_jit


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def schemes(cfg, names):
    kw = dict(rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
    table = {"fp32": lambda: FullPrecisionScheme(**kw), "kivi2": lambda: KIVIScheme(k_bits=2, v_bits=2, group_size=32, residual=32, **kw),
             "int3": lambda: per_token_int(3, **kw), "int4": lambda: per_token_int(4, **kw),
             "static4": lambda: StaticIntScheme(bits=4, scale_axis="tensor", calibration_id="pending", **kw)}
    return {n: table[n]() for n in names}


def chunked_nll(params, cfg, cache, tokens: np.ndarray, chunk: int) -> np.ndarray:
    """Run ``tokens [B, T]`` through ``cache`` in chunks (the serving path); NLL ``[B, T-1]`` of tokens[:, 1:]."""
    b, t = tokens.shape
    n = -(-t // chunk)
    padded = np.zeros((b, n * chunk), np.int32)
    padded[:, :t] = tokens
    # targets[:, p] = tokens[:, p + 1]; the last position predicts nothing (its NLL column is dropped below)
    targets = np.zeros((b, n * chunk), np.int32)
    targets[:, :t - 1] = tokens[:, 1:]
    nll = []
    for j in range(n):          # each chunk's NLL at once: never all [B, T, V] logits (12 GB at 64 x 1024)
        num = min(chunk, t - j * chunk)
        lg, cache, ok = forward_jit(params, cfg, jnp.asarray(padded[:, j * chunk:(j + 1) * chunk]), cache,
                                    jnp.full((b,), num, jnp.int32))
        if not bool(ok):
            raise RuntimeError("non-finite K/V during evaluation")
        nll.append(np.asarray(_chunk_nll(lg, jnp.asarray(targets[:, j * chunk:(j + 1) * chunk]), cfg))[:, :num])
    return np.concatenate(nll, axis=1)[:, :t - 1]


# NLL [B, C] of targets [B, C] under logits [B, C, V] (position p predicts targets[p]): the harness's own gather
_chunk_nll = jax.jit(quantized_ppl._gather_nll, static_argnames=("cfg",))


VARIANTS = ("none", "intactkv-extracted", "intactkv-calibrated", "prefixquant")
SCHEME_NAMES = {"fp32": "fp32 (reference)", "kivi2": "KIVI-2 (G=32, R=32)", "int3": "per-token INT3",
                "int4": "per-token INT4", "static4": "static per-tensor INT4"}


def eta_table(stats, seqs, bos, tok, etas=(16, 32, 64, 128)) -> list:
    """The discovery rule at several eta on the same statistics ``[L, N, T]``."""
    out = []
    for eta in etas:
        d = pq.select_prefix(seqs, pq.outlier_mask(stats, eta).any(axis=0), bos_id=bos, eta=eta,
                             tokenizer_hash=tok.hash)
        out.append({"eta": eta, "prefix_token_ids": list(d.prefix_token_ids),
                    "tokens": [tok.decode([t], skip_special=False) for t in d.prefix_token_ids],
                    "mean_outlier_tokens": d.mean_outlier_tokens,
                    "top_counts": {tok.decode([int(k)], skip_special=False): v
                                   for k, v in list(d.outlier_counts.items())[:5]}})
    return out


def ci_table(res: dict, rows: dict) -> list[str]:
    """Markdown lines: per scheme the Δppl of ``none`` vs the full-precision model and of every prefix variant vs
    ``none`` (what the variant buys), each with its paired bootstrap 95% CI over the scored segments
    (``eval.stats.ppl_delta_ci``: the same tokens in every variant); "n.s." where the interval contains 0."""
    from kvquant_jax.eval.stats import ppl_delta_ci

    def cell(x, base):
        ci = ppl_delta_ci(np.asarray(x, np.float64), np.asarray(base, np.float64))
        return f"{ci.delta:+.3f} [{ci.lo:+.3f}, {ci.hi:+.3f}]" + (" n.s." if ci.lo <= 0 <= ci.hi else "")

    ref = rows[("fp32", "none")]["segment_nll"]
    n_seg = len(ref)
    a = res["args"]
    out = ["", f"Paired bootstrap 95% CIs over the {n_seg} segments ({n_seg} × {a['seq_len'] - 1} = "
           f"{n_seg * (a['seq_len'] - 1):,} scored tokens per cell; BCa, `kvquant_jax.eval.stats`; n.s. = the "
           "interval contains 0). First column: `none` vs the full-precision model; the others: the variant vs "
           "`none` of the same scheme (negative = the prefix helps):", "",
           "| KV cache | none vs fp32 | IntactKV[B] extracted vs none | IntactKV[B] calibrated vs none | "
           "PrefixQuant vs none |", "| --- | --- | --- | --- | --- |"]
    for sch in dict.fromkeys(r["scheme"] for r in res["rows"]):
        base = rows[(sch, "none")]["segment_nll"]
        cells = [cell(base, ref)]
        for v in VARIANTS[1:]:
            r = rows.get((sch, v))
            cells.append("—" if r is None else cell(r["segment_nll"], base))
        out.append(f"| {SCHEME_NAMES.get(sch, sch)} | " + " | ".join(cells) + " |")
    return out


def write_report(res: dict, out: Path) -> Path:
    """``out/README.md`` from a results dict (see :func:`main`)."""
    rows = {(r["scheme"], r["variant"]): r for r in res["rows"]}
    a = dict(res["args"])
    a.setdefault("eval_chunk", a["chunk"])
    lines = [
        "# IntactKV / PrefixQuant ablation on SmolLM2-135M-Instruct (issue H)", "",
        f"Command: `{res['command']}`  ",
        f"Date: {res['date']}; git {res['git_commit']}; JAX {res['jax']} on {res['backend']} ({res['machine']}); "
        f"{res['seconds'] / 60:.0f} min wall"
        + (f" on {res['device']}" if res.get("device") else "")
        + (f" ({res['note']})" if res.get("note") else "") + ".  ",
        f"Model: `{Path(res['model']).name}` sha256 `{res['model_sha256'][:16]}…`, tokenizer hash "
        f"`{res['tokenizer_hash']}`.  ",
        f"Evaluation: {res['test_corpus']} (sha256 `{res['test_corpus_sha256'][:12]}…`), {a['segments']} contiguous "
        f"segments of {a['seq_len']} text tokens, scoring the {a['seq_len'] - 1} next-token predictions text[1:] "
        f"in every variant (the same predictions), read through the real cache (`llama.forward` over "
        f"`cache.prefix.start_request`) {'token by token (teacher-forced decode)' if a['eval_chunk'] == 1 else 'in chunks of ' + str(a['eval_chunk'])}.  ",
        f"Calibration (scales, IntactKV training, PrefixQuant discovery): {res['calibration_corpus']} (sha256 "
        f"`{res['calibration_corpus_sha256'][:12]}…`) only, in disjoint windows.", "",
        "Variants: **none** = `[BOS] + text`, every row (BOS included) stored under the scheme; **IntactKV[B] "
        "extracted** = the full-precision model's exact `[BOS]` K/V as a prefix, text rows under the scheme; "
        "**IntactKV[B] calibrated** = those rows trained for that scheme (Optax AdamW, straight-through rounding); "
        "**PrefixQuant** = discovered outlier tokens + `[BOS]` as a hidden full-precision prefix.  Static "
        "per-tensor INT4 scales are fitted (MSE clip search) on the rows each variant quantizes: prefix rows "
        "excluded.", "",
        f"## Perplexity (Δ vs the full-precision model, ppl {res['reference_ppl']:.3f})", "",
        "| KV cache | none | IntactKV[B] extracted | IntactKV[B] calibrated | PrefixQuant prefix |",
        "| --- | --- | --- | --- | --- |"]
    for sch in dict.fromkeys(r["scheme"] for r in res["rows"]):
        cells = []
        for v in VARIANTS:
            r = rows.get((sch, v))
            cells.append("—" if r is None else f"{r['ppl']:.3f} ({r['delta_ppl']:+.3f})")
        lines.append(f"| {SCHEME_NAMES.get(sch, sch)} | " + " | ".join(cells) + " |")
    lines += ci_table(res, rows)
    lines += ["", "Segments (of the same segments) on which a variant's NLL is below the `none` variant's / below "
              "IntactKV[B] extracted:", "", "| KV cache | IntactKV[B] extracted | IntactKV[B] calibrated | PrefixQuant |",
              "| --- | --- | --- | --- |"]
    for sch in dict.fromkeys(r["scheme"] for r in res["rows"]):
        if sch == "fp32":
            continue
        base, ext = rows[(sch, "none")]["segment_nll"], rows[(sch, "intactkv-extracted")]["segment_nll"]
        cells = []
        for v in VARIANTS[1:]:
            r = rows.get((sch, v))
            if r is None:
                cells.append("—")
                continue
            w0 = sum(a < b for a, b in zip(r["segment_nll"], base))
            w1 = sum(a < b for a, b in zip(r["segment_nll"], ext))
            cells.append(f"{w0}/{len(base)}" + ("" if v == "intactkv-extracted" else f" / {w1}/{len(ext)}"))
        lines.append(f"| {SCHEME_NAMES.get(sch, sch)} | " + " | ".join(cells) + " |")
    if res.get("notes"):                       # hand-written reading of the numbers, kept with them in results.json
        lines += ["", "## Reading", ""] + ([res["notes_intro"], ""] if res.get("notes_intro") else []) \
            + [f"* {n}" for n in res["notes"]]
    d = res["prefixquant_discovery"]
    lines += ["", "Per-segment NLLs are in `results.json` (paired comparisons: every variant scores the same "
              "tokens).", "",
              "## PrefixQuant tokens found for SmolLM2", "",
              f"η = {d['eta']:g}, {d['sequences']} validation sequences of {d['seq_len']} tokens (`[BOS]` + text): "
              f"mean {d['mean_outlier_tokens']:.2f} outlier tokens per sequence besides BOS → o = {d['o']}; "
              f"BOS was an outlier token in {100 * d['bos_outlier_fraction']:.0f}% of sequences.", "",
              f"Prefix (ids): `{d['prefix_token_ids']}` = " + " ".join(f"`{t!r}`" for t in res["prefixquant_tokens"]),
              "", "Outlier occurrences by token id (BOS excluded): "
              + ", ".join(f"{k}: {v}" for k, v in list(d["outlier_counts"].items())[:10]), "",
              *(["Same statistics, other η:", "", "| η | prefix | mean outlier tokens / seq | top outlier tokens "
                 "(count) |", "| --- | --- | --- | --- |"]
                + [f"| {e['eta']} | " + " ".join(f"`{t!r}`" for t in e["tokens"]) + f" | "
                   f"{e['mean_outlier_tokens']:.2f} | "
                   + ", ".join(f"`{k!r}` ({v})" for k, v in e["top_counts"].items()) + " |"
                   for e in res.get("eta_sweep", [])]
                + ([f"({res['eta_sweep_note']}.)"] if res.get("eta_sweep_note") else []) + [""]
                if res.get("eta_sweep") else []),
              "## Token-wise activation outliers before vs after the prefix", "",
              "Per-token max |down_proj input| at each layer; ratio = top token / median token of that layer and "
              "sequence (mean over sequences, and the largest); outlier tokens per sequence at the same η.", "",
              "| tokens | mean ratio | max ratio | max value | outlier tokens / seq | worst 3 layers (mean ratio) |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, o in res["outliers"].items():
        per = o["ratio_top_to_median_per_layer"]
        worst = sorted(range(len(per)), key=lambda i: -per[i])[:3]
        lines.append(f"| {name} | {o['mean_ratio']:.1f} | {o['max_ratio']:.0f} | {o['max_token_value']:.1f} | "
                     f"{o['outlier_tokens_per_sequence']:.2f} | " + ", ".join(f"L{i}: {per[i]:.0f}" for i in worst)
                     + " |")
    lines += ["", "## Static per-tensor INT4 scales (calibration population)", "",
              "| population | rows | max K amax over layers | max V amax over layers | mean K scale | mean V scale |",
              "| --- | --- | --- | --- | --- | --- |"]
    for k, s in res["static_scales"].items():
        lines.append(f"| {k}: {s['population']} | {s['rows']} | {max(s['k_amax']):.2f} | {max(s['v_amax']):.2f} | "
                     f"{sum(s['k']) / len(s['k']):.4f} | {sum(s['v']) / len(s['v']):.4f} |")
    lines += ["", "## IntactKV calibration records", "",
              "| scheme | steps | held-out before | held-out after | selected step | rows still = extracted | s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for sch, r in res["calibration"].items():
        lines.append(f"| {SCHEME_NAMES.get(sch, sch)} | {r['steps']} | {r['heldout_before']:.4g} | "
                     f"{r['heldout_after']:.4g} | {r['selected_step']} | {r['equals_extracted']} | "
                     f"{r['seconds']:.0f} |")
    if res["calibration"]:
        r0 = next(iter(res["calibration"].values()))
        o = r0["optimizer"]
        lines += ["", f"Objective: {r0['objective']}.  Rounding gradient: {r0['rounding_gradient']}.  Optimizer: "
                  f"AdamW (peak lr {o['peak_lr']:g}, {o['schedule']}, {o['warmup_steps']} warmup steps, weight "
                  f"decay {o['weight_decay']:g}, global-norm clip {o['clip_global_norm']:g}); {r0['train_sequences']} "
                  f"training and {r0['heldout_sequences']} held-out sequences of {r0['seq_len']} tokens, chunk "
                  f"{r0['chunk']}; Orbax CheckpointManager keeps the best held-out steps and the lowest held-out "
                  "step is selected (step 0 = the extracted rows is a candidate)."]
    lines += ["", "## Anchors (source-reported, not reproduced here)", "",
              "* IntactKV (Liu et al. 2024): QuaRot W4A4 LLaMA-2-7B, C4 perplexity 8.30 → 8.12 with IntactKV. That "
              "is weight+activation quantization of a 7B model; here only the KV cache of a 135M model is "
              "quantized, so only the direction is comparable.",
              "* PrefixQuant (Chen et al. 2024, arXiv:2410.05265): static per-tensor/per-head KV4 becomes usable once "
              "the outlier tokens are isolated in the prefix (its block-wise fine-tuning is a separate claim, not "
              "part of this ablation).", "",
              "## Caveats", "",
              f"* {a['segments']} × {a['seq_len'] - 1} scored tokens: paired differences are meaningful, absolute "
              "ppl is noisy.  Calibration ran {0} steps on {1} sequences: a CPU-sized recipe, not the paper's."
              .format(a["steps"], a["calib_seqs"]),
              "* The calibration objective is computed with chunked prefill (chunk "
              f"{a['chunk']}) through `calibration.prefix_model.prefix_forward`; scoring "
              + ("is token by token." if a["eval_chunk"] == 1 else f"uses chunks of {a['eval_chunk']}."),
              f"* Prefix artifacts (ids): [BOS] `{res['artifacts']['bos']}`, [BOS] + system block "
              f"`{res['artifacts']['system']}` ({len(res['artifacts']['system_prefix_ids'])} tokens: "
              f"`{res['artifacts']['system_prefix_text']!r}`), PrefixQuant `{res['artifacts']['prefixquant']}`; "
              "written by `cache.prefix.save_artifact` (Orbax tensors + manifest with identity and sha256).", ""]
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/intactkv")
    ap.add_argument("--report-only", action="store_true", help="rewrite README.md from OUT/results.json")
    ap.add_argument("--artifact-dir", default=None, help="where prefix artifacts are written (default: a temp dir)")
    ap.add_argument("--schemes", default="fp32,kivi2,int3,int4,static4")
    ap.add_argument("--segments", type=int, default=8, help="WikiText-2 test segments")
    ap.add_argument("--seq-len", type=int, default=256, help="text tokens per test segment")
    ap.add_argument("--chunk", type=int, default=32, help="tokens per forward of the calibration objective")
    ap.add_argument("--eval-chunk", type=int, default=1,
                    help="tokens per forward when scoring (1 = teacher-forced decode: every prediction reads the "
                         "stored history; multi-row appends can reuse live KIVI ring slots in llama.forward's "
                         "in-place path)")
    ap.add_argument("--discovery-seqs", type=int, default=32)
    ap.add_argument("--discovery-len", type=int, default=256)
    ap.add_argument("--eta", type=float, default=64.0)
    ap.add_argument("--outlier-seqs", type=int, default=8, help="discovery sequences re-run after the prefix")
    ap.add_argument("--calib-seqs", type=int, default=8)
    ap.add_argument("--heldout-seqs", type=int, default=4)
    ap.add_argument("--calib-len", type=int, default=128)
    ap.add_argument("--scale-seqs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=4)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    out = Path(args.out)
    if args.report_only:
        return write_report(json.loads((out / "results.json").read_text()), out)
    out.mkdir(parents=True, exist_ok=True)
    art_dir = Path(args.artifact_dir or tempfile.mkdtemp(prefix="intactkv-artifacts-"))
    m = load_model()
    cfg, params, tok = m.cfg, m.params, m.tokenizer
    expect = model_identity(cfg, tok.hash, params=params)
    val = load_corpus(None, split="validation", fallback=False)
    test = load_corpus(None, split="test", fallback=False)
    val_ids = tok.encode(val.text)
    test_ids = tok.encode(test.text)
    bos = cfg.bos_id
    log(f"[ablation] validation {len(val_ids)} tokens, test {len(test_ids)} tokens")

    # disjoint validation windows: discovery | static scales | calibration train | held-out
    cursor = 0

    def take(n, length):
        nonlocal cursor
        a = np.asarray(val_ids[cursor:cursor + n * length], np.int32).reshape(n, length)
        cursor += n * length
        return a

    disc_text = take(args.discovery_seqs, args.discovery_len - 1)
    scale_text = take(args.scale_seqs, args.calib_len)
    calib_window = cursor
    train_text = take(args.calib_seqs, args.calib_len)
    held_text = take(args.heldout_seqs, args.calib_len)
    calib_window = f"validation token ids [{calib_window}, {cursor})"
    with_bos = lambda a: np.concatenate([np.full((len(a), 1), bos, np.int32), a], axis=1)  # noqa: E731

    # ---- artifacts -------------------------------------------------------------------------------------------
    art_b = ikv.extract_prefix(params, cfg, ikv.bos_prefix(tok), tokenizer_hash=tok.hash)
    sys_ids = ikv.system_prefix(tok)
    art_s = ikv.extract_prefix(params, cfg, sys_ids, tokenizer_hash=tok.hash, template=ikv.template_hash(tok))
    t0 = time.perf_counter()
    disc_stats = pq.down_proj_token_max(params, cfg, with_bos(disc_text))
    flags = pq.outlier_mask(disc_stats, args.eta).any(axis=0)
    disc = pq.select_prefix(with_bos(disc_text), flags, bos_id=bos, eta=args.eta, tokenizer_hash=tok.hash)
    art_pq = pq.prefixquant_artifact(params, cfg, disc, tokenizer_hash=tok.hash,
                                     provenance={"corpus": val.name, "corpus_sha256": val.sha256})
    log(f"[ablation] PrefixQuant prefix {disc.prefix_token_ids} in {time.perf_counter() - t0:.0f}s")
    eta_sweep = eta_table(disc_stats, with_bos(disc_text), bos, tok)
    for name, a in (("bos", art_b), ("system", art_s), ("prefixquant", art_pq)):
        save_artifact(a, art_dir / f"{name}-{a.artifact_id}")

    # ---- token-wise outliers before vs after the prefix (discovery sequences) ------------------------------------
    n_o = min(args.outlier_seqs, len(disc_text))
    after_b = pq.down_proj_token_max(params, cfg, disc_text[:n_o], art_b)
    after_pq = pq.down_proj_token_max(params, cfg, disc_text[:n_o], art_pq)
    before = disc_stats[:, :n_o]
    outliers = {"before ([BOS] + text, all tokens)": pq.outlier_summary(before, args.eta),
                "before, text tokens only": pq.outlier_summary(before, args.eta, skip_first=1),
                "after IntactKV [BOS] prefix (text tokens)": pq.outlier_summary(after_b, args.eta),
                "after PrefixQuant prefix (text tokens)": pq.outlier_summary(after_pq, args.eta)}

    # ---- static per-tensor INT4 scales: body rows only ------------------------------------------------------------
    scales = {"none": pq.static_kv_scales(params, cfg, with_bos(scale_text), None, bits=4),
              "bos": pq.static_kv_scales(params, cfg, scale_text, art_b, bits=4),
              "prefixquant": pq.static_kv_scales(params, cfg, scale_text, art_pq, bits=4)}
    log("[ablation] static scales fitted")

    # ---- evaluation ---------------------------------------------------------------------------------------------
    s = args.seq_len
    n_seg = min(args.segments, len(test_ids) // s)
    segs = np.asarray(test_ids[: n_seg * s], np.int32).reshape(n_seg, s)
    rows, records = [], {}
    sch = schemes(cfg, args.schemes.split(","))

    def body_for(name, scheme, which):
        if name != "static4":
            return scheme, None
        ks, vs, info = scales[which]
        sid = f"static-int4-{which}-{info['method']}"
        return StaticIntScheme(bits=4, scale_axis="tensor", calibration_id=sid, rope_theta=cfg.rope_theta,
                               rope_pairing=cfg.rope_pairing), (ks, vs)

    def evaluate(body, static, art):
        if art is None:
            toks = with_bos(segs)
            cache = init_cache(body, num_layers=cfg.num_layers, batch=n_seg, capacity=s + 1,
                               num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        else:
            toks = segs
            cache = start_request(art, body, n_seg, art.prefix_len + s, expect=expect)
        if static is not None:
            cache = load_static_scales(cache, *static)
        nll = chunked_nll(params, cfg, cache, toks, args.eval_chunk)
        nll = nll[:, 1:] if art is None else nll          # score text[1:] in every variant
        per = nll.mean(axis=1)
        return float(math.exp(per.mean())), per.tolist()

    for name, scheme in sch.items():
        variants = [("none", None, "none"), ("intactkv-extracted", art_b, "bos"),
                    ("intactkv-calibrated", None, "bos"), ("prefixquant", art_pq, "prefixquant")]
        for vname, art, which in variants:
            body, static = body_for(name, scheme, which)
            if vname == "intactkv-calibrated":
                if name == "fp32":
                    continue        # nothing to calibrate against: the fp body reproduces the teacher exactly
                t0 = time.perf_counter()
                art, rec = ikv.calibrate_intactkv(
                    params, cfg, art_b, body, train_text, held_text,
                    config=ikv.IntactKVConfig(steps=args.steps, batch=args.batch, chunk=args.chunk, lr=args.lr,
                                              eval_every=args.eval_every),
                    checkpoint_dir=Path(tempfile.mkdtemp(prefix=f"intactkv-{name}-")) / "ckpt",
                    corpus={"name": val.name, "sha256": val.sha256, "split": "validation",
                            "tokens": calib_window},
                    static_scales=static, log=log)
                save_artifact(art, art_dir / f"bos-calibrated-{name}-{art.artifact_id}")
                rec = {k: v for k, v in rec.items() if k not in ("body_scheme",)}
                records[name] = rec
                log(f"[ablation] calibrated {name} in {time.perf_counter() - t0:.0f}s: held-out "
                    f"{rec['heldout_before']:.5g} -> {rec['heldout_after']:.5g} (step {rec['selected_step']})")
            t0 = time.perf_counter()
            ppl, per = evaluate(body, static, art)
            rows.append({"scheme": name, "variant": vname, "ppl": ppl, "segment_nll": per,
                         "prefix_ids": list(art.token_ids) if art is not None else [bos],
                         "artifact_id": art.artifact_id if art is not None else None})
            log(f"[ablation] {name:8s} {vname:20s} ppl {ppl:.4f} ({time.perf_counter() - t0:.0f}s)")

    ref = next(r["ppl"] for r in rows if r["scheme"] == "fp32" and r["variant"] == "none")
    for r in rows:
        r["delta_ppl"] = r["ppl"] - ref
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": "python experiments/intactkv_ablation.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(), "git_commit": commit, "jax": jax.__version__,
        "backend": jax.default_backend(), "machine": platform.machine(), "device": jax.devices()[0].device_kind,
        "model": m.path,
        "model_sha256": cfg.sha256, "tokenizer_hash": tok.hash, "test_corpus": test.name,
        "test_corpus_sha256": test.sha256, "calibration_corpus": val.name, "calibration_corpus_sha256": val.sha256,
        "args": vars(args), "reference_ppl": ref, "rows": rows,
        "artifacts": {"bos": art_b.artifact_id, "system": art_s.artifact_id, "system_prefix_ids": sys_ids,
                      "system_prefix_text": tok.decode(sys_ids, skip_special=False),
                      "prefixquant": art_pq.artifact_id, "artifact_dir": str(art_dir)},
        "prefixquant_discovery": disc.to_dict(), "eta_sweep": eta_sweep,
        "prefixquant_tokens": [tok.decode([t], skip_special=False) for t in disc.prefix_token_ids],
        "outliers": outliers,
        "static_scales": {k: {"k": v[0].tolist(), "v": v[1].tolist(), **v[2]} for k, v in scales.items()},
        "calibration": records, "seconds": time.perf_counter() - t_start,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    write_report(result, out)
    log(f"[ablation] wrote {out / 'results.json'} and README.md in {result['seconds']:.0f}s")
    return result


if __name__ == "__main__":
    main()
