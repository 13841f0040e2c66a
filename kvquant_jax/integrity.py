"""Artifact integrity: a sha256 over the whole manifest, and clear "corrupt artifact" errors.

Every artifact kind (KVQuant calibrations and W8A8 weights through :mod:`kvquant_jax.artifact`, IntactKV /
PrefixQuant prefix artifacts, FP8 scale ``.npz`` files, cache blobs and cache checkpoints) records
``manifest_sha256`` (cache blobs: ``sha256``, which also covers the array bytes): the sha256 of the canonical JSON
(sorted keys, no whitespace, ASCII) of every manifest field except the hash itself.  Loading recomputes it before
any field is used, so an edit of ANY metadata field -- schema, RoPE convention, model identity, provenance --
is refused, and the array bytes are checked against the per-array sha256 the manifest records.  A manifest or an
Orbax metadata file that does not decode, parse or restore raises :class:`CorruptArtifactError` naming the artifact
(never a bare ``UnicodeDecodeError`` / ``JSONDecodeError`` from deep inside a library).

This is an integrity check (accidental damage, a hand edit, mixing files of two artifacts), not an authenticity
check: anyone who can write the directory can also recompute the hash.  Trust in an artifact is trust in whoever
produced the directory.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

MANIFEST_HASH = "manifest_sha256"


class CorruptArtifactError(ValueError):
    """An artifact whose bytes do not match its recorded hashes, or whose files do not decode."""


def canonical_json(manifest: dict) -> bytes:
    """The canonical JSON bytes of ``manifest`` without its ``manifest_sha256`` field."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_HASH}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def manifest_digest(manifest: dict) -> str:
    return hashlib.sha256(canonical_json(manifest)).hexdigest()


def sign(manifest: dict) -> dict:
    """A copy of ``manifest`` (normalized through JSON, as it will be read back) with ``manifest_sha256`` set."""
    man = json.loads(json.dumps({k: v for k, v in manifest.items() if k != MANIFEST_HASH}))
    man[MANIFEST_HASH] = manifest_digest(man)
    return man


def verify(manifest: dict, what: str, where) -> dict:
    """Raise :class:`CorruptArtifactError` unless ``manifest`` carries a matching ``manifest_sha256``."""
    got = manifest.get(MANIFEST_HASH)
    if not isinstance(got, str):
        raise CorruptArtifactError(f"{what}: {where}: corrupt artifact: the manifest has no {MANIFEST_HASH} "
                                   "(unsigned or damaged; re-create the artifact with this version)")
    want = manifest_digest(manifest)
    if got != want:
        raise CorruptArtifactError(f"{what}: {where}: corrupt artifact: the manifest does not match its "
                                   f"{MANIFEST_HASH} (recorded {got[:16]}…, content hashes to {want[:16]}…): a "
                                   "metadata field was edited or damaged")
    return manifest


def parse_manifest(data: bytes | str, what: str, where) -> dict:
    """A JSON object from manifest bytes; any decode / parse problem is a :class:`CorruptArtifactError`."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        man = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CorruptArtifactError(f"{what}: {where}: corrupt artifact: the manifest is not valid UTF-8 JSON "
                                   f"({type(e).__name__}: {e})") from None
    if not isinstance(man, dict):
        raise CorruptArtifactError(f"{what}: {where}: corrupt artifact: the manifest is a {type(man).__name__}, "
                                   "not a JSON object")
    return man


def read_manifest(path, what: str) -> dict:
    """Read, parse and verify ``path`` (a ``manifest.json``)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CorruptArtifactError(f"{what}: {path}: cannot read the manifest ({e})") from None
    return verify(parse_manifest(data, what, path.parent), what, path.parent)


def guarded(what: str, where, fn: Callable[[], Any]) -> Any:
    """Run an Orbax restore (or any reader of artifact files): a failure of the library on damaged files becomes
    a :class:`CorruptArtifactError` naming the artifact."""
    try:
        return fn()
    except CorruptArtifactError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to decode an artifact's files means a damaged artifact
        raise CorruptArtifactError(f"{what}: {where}: corrupt artifact: its stored files could not be read "
                                   f"({type(e).__name__}: {str(e)[:300]})") from None


def array_sha256(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def check_arrays(arrays: dict, recorded: dict, what: str, where) -> None:
    """Every array's sha256 (and the set of names) must equal ``recorded`` (``{name: sha256}``)."""
    if set(arrays) != set(recorded):
        raise CorruptArtifactError(f"{what}: {where}: corrupt artifact: arrays {sorted(arrays)} but the manifest "
                                   f"records {sorted(recorded)}")
    bad = [n for n in sorted(arrays) if array_sha256(arrays[n]) != recorded[n]]
    if bad:
        raise CorruptArtifactError(f"{what}: {where}: corrupt artifact: arrays {bad} do not match their recorded "
                                   "sha256")
