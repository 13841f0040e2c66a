"""The committed sweep reports under docs/results/ are what their configs produce today: every row the config
plans is in the folder's results.jsonl (so rerunning the report's command resumes with nothing to compute, and a
change to a config, or to how row keys are derived, cannot silently orphan the published numbers)."""
import json
from pathlib import Path

import pytest
import yaml

from kvquant_jax.config import load_config
from kvquant_jax.eval.runner import planned_keys, sweep_baseline

REPO = Path(__file__).resolve().parents[2]
FOLDERS = sorted(p.parent for p in (REPO / "docs" / "results").glob("**/sweep.yaml"))


def test_there_are_committed_sweeps():
    assert len(FOLDERS) >= 5, FOLDERS


@pytest.mark.parametrize("folder", FOLDERS, ids=[str(f.relative_to(REPO / "docs" / "results")) for f in FOLDERS])
def test_committed_rows_cover_the_current_config(folder):
    meta = yaml.safe_load((folder / "sweep.yaml").read_text())
    loaded = load_config(REPO / meta["config_file"], meta.get("overrides") or [], meta.get("sizes"))
    planned = planned_keys(loaded.points(), sweep_baseline(loaded))
    stored = {json.loads(line)["key"] for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()}
    missing = planned - stored
    assert not missing, f"{folder.name}: {len(missing)} of {len(planned)} planned rows are not in results.jsonl"
