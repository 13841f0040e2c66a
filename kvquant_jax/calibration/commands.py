"""``kvq intactkv extract|calibrate`` and ``kvq prefixquant discover`` (registered by ``kvquant_jax.cli``).

Calibration text is always the WikiText-2 VALIDATION split (``load_corpus(None, split="validation")``).
"""
from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

from kvquant_jax import validation as checks
from kvquant_jax.cache.prefix import load_artifact, model_identity, save_artifact
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.cache.static_int import StaticIntScheme, per_token_int
from kvquant_jax.calibration.intactkv import (IntactKVConfig, bos_prefix, calibrate_intactkv, extract_prefix,
                                              system_prefix, template_hash)
from kvquant_jax.calibration.prefixquant import discover_prefix, prefixquant_artifact, static_kv_scales
from kvquant_jax.data import load_corpus
from kvquant_jax.models import load_model


def add_parsers(sub) -> None:
    p = sub.add_parser("intactkv", help="IntactKV prefix artifacts: extract exact prefix K/V, calibrate them")
    isub = p.add_subparsers(dest="intactkv_cmd", required=True)
    e = isub.add_parser("extract", help="full-precision K/V of [BOS] or [BOS] + the chat system block")
    _model_args(e)
    e.add_argument("--prefix", default="bos", choices=["bos", "system"])
    e.add_argument("--out", required=True, help="artifact directory (must not exist)")
    e.set_defaults(func=cmd_extract)
    c = isub.add_parser("calibrate", help="train the prefix K/V against a quantized body scheme (Optax, STE)")
    _model_args(c)
    c.add_argument("--artifact", required=True, help="extracted artifact directory")
    c.add_argument("--cache", required=True, help="body scheme: a registry name (kivi2, int4, ...), int3, static4")
    c.add_argument("--out", required=True, help="calibrated artifact directory (must not exist)")
    c.add_argument("--checkpoint-dir", required=True, help="Orbax CheckpointManager directory (empty)")
    c.add_argument("--train-seqs", type=int, default=8)
    c.add_argument("--heldout-seqs", type=int, default=4)
    c.add_argument("--seq-len", type=int, default=128, help="body tokens per calibration sequence")
    c.add_argument("--steps", type=int, default=16)
    c.add_argument("--batch", type=int, default=2)
    c.add_argument("--chunk", type=int, default=32)
    c.add_argument("--lr", type=float, default=5e-3)
    c.add_argument("--eval-every", type=int, default=4)
    c.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("prefixquant", help="PrefixQuant: discover outlier tokens, build the hidden prefix")
    psub = p.add_subparsers(dest="prefixquant_cmd", required=True)
    d = psub.add_parser("discover", help="down_proj-input token outliers on validation text -> prefix artifact")
    _model_args(d)
    d.add_argument("--eta", type=float, default=64.0, help="outlier when max|x| > eta * median token max")
    d.add_argument("--seqs", type=int, default=32)
    d.add_argument("--seq-len", type=int, default=256, help="tokens per sequence, BOS included")
    d.add_argument("--max-tokens", type=int, default=8)
    d.add_argument("--out", required=True, help="artifact directory (must not exist)")
    d.set_defaults(func=cmd_discover)


def _model_args(p) -> None:
    p.add_argument("--model", default=None, help="known model name, a .gguf file or a HF folder")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--rope-pairing", default="half_split", choices=["half_split", "interleaved"])


def _load(args):
    return load_model(args.model, dtype=args.dtype, rope_pairing=args.rope_pairing, verbose=True)


def _validation_windows(tok, bos_id, n, length, *, with_bos):
    """``n`` disjoint validation windows of ``length`` tokens (BOS first when ``with_bos``) and the corpus."""
    corpus = load_corpus(None, split="validation", fallback=False)
    ids = tok.encode(corpus.text)
    body = length - 1 if with_bos else length
    if len(ids) < n * body:
        raise ValueError(f"validation split has {len(ids)} tokens, need {n * body}")
    a = np.asarray(ids[: n * body], np.int32).reshape(n, body)
    if with_bos:
        a = np.concatenate([np.full((n, 1), bos_id, np.int32), a], axis=1)
    return a, corpus


def _print(d) -> None:
    print(json.dumps(d, indent=1, default=str))


def cmd_extract(args) -> None:
    checks.new_dir(args.out)
    m = _load(args)
    tok = m.tokenizer
    ids = bos_prefix(tok) if args.prefix == "bos" else system_prefix(tok)
    art = extract_prefix(m.params, m.cfg, ids, tokenizer_hash=tok.hash, compute_dtype=args.dtype,
                         template=template_hash(tok) if args.prefix == "system" else "",
                         provenance={"prefix": args.prefix, "model_path": m.path})
    path = save_artifact(art, args.out)
    _print({"artifact": str(path), "artifact_id": art.artifact_id, "prefix_token_ids": list(ids),
            "prefix_text": tok.decode(ids, skip_special=False), "identity": art.identity.to_dict()})


