"""Save / restore a :class:`KVCache`: an Orbax checkpoint, or a single self-checking byte blob for transfer.

Both carry a JSON manifest: format version, static shape (layers, batch, capacity, Hkv, D), every layer run's
scheme config AND schema (the ABI), the flat list of array shapes/dtypes, and a sha256 over the manifest and the
raw array bytes.  Restoring rebuilds the schemes from their configs, checks each rebuilt schema equals the stored
one (a code/ABI drift is refused), builds the abstract target from the schema (``jax.eval_shape(init_cache)``),
restores into it, and verifies the checksum.  ``expect=`` (a scheme, a per-layer scheme tuple, or a cache) makes
the restore refuse a cache whose per-layer schemas differ, naming every differing field (``check_compatible``).
The manifest also carries ``manifest_sha256`` (its own fields), verified before any field is used; a manifest or
Orbax metadata file that does not decode or restore raises :class:`CacheIntegrityError` ("corrupt artifact").
Round trips are bit-exact (raw bytes, including FP8 codes and NaN payloads of invisible slots).
"""
from __future__ import annotations

import hashlib
import json
import struct as _struct
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache.interface import CacheScheme, KVCache, init_cache
from kvquant_jax.cache.registry import scheme_from_config
from kvquant_jax.cache.schema import CacheSchema, Compatibility, IncompatibleSchemaError, check_compatible
from kvquant_jax.integrity import MANIFEST_HASH, CorruptArtifactError, manifest_digest

FORMAT = "kvquant_jax.kvcache"
VERSION = 1
MAGIC = b"KVQCACHE"


class CacheIntegrityError(CorruptArtifactError):
    """A blob or checkpoint whose bytes do not match its checksum, or whose manifest is malformed (a
    :class:`~kvquant_jax.integrity.CorruptArtifactError`, hence a ``ValueError``)."""


def _sign(man: dict[str, Any]) -> dict[str, Any]:
    """Add ``manifest_sha256`` (the manifest alone, checked before any field is used; ``sha256`` below also covers
    the array bytes)."""
    man = dict(man)
    man[MANIFEST_HASH] = manifest_digest({k: v for k, v in man.items() if k != "sha256"})
    return man


def _check_manifest(man: Any, what: str) -> dict[str, Any]:
    if not isinstance(man, dict):
        raise CacheIntegrityError(f"{what}: corrupt artifact: the manifest is not a JSON object")
    if MANIFEST_HASH in man and man[MANIFEST_HASH] != manifest_digest(
            {k: v for k, v in man.items() if k != "sha256"}):
        raise CacheIntegrityError(f"{what}: corrupt artifact: the manifest does not match its {MANIFEST_HASH} "
                                  "(a metadata field was edited or damaged)")
    return man


def _guard(what: str, fn):
    """Library failures on damaged files / malformed manifest fields become a clear CacheIntegrityError."""
    try:
        return fn()
    except (CacheIntegrityError, IncompatibleSchemaError):
        raise
    except Exception as e:  # noqa: BLE001 - any failure to decode a cache artifact means a damaged artifact
        raise CacheIntegrityError(f"{what}: corrupt artifact: its stored files could not be read "
                                  f"({type(e).__name__}: {str(e)[:300]})") from None


def _leaves(cache: KVCache) -> list[np.ndarray]:
    return [np.asarray(jax.device_get(a)) for a in jax.tree.leaves((cache.groups, cache.lengths))]


def _digest(manifest: dict[str, Any], leaves) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in manifest.items() if k != "sha256"}, sort_keys=True).encode())
    for a in leaves:
        h.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes())
    return h.hexdigest()


def manifest(cache: KVCache) -> dict[str, Any]:
    """The JSON manifest of ``cache`` (without the checksum)."""
    return {
        "format": FORMAT, "version": VERSION,
        "num_layers": cache.num_layers, "batch": cache.batch, "capacity": cache.capacity,
        "num_kv_heads": cache.num_kv_heads, "head_dim": cache.head_dim,
        "runs": [{"first": first, "num_layers": n, "config": s.config(), "schema": s.schema.to_dict()}
                 for s, first, n in cache.schemes],
        "arrays": [{"shape": list(a.shape), "dtype": np.dtype(a.dtype).name}
                   for a in jax.tree.leaves((cache.groups, cache.lengths))],
    }


def _per_layer_expect(expect, num_layers: int) -> tuple | None:
    if expect is None:
        return None
    if isinstance(expect, KVCache):
        return expect.schemas
    if isinstance(expect, (CacheScheme, CacheSchema)):
        return (expect,) * num_layers
    return tuple(expect)


def _check_expect(schemas: list[CacheSchema], expect, what: str) -> None:
    want = _per_layer_expect(expect, len(schemas))
    if want is None:
        return
    if len(want) != len(schemas):
        raise IncompatibleSchemaError(what, Compatibility((("num_layers", len(schemas), len(want)),)))
    diffs = []
    for i, (got, exp) in enumerate(zip(schemas, want)):
        diffs += [(f"layer{i}.{f}", a, b) for f, a, b in check_compatible(got, exp).differences]
    if diffs:
        raise IncompatibleSchemaError(what, Compatibility(tuple(diffs)))


