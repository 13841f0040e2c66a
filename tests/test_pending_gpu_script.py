"""experiments/run_pending_gpu.sh: every job it can run is a name it accepts, and a wrong name stops it first."""

import pathlib
import re
import shutil
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "run_pending_gpu.sh"


def _known_and_cases():
    text = SCRIPT.read_text()
    known = set(re.search(r'^KNOWN="([^"]*)"', text, re.M).group(1).split())
    body = text[text.index("run_jobs() {"):]
    cases = set(re.findall(r"^    ([a-z0-9_]+)\)$", body, re.M))
    return known, cases


def test_every_job_is_accepted_and_every_accepted_name_is_a_job():
    known, cases = _known_and_cases()
    assert cases, "no job found in run_jobs"
    assert cases - known == set(), f"jobs the name check refuses: {sorted(cases - known)}"
    assert known - cases == set(), f"accepted names with no job: {sorted(known - cases)}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_an_unknown_job_stops_before_anything_starts(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "planar", "no_such_job"], capture_output=True, text=True,
                          env={"LOG": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=30)
    assert done.returncode == 2
    assert "unknown job no_such_job" in done.stderr
    assert not (tmp_path / "jobs.txt").exists()