def _body_scheme(spec: str, cfg):
    kw = dict(rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
    if spec.startswith("static"):
        return StaticIntScheme(bits=int(spec[len("static"):] or 4), calibration_id="pending", **kw)
    if spec in ("int3", "int5", "int6", "int7"):
        return per_token_int(int(spec[3:]), **kw)
    return make_scheme(spec, **kw)


def _check_calibrate(args) -> None:
    """Every precondition of ``kvq intactkv calibrate`` that does not need the model (before it loads)."""
    checks.existing_dir(args.artifact, "--artifact")
    checks.new_dir(args.out)
    checks.empty_or_missing_dir(args.checkpoint_dir, "--checkpoint-dir")
    for flag in ("train_seqs", "heldout_seqs", "seq_len", "steps", "batch", "chunk", "eval_every"):
        checks.check_int(getattr(args, flag), "--" + flag.replace("_", "-"), low=1)
    checks.check_float(args.lr, "--lr", low=0.0, low_open=True)
    spec = args.cache
    if not (spec.startswith("static") or spec in ("int3", "int5", "int6", "int7")):
        checks.scheme_arg(spec)
    elif spec.startswith("static") and spec[len("static"):] not in ("", "2", "3", "4", "5", "6", "7", "8"):
        raise ValueError(f"--cache: {spec!r}: expected static or staticN with N in 2..8")


def cmd_calibrate(args) -> None:
    _check_calibrate(args)
    m = _load(args)
    cfg, tok = m.cfg, m.tokenizer
    art = load_artifact(args.artifact, expect=model_identity(cfg, tok.hash, compute_dtype=args.dtype))
    body = _body_scheme(args.cache, cfg)
    n = args.train_seqs + args.heldout_seqs
    text, corpus = _validation_windows(tok, cfg.bos_id, n, args.seq_len, with_bos=False)
    static = None
    if isinstance(body, StaticIntScheme):
        ks, vs, info = static_kv_scales(m.params, cfg, text, art, bits=body.bits)
        static = (ks, vs)
        body = dataclasses.replace(body, calibration_id=f"static-int{body.bits}-{art.artifact_id}-{info['method']}")
        print(f"[kvq] static scales fitted on {info['rows']} body rows ({info['population']})", file=sys.stderr)
    conf = IntactKVConfig(steps=args.steps, batch=args.batch, chunk=args.chunk, lr=args.lr,
                          eval_every=args.eval_every)
    cal, rec = calibrate_intactkv(
        m.params, cfg, art, body, text[:args.train_seqs], text[args.train_seqs:], config=conf,
        checkpoint_dir=args.checkpoint_dir, static_scales=static,
        corpus={"name": corpus.name, "sha256": corpus.sha256, "split": "validation",
                "tokens": f"first {n * args.seq_len} token ids"},
        log=lambda s: print(s, file=sys.stderr))
    path = save_artifact(cal, args.out)
    _print({"artifact": str(path), "artifact_id": cal.artifact_id, "heldout_before": rec["heldout_before"],
            "heldout_after": rec["heldout_after"], "selected_step": rec["selected_step"],
            "equals_extracted": rec["equals_extracted"], "seconds": round(rec["seconds"], 1)})


def cmd_discover(args) -> None:
    checks.new_dir(args.out)
    checks.check_float(args.eta, "--eta", low=0.0, low_open=True)
    checks.check_int(args.seqs, "--seqs", low=1)
    checks.check_int(args.seq_len, "--seq-len", low=2)
    checks.check_int(args.max_tokens, "--max-tokens", low=1)
    m = _load(args)
    cfg, tok = m.cfg, m.tokenizer
    seqs, corpus = _validation_windows(tok, cfg.bos_id, args.seqs, args.seq_len, with_bos=True)
    d = discover_prefix(m.params, cfg, seqs, tokenizer_hash=tok.hash, eta=args.eta, max_tokens=args.max_tokens)
    art = prefixquant_artifact(m.params, cfg, d, tokenizer_hash=tok.hash, compute_dtype=args.dtype,
                               provenance={"corpus": corpus.name, "corpus_sha256": corpus.sha256})
    path = save_artifact(art, args.out)
    _print({"artifact": str(path), "artifact_id": art.artifact_id, **d.to_dict(),
            "prefix_tokens": [tok.decode([t], skip_special=False) for t in d.prefix_token_ids]})
