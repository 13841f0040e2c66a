"""experiments/gemma3_passkey.py's passkey.md (issue P): the mean Δ vs bf16 carries a paired bootstrap 95% CI over
the prompts (every policy answers the same seeded prompts; per-prompt outcomes come from the stored answers), and
the committed passkey.md is what ``--report-only`` writes from the committed passkey.json."""
import copy
import json
from pathlib import Path

import numpy as np
import pytest

from kvquant_jax.eval.stats import paired_delta_ci

from experiment_scripts import load_experiment

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "docs" / "results" / "gemma3" / "gpu"


@pytest.fixture(scope="module")
def gp():
    return load_experiment("gemma3_passkey")


def _out(gp, correct):
    """A protocol of 2 lengths x 2 depths x 4 trials; ``correct[policy]``: [len][depth][trial] booleans."""
    out = {"lengths": [100, 200], "depths": [0.0, 1.0], "trials": 4, "seed": 3, "new_tokens": 8, "policies": {}}
    keys = gp.prompt_keys(out["lengths"], out["depths"], out["trials"], out["seed"])
    for name, c in correct.items():
        ans = [[[f" {keys[(n, d, t)] if c[li][di][t] else '11111'}." for t in range(4)]
                for di, d in enumerate(out["depths"])] for li, n in enumerate(out["lengths"][:len(c)])]
        out["policies"][name] = {"bytes_at_longest": 1000, "answers": ans,
                                 "accuracy": [[float(np.mean(x)) for x in per] for per in c]}
    return out


def _delta_cells(lines):
    return {ln.strip("| ").split(" | ")[0]: ln.strip("| ").split(" | ")[-1] for ln in lines if ln.startswith("| ")
            and "---" not in ln}


def test_mean_delta_has_a_paired_ci_over_prompts(gp):
    rng = np.random.default_rng(0)
    bf16 = rng.random((2, 2, 4)) < 0.9
    worse = bf16 & (rng.random((2, 2, 4)) < 0.5)
    out = _out(gp, {"bf16": bf16.tolist(), "worse": worse.tolist(), "same": bf16.tolist()})
    cells = _delta_cells(gp.report(out))
    assert cells["bf16"] == "+0.000"                                   # the reference: no interval
    ci = paired_delta_ci(worse.ravel().astype(float), bf16.ravel().astype(float), np.mean)
    d = worse.mean() - bf16.mean()
    assert cells["worse"] == f"{d:+.3f} [{ci.lo:+.3f}, {ci.hi:+.3f}]" + ("" if ci.excludes_zero else " n.s.")
    assert cells["same"] == "+0.000 [+0.000, +0.000] n.s."
    assert "paired bootstrap" in gp.report(out)[0]


def test_partial_row_pairs_only_the_lengths_both_measured(gp):
    bf16 = np.ones((2, 2, 4), bool)
    short = np.zeros((1, 2, 4), bool)
    cells = _delta_cells(gp.report(_out(gp, {"bf16": bf16.tolist(), "short": short.tolist()})))
    assert cells["short"].startswith("-1.000 [-1.000, -1.000]") and cells["short"].endswith("(1 of 2 lengths)")


def test_answers_that_do_not_reproduce_the_accuracy_are_refused(gp):
    out = _out(gp, {"bf16": np.ones((2, 2, 4), bool).tolist(), "x": np.zeros((2, 2, 4), bool).tolist()})
    bad = copy.deepcopy(out)
    bad["seed"] = 4                                                   # other keys: the answers no longer match
    with pytest.raises(ValueError, match="do not reproduce"):
        gp.report(bad)


def test_committed_passkey_md_is_the_report_of_the_committed_json(gp):
    out = json.loads((GPU / "passkey.json").read_text())
    out.setdefault("new_tokens", 8)
    lines = gp.report(out)
    assert "\n".join(lines) + "\n" == (GPU / "passkey.md").read_text()
    cells = _delta_cells(lines)
    assert cells["int4"].startswith("-0.502 [") and cells["int4"].count("[") == 1
    assert cells["local bf16 + global kivi2"].endswith(" n.s.")
