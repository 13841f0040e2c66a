"""Immutable on-disk artifacts: ``DIR/arrays`` (an Orbax checkpoint of a flat ``{name: array}`` dict) plus
``DIR/manifest.json`` (a ``format`` tag, ``arrays: {name: {shape, dtype}}`` and whatever identity the writer adds).

Used by the KVQuant calibration artifacts (``kvquant_jax.calibration.kvquant``) and the W8A8 weights
(``kvquant_jax.models.w8a8``); restore goes through an abstract target built from the manifest, so a checkpoint
whose arrays do not match the manifest fails in Orbax instead of loading silently.

Integrity (:mod:`kvquant_jax.integrity`): the manifest records ``array_sha256`` (every array's bytes) and
``manifest_sha256`` (the canonical JSON of every other field); :func:`read_artifact` verifies both, and a manifest
or Orbax file that does not decode raises ``CorruptArtifactError`` ("corrupt artifact").
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from kvquant_jax.integrity import CorruptArtifactError, array_sha256, check_arrays, guarded, parse_manifest, sign, \
    verify


def array_specs(arrays: dict) -> dict:
    """``{name: {"shape": [...], "dtype": "..."}}`` of a flat dict of arrays (the manifest's ``arrays`` entry)."""
    return {k: {"shape": list(np.shape(a)), "dtype": np.asarray(a).dtype.name} for k, a in arrays.items()}


def write_artifact(path, arrays: dict, manifest: dict, what: str) -> Path:
    """Write ``path/arrays`` + ``path/manifest.json``; ``path`` must not exist (artifacts are immutable)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists():
        raise FileExistsError(f"{what}: {path} exists (artifacts are immutable; pick a new path)")
    path.mkdir(parents=True)
    ck = ocp.StandardCheckpointer()
    ck.save(path / "arrays", {n: np.asarray(a) for n, a in arrays.items()})
    ck.wait_until_finished()
    man = sign({**manifest, "array_sha256": {n: array_sha256(np.asarray(a)) for n, a in arrays.items()}})
    (path / "manifest.json").write_text(json.dumps(man, indent=1, sort_keys=True))
    return path


def read_artifact(path, fmt: str, what: str) -> tuple[dict, dict[str, np.ndarray]]:
    """``(manifest, {name: np.ndarray})`` of an artifact of format ``fmt``. Raises ``ValueError`` naming the
    problem for a folder without a manifest or with another format."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    mf = path / "manifest.json"
    if not mf.is_file():
        raise ValueError(f"{what}: {path} has no manifest.json (not a {what} artifact)")
    man = parse_manifest(mf.read_bytes(), what, path)
    if man.get("format") != fmt:
        raise ValueError(f"{what}: {path} has format {man.get('format')!r}, expected {fmt!r}")
    verify(man, what, path)
    specs, shas = man.get("arrays"), man.get("array_sha256")
    if not isinstance(specs, dict) or not isinstance(shas, dict):
        raise CorruptArtifactError(f"{what}: {path}: corrupt artifact: the manifest lacks arrays / array_sha256")

    def restore():
        target = {n: jax.ShapeDtypeStruct(tuple(s["shape"]), np.dtype(s["dtype"])) for n, s in specs.items()}
        got = ocp.StandardCheckpointer().restore(path / "arrays", target)
        return {n: np.asarray(got[n]) for n in specs}

    arrays = guarded(what, path, restore)
    check_arrays(arrays, shas, what, path)
    return man, arrays
