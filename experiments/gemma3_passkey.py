"""Passkey retrieval on Gemma-3-270M at long context under several KV-cache policies (GPU; runs small on CPU).

For each policy, context length and depth: ``trials`` random 5-digit keys hidden in filler text
(``kvquant_jax.eval.passkey.make_prompt``, prefixed with BOS: the model needs it), prompts prefilled in chunks of
``--chunk`` tokens (``serving.generate``; local layers keep their 512-row window ring, global layers the whole
history), greedy decode of ``--new-tokens`` tokens; correct when the first number generated is the key.  Also
records each policy's cache bytes at the longest length (the ledger over the real per-layer schemes, window rings
included) and the accuracy delta vs the bf16 cache.

    # GPU: 2K-32K x 5 depths x 20 trials (Wilson 95% intervals per length), 6 policies
    python experiments/gemma3_passkey.py --dtype bf16 --trials 20 --batch 10 --out docs/results/gemma3/passkey
    # CPU smoke run
    python experiments/gemma3_passkey.py --lengths 300 --depths 0 1 --trials 1 --policies bf16 int4 \
        --out /tmp/passkey
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from kvquant_jax.eval.passkey import first_number, make_prompt  # noqa: E402
from kvquant_jax.eval.stats import paired_delta_ci, wilson_interval  # noqa: E402
from kvquant_jax.models import load_model  # noqa: E402
from kvquant_jax.models.cache_layout import layer_schemes, schemes_by_layer_type  # noqa: E402
from kvquant_jax.quant.ledger import Ledger, LedgerShape, ledger  # noqa: E402
from kvquant_jax.serving.generate import generate  # noqa: E402

from gemma3_cache_sweep import POLICIES  # noqa: E402  (one table of policies for both Gemma-3 experiments)

def policy(cfg, name):
    return schemes_by_layer_type(cfg, *POLICIES[name])


def prompt_keys(lengths, depths, trials: int, seed: int) -> dict:
    """The key of every prompt ``(length, depth, trial)``: drawn from ``seed`` in this order, so every policy (and
    every resumed or separate process of the same protocol) answers the same prompts."""
    rng = np.random.default_rng(seed)
    return {(n, d, t): str(rng.integers(10000, 100000)) for n in lengths for d in depths for t in range(trials)}


def outcomes(out: dict, row: dict) -> np.ndarray:
    """Per-prompt correctness ``[lengths measured, depths, trials]`` (1.0 = the first number generated is the key)
    from the row's stored answers and the protocol's seeded keys; checked against the row's stored accuracy."""
    keys = prompt_keys(out["lengths"], out["depths"], out["trials"], out.get("seed", 0))
    got = np.array([[[float(first_number(x) == keys[(n, d, t)]) for t, x in enumerate(texts)]
                     for d, texts in zip(out["depths"], per_len)]
                    for n, per_len in zip(out["lengths"], row["answers"])]).reshape(
        len(row["answers"]), len(out["depths"]), out["trials"])
    if not np.allclose(got.mean(axis=2), np.asarray(row["accuracy"], np.float64)[:len(got)]):
        raise ValueError("stored answers do not reproduce the stored accuracy: another protocol or seed?")
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384, 32000])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--batch", type=int, default=10, help="prompts per generate call (a cell's trials in batches)")
    ap.add_argument("--policies", nargs="+", default=["bf16", "int8", "int4", "fp8_e4m3 (warm-up per-head scales)",
                                                      "kivi2", "local bf16 + global kivi2",
                                                      "local kivi2 + global bf16", "local int4 + global bf16"])
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--report-only", action="store_true", help="rewrite passkey.md from OUT/passkey.json")
    a = ap.parse_args()
    if a.report_only:
        out = json.loads((Path(a.out) / "passkey.json").read_text())
        out.setdefault("new_tokens", 8)
        (Path(a.out) / "passkey.md").write_text("\n".join(report(out)) + "\n")
        return
    m = load_model(a.model, dtype=a.dtype)
    cfg, tok = m.cfg, m.tokenizer
    keys = prompt_keys(a.lengths, a.depths, a.trials, a.seed)
    out = {"model": model_identity(m), "dtype": a.dtype, "lengths": a.lengths, "depths": a.depths, "trials": a.trials,
           "seed": a.seed, "new_tokens": a.new_tokens, "command": "python " + " ".join(sys.argv), "policies": {}}
    out["policies"], partial = previous_rows(Path(a.out) / "passkey.json", out)
    if partial:                                # cells only logged by an interrupted run, until a row replaces them
        out["partial_policies"] = partial
    longest = max(a.lengths) + a.new_tokens
    for name in a.policies:
        per = policy(cfg, name)
        led = ledger(layer_schemes(cfg, per), LedgerShape(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim,
                                                            longest, longest))
        row = out["policies"].pop(name, None) or {"accuracy": [], "answers": [], "seconds": 0.0}
        row["bytes_at_longest"] = Ledger.total(led.logical)
        out["policies"][name] = row
        out.get("partial_policies", {}).pop(name, None)
        for n in a.lengths[len(row["accuracy"]):]:     # resume: the lengths a previous run finished are kept
            acc, ans = [], []
            for d in a.depths:
                texts = []
                for lo in range(0, a.trials, a.batch):
                    prompts = [[cfg.bos_id] + make_prompt(tok, n - 1, d, keys[(n, d, t)])
                               for t in range(lo, min(a.trials, lo + a.batch))]
                    t0 = time.time()
                    res = generate(m.params, cfg, prompts, max_new_tokens=a.new_tokens, scheme=per,
                                   capacity=n + a.new_tokens + 64, prefill_chunk=a.chunk)
                    row["seconds"] += time.time() - t0
                    texts += [tok.decode(r) for r in res.tokens]
                acc.append(float(np.mean([first_number(x) == keys[(n, d, t)] for t, x in enumerate(texts)])))
                ans.append(texts)
                print(f"{name} T={n} depth={d}: acc {acc[-1]:.2f} {texts[0]!r}", flush=True)
            row["accuracy"].append(acc)
            row["answers"].append(ans)
            write(a, out)                      # after every length: a run stopped early keeps what it finished


def model_identity(m) -> str:
    """The model as a protocol field: file name + sha256 prefix (the digest the loader already has,
    ``cfg.sha256``), so a copy of the same GGUF in another directory (another machine's cache) resumes the same
    file and another GGUF does not."""
    if not m.cfg.sha256:
        raise SystemExit(f"{m.path}: the loaded model carries no sha256; its results cannot be resumed by identity")
    return f"{Path(m.path).name} (sha256 {m.cfg.sha256[:8]}...)"


def previous_rows(path: Path, out: dict) -> tuple[dict, dict]:
    """The policy rows of an earlier ``passkey.json`` at ``path`` measured with the same protocol (model, dtype,
    lengths, depths, trials, seed, new tokens: then its keys and prompts are the same), to be resumed; ``{}`` when
    there is none; and its ``partial_policies`` (cells an interrupted run only logged).  A file with another
    protocol is refused by name rather than mixed in or overwritten."""
    if not path.is_file():
        return {}, {}
    old = json.loads(path.read_text())
    old.setdefault("seed", 0)
    old.setdefault("new_tokens", 8)
    differ = [k for k in ("model", "dtype", "lengths", "depths", "trials", "seed", "new_tokens")
              if old.get(k) != out[k]]
    if differ:
        raise SystemExit(f"{path} was measured with another protocol ({', '.join(differ)} differ: "
                         + "; ".join(f"{k} {old.get(k)!r} vs {out[k]!r}" for k in differ)
                         + "); pass another --out")
    return dict(old["policies"]), dict(old.get("partial_policies", {}))


def report(out: dict) -> list[str]:
    """passkey.md's lines: accuracy per length over its depths x trials with the Wilson 95% interval, and the mean
    difference to bf16 over the lengths BOTH rows measured (a row an interrupted run left short says how many),
    with its paired bootstrap 95% CI over those prompts (every policy answers the same seeded prompts, so the
    per-prompt outcomes pair up; ``eval.stats.paired_delta_ci``)."""
    n_cell = len(out["depths"]) * out["trials"]
    base = out["policies"].get("bf16")
    lines = [f"{out['trials']} trials x {len(out['depths'])} depths = {n_cell} prompts per length; "
             f"[Wilson 95% interval]; — = not measured yet (the run resumes there). mean Δ vs bf16: mean over the "
             f"lengths both rows measured [95% CI: paired bootstrap over those prompts, each policy's outcome on a "
             f"prompt paired with bf16's on the same seeded prompt (BCa, 10,000 resamples, "
             f"`kvquant_jax.eval.stats`); n.s. = the interval contains 0]", "",
             "| policy | bytes at %d tokens | " % (max(out["lengths"]) + out["new_tokens"])
             + " | ".join(f"acc {n}" for n in out["lengths"]) + " | mean Δ vs bf16 [95% CI] |",
             "|---|---|" + "---|" * len(out["lengths"]) + "---|"]
    for name, row in out["policies"].items():
        cells = []
        for r in row["accuracy"]:
            k = int(round(float(np.mean(r)) * n_cell))
            lo, hi = wilson_interval(k, n_cell)
            cells.append(f"{k / n_cell:.2f} [{lo:.2f}, {hi:.2f}]")
        cells += ["—"] * (len(out["lengths"]) - len(cells))
        delta = ""
        if base is not None:
            both = min(len(row["accuracy"]), len(base["accuracy"]))
            if both:
                d = np.mean([np.mean(row["accuracy"][i]) - np.mean(base["accuracy"][i]) for i in range(both)])
                delta = f"{d:+.3f}"
                if row is not base:
                    ci = paired_delta_ci(outcomes(out, row)[:both].ravel(), outcomes(out, base)[:both].ravel(),
                                         np.mean, what=f"passkey {name} vs bf16")
                    delta += f" [{ci.lo:+.3f}, {ci.hi:+.3f}]" + ("" if ci.excludes_zero else " n.s.")
                delta += "" if both == len(out["lengths"]) else f" ({both} of {len(out['lengths'])} lengths)"
        lines.append(f"| {name} | {row['bytes_at_longest']:,} | " + " | ".join(cells) + f" | {delta} |")
    return lines


def write(a, out) -> None:
    """passkey.json (every answer) and passkey.md (:func:`report`)."""
    lines = report(out)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "passkey.json").write_text(json.dumps(out, indent=1) + "\n")
    (Path(a.out) / "passkey.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
