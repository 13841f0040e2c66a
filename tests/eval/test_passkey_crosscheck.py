"""experiments/passkey_hf_crosscheck.py rebuilds a committed passkey sweep's trials exactly: its key stream is the
one :func:`kvquant_jax.eval.passkey.passkey_accuracy` drew.  Checked on the committed GPU sweep: wherever the fp32
baseline answered with a number, the number is the reconstructed key of that (length, depth, trial) only if the
two orders agree; a different draw order (trial-major, one stream for all lengths) matches almost none."""
import json
from pathlib import Path

import numpy as np

from experiment_scripts import load_experiment
from kvquant_jax.eval.passkey import first_number

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "gpu" / "passkey"


def _baseline():
    x = load_experiment("passkey_hf_crosscheck")
    row = x.baseline_row(RESULTS / "results.jsonl")
    return x, row, row["config"]["tasks"]["passkey"]


def test_reconstructed_keys_are_the_sweep_keys():
    x, row, t = _baseline()
    keys = x.sweep_keys(t["lengths"], t["depths"], t["trials"], t["digits"], t["seed"])
    answers = row["values"]["answers"]
    hits = sum(first_number(a) == k for li in range(len(t["lengths"])) for di in range(len(t["depths"]))
               for a, k in zip(answers[li][di], keys[li][di]))
    total = len(t["lengths"]) * len(t["depths"]) * t["trials"]
    assert hits == round(row["values"]["mean"] * total)              # every correct trial, at its own key
    assert hits > 300


def test_a_different_draw_order_does_not_match():
    _, row, t = _baseline()
    rng = np.random.default_rng(t["seed"])
    lo, hi = 10 ** (t["digits"] - 1), 10 ** t["digits"]
    answers = row["values"]["answers"]
    hits = 0
    for li in range(len(t["lengths"])):
        for tr in range(t["trials"]):                                # trial-major: the wrong order
            for di in range(len(t["depths"])):
                hits += first_number(answers[li][di][tr]) == str(rng.integers(lo, hi))
    assert hits < 20


def test_committed_crosscheck_agrees_everywhere():
    d = json.loads((RESULTS / "hf_crosscheck.json").read_text())
    assert d["n"] == len(d["cells"]) == 20 and d["agree"] == 20
    assert all(c["same_text"] for c in d["cells"])
    assert {(c["length"], c["depth"]) for c in d["cells"] if not c["ours_correct"]} >= {(4096, 1.0), (8000, 0.0)}
