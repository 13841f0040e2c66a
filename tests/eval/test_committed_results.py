"""The committed sweep reports under docs/results/ are what their configs produce today: every row the config
plans is in the folder's results.jsonl (so rerunning the report's command resumes with nothing to compute, and a
change to a config, or to how row keys are derived, cannot silently orphan the published numbers). A committed
partial run names its missing points and why in ``sweep.yaml``'s ``owed`` record; only those points' rows may be
missing, and a record whose points are all present is stale (it fails, so the record is removed once they run)."""
import json
from pathlib import Path

import pytest
import yaml

from kvquant_jax.config import load_config
from kvquant_jax.eval.report import owed_labels
from kvquant_jax.eval.runner import planned_keys, sweep_baseline

REPO = Path(__file__).resolve().parents[2]
FOLDERS = sorted(p.parent for p in (REPO / "docs" / "results").glob("**/sweep.yaml"))


def test_there_are_committed_sweeps():
    assert len(FOLDERS) >= 5, FOLDERS


@pytest.mark.parametrize("folder", FOLDERS, ids=[str(f.relative_to(REPO / "docs" / "results")) for f in FOLDERS])
def test_committed_rows_cover_the_current_config(folder):
    meta = yaml.safe_load((folder / "sweep.yaml").read_text())
    loaded = load_config(REPO / meta["config_file"], meta.get("overrides") or [], meta.get("sizes"))
    points, baseline = loaded.points(), sweep_baseline(loaded)
    owed = set(owed_labels(points, meta.get("owed")))
    stored = {json.loads(line)["key"] for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()}
    # --metrics, if any; the owed points' own rows are checked separately
    planned = planned_keys([p for p in points if p.label not in owed], baseline, meta.get("metrics"))
    missing = planned - stored
    assert not missing, f"{folder.name}: {len(missing)} of {len(planned)} planned rows are not in results.jsonl"
    for p in points:
        if p.label in owed:
            assert planned_keys([p], baseline, meta.get("metrics")) - stored, (
                f"{folder.name}: sweep.yaml owes {p.label!r} but its rows are all in results.jsonl (remove the record)")


def test_owed_records_are_checked():
    """The ``owed`` record itself is validated: a reason is required and every label must be a config point."""
    folder = REPO / "docs" / "results" / "gpu" / "passkey"
    meta = yaml.safe_load((folder / "sweep.yaml").read_text())
    points = load_config(REPO / meta["config_file"], meta.get("overrides") or [], meta.get("sizes")).points()
    assert owed_labels(points, None) == []
    with pytest.raises(ValueError, match="reason"):
        owed_labels(points, {"points": ["scheme=int2"]})
    with pytest.raises(ValueError, match="not points of the config.*scheme=int9"):
        owed_labels(points, {"points": ["scheme=int9"], "reason": "typo"})


def test_transformed_models_are_reported_against_the_untransformed_model():
    """A W8A8 / smoothing point's Δ is against the fp32 cache on its own transformed model (marked †); the report's
    model-transform table gives the transform's own effect against the untransformed model, with a paired CI
    (checked on the committed GPU W8A8 sweep: W8A8 costs serving ppl, SmoothAttention is exact in float)."""
    from kvquant_jax.eval import report as R

    folder = REPO / "docs" / "results" / "gpu" / "w8a8"
    meta = yaml.safe_load((folder / "sweep.yaml").read_text())
    loaded = load_config(REPO / meta["config_file"], meta.get("overrides") or [], meta.get("sizes"))
    entries = R.collect(R._load(folder / "results.jsonl"), loaded.points(), sweep_baseline(loaded))
    lines = R._model_transform_table(entries, sweep_baseline(loaded))
    rows = {ln.split(" | ")[0].strip("| "): ln for ln in lines if ln.startswith("| ") and "---" not in ln}
    assert "W8A8" in rows and "float" not in rows and "qserve4 KV" not in rows
    assert "n.s." not in rows["W8A8"] and rows["W8A8"].rstrip(" |").endswith("]")
    assert "n.s." in rows["qserve4 KV + SmoothAttention"]
    w8 = next(e for e in entries if e["point"].label == "W8A8")
    assert R._delta_cell(w8, "serving_ppl").endswith("†")