def _abstract(man: dict[str, Any], what: str):
    """Schemes and the abstract cache rebuilt from a manifest (schema-checked)."""
    if man.get("format") != FORMAT or man.get("version") != VERSION:
        raise CacheIntegrityError(f"{what}: not a {FORMAT} v{VERSION} manifest "
                                  f"(format={man.get('format')!r}, version={man.get('version')!r})")
    per_layer: list[CacheScheme] = []
    for run in man["runs"]:
        scheme = scheme_from_config(run["config"])
        stored = CacheSchema.from_dict(run["schema"])
        diff = check_compatible(scheme.schema, stored)
        if not diff.ok:
            raise IncompatibleSchemaError(f"{what}: stored schema of layers {run['first']}.."
                                          f"{run['first'] + run['num_layers'] - 1} differs from its scheme", diff)
        per_layer += [scheme] * run["num_layers"]
    abstract = jax.eval_shape(lambda: init_cache(tuple(per_layer), num_layers=man["num_layers"],
                                                 batch=man["batch"], capacity=man["capacity"],
                                                 num_kv_heads=man["num_kv_heads"], head_dim=man["head_dim"]))
    specs = jax.tree.leaves((abstract.groups, abstract.lengths))
    if [{"shape": list(a.shape), "dtype": np.dtype(a.dtype).name} for a in specs] != man["arrays"]:
        raise CacheIntegrityError(f"{what}: the stored arrays do not match the layout of the stored schemas")
    return per_layer, abstract, specs


def _assemble(abstract: KVCache, arrays) -> KVCache:
    treedef = jax.tree.structure((abstract.groups, abstract.lengths))
    groups, lengths = jax.tree.unflatten(treedef, [jnp.asarray(a) for a in arrays])
    return abstract.replace(groups=groups, lengths=lengths)


# ----------------------------------------------------------------------------------------------------------------
# single byte blob
# ----------------------------------------------------------------------------------------------------------------
def to_bytes(cache: KVCache) -> bytes:
    """``MAGIC | u64 manifest length | manifest JSON (utf-8, with sha256) | raw array bytes in tree order``."""
    man = _sign(manifest(cache))
    leaves = _leaves(cache)
    man["sha256"] = _digest(man, leaves)
    head = json.dumps(man, sort_keys=True).encode()
    payload = b"".join(np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes() for a in leaves)
    return MAGIC + _struct.pack("<Q", len(head)) + head + payload


def from_bytes(blob: bytes, *, expect=None) -> KVCache:
    """Inverse of :func:`to_bytes`.  Raises :class:`CacheIntegrityError` (bad magic, truncated blob, checksum) or
    :class:`IncompatibleSchemaError` (schema differs from its scheme, or from ``expect``)."""
    what = "cache blob"
    if len(blob) < len(MAGIC) + 8 or blob[:len(MAGIC)] != MAGIC:
        raise CacheIntegrityError(f"{what}: bad magic (not a kvquant_jax cache blob)")
    (n,) = _struct.unpack("<Q", blob[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    try:
        man = json.loads(blob[start:start + n].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheIntegrityError(f"{what}: corrupt manifest ({e})") from None
    man = _check_manifest(man, what)
    per_layer, abstract, specs = _guard(what, lambda: _abstract(man, what))
    _check_expect([s.schema for s in per_layer], expect, what)
    arrays, off = [], start + n
    for spec in specs:
        size = int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize
        chunk = blob[off:off + size]
        if len(chunk) != size:
            raise CacheIntegrityError(f"{what}: truncated payload")
        arrays.append(np.frombuffer(chunk, dtype=spec.dtype).reshape(spec.shape))
        off += size
    if off != len(blob):
        raise CacheIntegrityError(f"{what}: {len(blob) - off} trailing bytes")
    if _digest(man, arrays) != man.get("sha256"):
        raise CacheIntegrityError(f"{what}: sha256 mismatch (corrupted or tampered)")
    return _assemble(abstract, arrays)


# ----------------------------------------------------------------------------------------------------------------
# Orbax checkpoint
# ----------------------------------------------------------------------------------------------------------------
def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save(path, cache: KVCache) -> None:
    """Orbax checkpoint at ``path`` (a new directory): item ``state`` (the arrays, keyed by tree order; zero-size
    arrays, which Orbax cannot store, are rebuilt from the layout) and item ``manifest`` (JSON)."""
    ocp, ck = _checkpointer()
    man = _sign(manifest(cache))
    leaves = _leaves(cache)
    man["sha256"] = _digest(man, leaves)
    state = {f"a{i:04d}": jnp.asarray(a) for i, a in enumerate(leaves) if a.size}
    ck.save(str(path), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                manifest=ocp.args.JsonSave(man)))


def restore(path, *, expect=None) -> KVCache:
    """Restore a checkpoint written by :func:`save` into an abstract target built from its stored schemas.
    Raises like :func:`from_bytes`."""
    ocp, ck = _checkpointer()
    what = f"cache checkpoint {path}"
    man = _guard(what, lambda: ck.restore(str(path), args=ocp.args.Composite(
        manifest=ocp.args.JsonRestore()))["manifest"])
    man = _check_manifest(man, what)
    per_layer, abstract, specs = _guard(what, lambda: _abstract(man, what))
    _check_expect([s.schema for s in per_layer], expect, what)
    target = {f"a{i:04d}": jax.ShapeDtypeStruct(s.shape, s.dtype) for i, s in enumerate(specs)
              if int(np.prod(s.shape, dtype=np.int64))}
    got = _guard(what, lambda: ck.restore(str(path), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))["state"])
    arrays = [np.asarray(got[f"a{i:04d}"]) if f"a{i:04d}" in target else np.zeros(s.shape, s.dtype)
              for i, s in enumerate(specs)]
    if _digest(man, arrays) != man.get("sha256"):
        raise CacheIntegrityError(f"{what}: sha256 mismatch (corrupted or tampered)")
    return _assemble(abstract, arrays)
