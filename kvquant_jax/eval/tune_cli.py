"""``kvq tune-policy CONFIG --budget B[,B...] --out DIR`` (registered by ``kvquant_jax.cli``).

CONFIG is an experiment config: its ``model`` block is the model, ``data.calibration_corpus`` /
``data.calibration_split`` the calibration text (never the evaluation split: refused), ``tasks.ppl`` the probe and
validation sizes (``seq_len`` x ``max_segments`` tokens fed in ``chunk``-token pieces; ``[BOS] + seq_len - 1`` text
tokens per segment for models that need BOS, as ``kvq ppl``) and ``tasks.bytes.length`` (or ``--context``) the
context length bits/element are counted at: on sliding-window models (Gemma-3) a local layer keeps only its
window ring whatever the context, so the search's cost of a format there shrinks as the context grows.  Writes
``DIR/sensitivity.json`` and per budget a ``policy.yaml`` (the config ``cache`` block) + ``manifest.json`` (``DIR``
itself for one budget, ``DIR/<metric>_<budget>/`` for several).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from kvquant_jax import validation as checks
from kvquant_jax.cache.registry import NAMES
from kvquant_jax.config import load_config
from kvquant_jax.eval import tune_policy as TP
from kvquant_jax.eval.metrics import Session


def add_parsers(sub) -> None:
    p = sub.add_parser("tune-policy", help="per-layer, per-tensor (K / V) cache format search under a quality "
                                           "budget, on calibration text -> policy.yaml + manifest.json")
    p.add_argument("config", help="experiment config (configs/tune_policy.yaml): model, data.calibration_*, "
                                  "tasks.ppl sizes")
    p.add_argument("--budget", required=True,
                   help="budget(s), comma-separated: Δppl in %% (--metric ppl) or mean KL in nats (--metric kl)")
    p.add_argument("--metric", default="ppl", choices=TP.BUDGET_METRICS)
    p.add_argument("--candidates", default=",".join(TP.DEFAULT_CANDIDATES),
                   help="comma-separated registry names each layer's K and V may take")
    p.add_argument("--cost", default="max", choices=TP.COSTS,
                   help="per-item cost the search sums: max(Δ NLL, KL) (default), KL, or Δ NLL")
    p.add_argument("--sensitivity", default=None, metavar="JSON",
                   help="reuse the measurements of an earlier run (its sensitivity.json or manifest.json): model, "
                        "calibration text, sizes and candidates must match")
    p.add_argument("--validation-segments", type=int, default=4,
                   help="calibration segments (tasks.ppl.seq_len tokens each, after the probe's) the chosen policy is "
                        "validated on; 0 = the probe's own segments")
    p.add_argument("--accept", default="point", choices=("point", "upper"),
                   help="validation passes when the Δppl (point) or the upper end of its 95%% paired bootstrap CI "
                        "over the validation segments (upper: conservative) fits the budget")
    p.add_argument("--context", type=int, default=None, metavar="TOKENS",
                   help="context length the bits/element of every layer are counted at (default "
                        "tasks.bytes.length); local (sliding-window) layers retain only their window ring")
    p.add_argument("--max-backoff", type=int, default=4, help="re-searches at a smaller budget when validation fails")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (dotted key, YAML value)")
    p.add_argument("--out", required=True, help="new output directory")
    p.set_defaults(func=cmd_tune_policy)


def parse_budgets(text: str, metric: str) -> list[float]:
    """``"0.5,1,2"`` -> ``[0.5, 1.0, 2.0]``; raises ``ValueError`` naming ``--budget`` for anything else."""
    out = []
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        try:
            b = float(item)
        except ValueError:
            raise ValueError(f"--budget: {item!r} is not a number") from None
        if not math.isfinite(b) or b < 0:
            raise ValueError(f"--budget: {item} must be a finite number >= 0 ({'% ppl' if metric == 'ppl' else 'KL'})")
        out.append(b)
    if not out:
        raise ValueError("--budget: give at least one value")
    return out


def parse_candidates(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in str(text).split(",") if s.strip())
    bad = [n for n in names if n not in NAMES]
    if bad or not names:
        raise ValueError(f"--candidates: unknown {bad or '(empty)'}; registry names: {sorted(NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--candidates: {list(names)} repeats a name")
    return names


def _without_bits_length(identity: dict) -> dict:
    """An identity with ``probe.bits_length`` left out: the bits length is accounting, not measurement."""
    probe = identity.get("probe")
    if not isinstance(probe, dict):
        return identity
    return {**identity, "probe": {k: v for k, v in probe.items() if k != "bits_length"}}


def reuse_sensitivity(path, *, identity: dict):
    """The measurements of an earlier run's ``sensitivity.json`` / ``manifest.json``; raises ``ValueError``
    naming every identity field (model, calibration text, sizes, candidates) that differs from ``identity``.
    ``probe.bits_length`` may differ (the caller recounts the bits at its own length)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--sensitivity {path}: cannot read ({e})") from None
    if not isinstance(d, dict) or "sensitivity" not in d:
        raise ValueError(f"--sensitivity {path}: not a tune-policy sensitivity.json / manifest.json")
    mine, theirs = _without_bits_length(identity), _without_bits_length(d)
    bad = [k for k, v in mine.items() if theirs.get(k) != v]
    if bad:
        raise ValueError(f"--sensitivity {path}: measured for another setup: " + "; ".join(
            f"{k} {d.get(k)!r} != {identity[k]!r}" for k in bad))
    return TP.sensitivity_from_dict(d["sensitivity"])


