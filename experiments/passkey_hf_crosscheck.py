"""Is a failing passkey cell the model's, or ours?  transformers (fp32, CPU) on the same GGUF and the same prompt ids.

The committed passkey sweeps store every trial's greedy continuation (``values.answers[length][depth][trial]``)
of the fp32 baseline.  This script rebuilds those trials' prompts exactly (the sweep's key stream: one
``numpy.random.default_rng(seed)`` drawn per length, depth-major then trial, as
:func:`kvquant_jax.eval.passkey.passkey_accuracy` does), greedy-decodes them with transformers' own LLaMA
implementation built from the same GGUF, and prints, per cell, the key, our committed baseline answer and
transformers' answer.  If transformers answers like our baseline in the cells where the baseline fails, the
failure is the model's on this prompt, not our kernels', cache or RoPE at long positions.

    python experiments/passkey_hf_crosscheck.py --results docs/results/gpu/passkey/results.jsonl \
        --cells 4096:1.0,8000:0.0,8000:1.0,2048:1.0,4096:0.5,8000:0.5 --trials 3 \
        --out docs/results/gpu/passkey/hf_crosscheck.json
    # two of the trials the baseline fails in the (2048, 1.0) cell, added to the same file
    python experiments/passkey_hf_crosscheck.py ... --cells 2048:1.0:4 --trials 2 --append --out ...

A cell is ``LENGTH:DEPTH`` (its first ``--trials`` trials) or ``LENGTH:DEPTH:FIRST`` (trials FIRST ...).

Needs the ``ref`` extra (torch CPU, transformers); an 8,000-token prefill takes about a minute on two cores.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np


def baseline_row(results: Path) -> dict:
    """The fp32 baseline passkey row of a committed sweep's results.jsonl."""
    for line in results.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("role") == "baseline" and "answers" in r.get("values", {}):
            return r
    raise ValueError(f"{results}: no baseline passkey row (role 'baseline' with values.answers)")


def sweep_keys(lengths, depths, trials: int, digits: int, seed: int) -> list[list[list[str]]]:
    """keys[length][depth][trial], drawn as passkey_accuracy draws them (``eval.passkey.draw_trials``)."""
    from kvquant_jax.eval.passkey import draw_trials

    rng = np.random.default_rng(seed)
    out = []
    for _ in lengths:
        per = [[] for _ in depths]
        for di, key in draw_trials(rng, len(depths), trials, digits):
            per[di].append(key)
        out.append(per)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True, help="a committed passkey sweep's results.jsonl")
    ap.add_argument("--cells", required=True, help="comma-separated LENGTH:DEPTH cells of that sweep")
    ap.add_argument("--trials", type=int, default=3, help="the first N trials of each cell")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--append", action="store_true", help="add to the cells already in --out")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    import torch
    import transformers

    from kvquant_jax.eval.passkey import first_number, make_prompt
    from kvquant_jax.models.loader import load_model

    row = baseline_row(Path(a.results))
    task = row["config"]["tasks"]["passkey"]
    lengths, depths = task["lengths"], task["depths"]
    keys = sweep_keys(lengths, depths, task["trials"], task["digits"], task["seed"])
    answers = row["values"]["answers"]
    ours = load_model(row["config"]["model"]["name"])
    torch.set_num_threads(a.threads)
    p = Path(ours.path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    hf.eval()
    cells, commands = [], []
    if a.append:
        prev = json.loads(Path(a.out).read_text())
        cells, commands = prev["cells"], prev.get("commands") or [prev["command"]]
    for spec in a.cells.split(","):
        n_s, d_s, *first = spec.split(":")
        n, d, first = int(n_s), float(d_s), int(first[0]) if first else 0
        if n not in lengths or d not in depths:
            raise ValueError(f"cell {spec!r} is not in the sweep (lengths {lengths}, depths {depths})")
        li, di = lengths.index(n), depths.index(d)
        for t in range(first, min(first + a.trials, task["trials"])):
            key = keys[li][di][t]
            ids = make_prompt(ours.tokenizer, n, d, key)
            t0 = time.perf_counter()
            with torch.no_grad():
                gen = hf.generate(torch.tensor([ids]), max_new_tokens=task["max_new_tokens"], do_sample=False,
                                  attention_mask=torch.ones((1, len(ids)), dtype=torch.long))
            text = ours.tokenizer.decode([int(i) for i in gen[0, len(ids):]])
            mine = answers[li][di][t]
            cells.append({"length": n, "depth": d, "trial": t, "key": key, "ours": mine, "transformers": text,
                          "ours_correct": first_number(mine) == key, "transformers_correct": first_number(text) == key,
                          "same_text": mine == text, "seconds": round(time.perf_counter() - t0, 1)})
            print(f"{n:5d} {d:4.2f} t{t} key {key}  ours {mine!r:34s} transformers {text!r}", flush=True)
    out = {"results": a.results, "baseline_key": row["key"], "model": row["config"]["model"]["name"],
           "gguf": p.name, "transformers": transformers.__version__, "torch": torch.__version__,
           "platform": platform.platform(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commands": commands + ["python experiments/passkey_hf_crosscheck.py "
                                   + " ".join(argv or sys.argv[1:])],
           "cells": cells,
           "agree": sum(c["transformers_correct"] == c["ours_correct"] for c in cells), "n": len(cells)}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"correctness agrees in {out['agree']} of {out['n']} trials; identical text in "
          f"{sum(c['same_text'] for c in cells)}")


if __name__ == "__main__":
    main()