def run(loaded, *, budgets, metric: str, candidates, out: Path, max_backoff: int = 4, cost: str = "max",
        sensitivity: str | None = None, validation_segments: int = 4, accept: str = "point",
        context: int | None = None, log=None) -> list[dict]:
    """The whole command on a loaded config (returns the manifests written).  ``context``: the bits length
    (default ``tasks.bytes.length``)."""
    log = log or (lambda m: print(f"[kvq] {m}", file=sys.stderr))
    cfg = loaded.config
    TP.check_calibration_text(cfg.data.calibration_split, cfg.data.calibration_corpus)
    task = cfg.tasks.ppl
    if task.seq_len % task.chunk:
        raise ValueError(f"tasks.ppl.chunk {task.chunk} must divide tasks.ppl.seq_len {task.seq_len} for tune-policy")
    bits_length = cfg.tasks.bytes.length if context is None else context
    if bits_length < 1:
        raise ValueError(f"--context / tasks.bytes.length must be >= 1, got {bits_length}")
    session = Session(log=log)
    model = session.model(cfg)
    corpus = session.corpus(cfg, calibration=True)       # only the calibration text is read
    both = TP.calibration_segments(corpus.ids, task.seq_len, task.max_segments + validation_segments, model.cfg)
    tokens = both[:task.max_segments]
    held_out = both[task.max_segments:] if validation_segments else tokens
    tok_hash = getattr(model.tokenizer, "hash", "")
    corpus_rec = {"name": corpus.name, "source": corpus.source, "sha256": corpus.sha256,
                  "split": cfg.data.calibration_split, "segments": int(tokens.shape[0]),
                  "seq_len": int(tokens.shape[1])}
    if model.cfg.bos_required:
        corpus_rec["bos"] = True                            # segments are [BOS] + seq_len - 1 text tokens
    settings = {"seq_len": task.seq_len, "segments": task.max_segments, "chunk": task.chunk,
                "bits_length": bits_length, "max_backoff": max_backoff, "cost": cost, "accept": accept,
                "validation_segments": validation_segments or task.max_segments,
                "validation_tokens": "held-out calibration segments after the probe's" if validation_segments
                else "the probe's segments",
                "config": str(loaded.path), "overrides": [list(map(str, o)) for o in loaded.overrides]}
    identity = {"model_sha256": model.sha256, "tokenizer_hash": tok_hash, "calibration_corpus": corpus_rec,
                "candidates": list(candidates), "probe": {k: settings[k] for k in ("seq_len", "segments", "chunk",
                                                                                   "bits_length")}}
    if sensitivity is not None:
        sens = reuse_sensitivity(sensitivity, identity=identity)
        sens = sens.replace(bits=TP.layer_bits(candidates, model.cfg, bits_length), bits_length=bits_length)
        log(f"sensitivity: reused {sensitivity} (bits recounted at {bits_length} tokens)")
    else:
        limits = [math.log1p(b / 100.0) if metric == "ppl" else b for b in budgets]
        t0 = time.perf_counter()
        sens = TP.measure_sensitivity(model.params, model.cfg, tokens, candidates, chunk=task.chunk,
                                      bits_length=bits_length, prune_above=max(limits), log=log)
        log(f"sensitivity: {len(candidates)} candidates x 2 tensors x {model.cfg.num_layers} layers in "
            f"{time.perf_counter() - t0:.0f} s")
    out.mkdir(parents=True)
    (out / "sensitivity.json").write_text(json.dumps({**identity, "sensitivity": sens.to_dict()}, indent=1) + "\n")
    written = []
    for b in budgets:
        res = TP.tune(model.params, model.cfg, held_out, sens, metric=metric, budget=b, chunk=task.chunk,
                      cost=cost, max_backoff=max_backoff, accept=accept, log=log)
        block = TP.cache_block(res.choice)
        built = TP.policy_from_block(block, model.cfg).schemes
        if built != TP.choice_schemes(res.choice, model.cfg):
            raise RuntimeError("tune-policy: the written cache block does not rebuild the chosen policy")
        man = TP.manifest(model_sha256=model.sha256, tokenizer_hash=tok_hash, corpus=corpus_rec, sens=sens,
                          result=res, metric=metric, budget=b, settings=settings, cost=cost)
        where = out if len(budgets) == 1 else out / f"{metric}_{b:g}"
        TP.write_outputs(where, man)
        log(f"budget {b:g}: {res.bits:.3f} bits/elem, validated Δppl {res.validation['ppl_pct']:+.3f}% "
            f"({'within' if res.within_budget else 'OVER'} budget) -> {where / 'policy.yaml'}")
        written.append(man)
    return written


def cmd_tune_policy(args) -> None:
    budgets = parse_budgets(args.budget, args.metric)
    candidates = parse_candidates(args.candidates)
    if args.validation_segments < 0:
        raise ValueError(f"--validation-segments must be >= 0, got {args.validation_segments}")
    if args.context is not None and args.context < 1:
        raise ValueError(f"--context must be >= 1 tokens, got {args.context}")
    if args.max_backoff < 0:
        raise ValueError(f"--max-backoff must be >= 0, got {args.max_backoff}")
    checks.new_dir(args.out)
    loaded = load_config(args.config, args.overrides)
    for man in run(loaded, budgets=budgets, metric=args.metric, candidates=candidates, out=Path(args.out),
                   max_backoff=args.max_backoff, cost=args.cost, sensitivity=args.sensitivity,
                   validation_segments=args.validation_segments, accept=args.accept,
                   context=args.context):
        print(json.dumps({"budget": man["budget"], "bits_per_element": man["bits_per_element"],
                          "validated_ppl_pct": man["validation"]["ppl_pct"],
                          "within_budget": man["validation"]["within_budget"]}))
