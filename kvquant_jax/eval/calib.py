"""FP8 scale artifacts for the evaluation: load a ``.npz`` or observe per-layer K/V absmax on calibration text.

Artifact (``.npz``): ``k_amax, v_amax: float32 [L, Hkv]`` (observed ranges; the scale of each FP8 layer is then
``amax / fp8_max(format)``, reduced over heads for per-tensor scales) or ``k_scale, v_scale: [L]`` / ``[L, Hkv]``
(scales used as given), plus ``calibration_id`` (a string; default: the file's sha256).  ``observe`` runs the
full-precision model over calibration tokens (``data.calibration_*``, never the evaluation split), records
``max |K|`` and ``max |V|`` per layer and KV head (post-RoPE keys, as stored), and names the result
``observed:<corpus sha256[:12]>:<tokens>:<sha256 of the values[:12]>``.

Integrity: files written by :func:`save_fp8_artifact` carry a signed ``manifest`` (``manifest_sha256`` over its
canonical JSON, per-array sha256, the id); an unsigned ``observed:`` file must hash to its id's suffix; any other
unsigned file (hand-made scales) is identified by its own bytes.  Damage raises ``CorruptArtifactError``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache.fp8 import FP8Scheme
from kvquant_jax.eval.errors import exact_qkv
from kvquant_jax.eval.policy import Fp8Scales
from kvquant_jax.quant.fp8 import fp8_scale_from_absmax
from kvquant_jax.integrity import CorruptArtifactError, array_sha256, check_arrays, guarded, parse_manifest, sign, \
    verify

FP8_FORMAT = "kvquant_jax.fp8_scales/v1"


@dataclasses.dataclass(frozen=True, eq=False)
class Fp8Calibration:
    """Observed ranges (``k_amax``/``v_amax`` ``[L, Hkv]``) or given scales (``k_scale``/``v_scale``)."""

    calibration_id: str
    source: str
    k_amax: np.ndarray | None = None
    v_amax: np.ndarray | None = None
    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None

    def scales_for(self, schemes, num_kv_heads: int):
        """Per-layer scales ``[L, Hkv]`` for the FP8 layers of ``schemes`` (other layers: 1.0)."""
        n = len(schemes)
        out = {}
        for name in ("k", "v"):
            given = getattr(self, f"{name}_scale")
            amax = getattr(self, f"{name}_amax")
            arr = np.ones((n, num_kv_heads), np.float32)
            for i, s in enumerate(schemes):
                if not isinstance(s, FP8Scheme):
                    continue
                if given is not None:
                    row = np.asarray(given[i], np.float32).reshape(-1)
                else:
                    a = np.asarray(amax[i], np.float32).reshape(-1)
                    if s.scale_axis == "tensor":
                        a = a.max(keepdims=True)
                    row = np.asarray(fp8_scale_from_absmax(jnp.asarray(a), s.fmt, "calibrated").value)
                arr[i] = np.broadcast_to(row, (num_kv_heads,))
            out[name] = arr
        return Fp8Scales(k=out["k"], v=out["v"], calibration_id=self.calibration_id, source=self.source)


def load_fp8_artifact(path: str | Path, num_layers: int) -> Fp8Calibration:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"FP8 scale artifact not found: {path}")

    def read():
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

    d = guarded("FP8 scale artifact", path, read)
    cal_id = _verified_id(d, path)
    if {"k_amax", "v_amax"} <= set(d):
        kw = {"k_amax": d["k_amax"], "v_amax": d["v_amax"]}
    elif {"k_scale", "v_scale"} <= set(d):
        kw = {"k_scale": d["k_scale"], "v_scale": d["v_scale"]}
    else:
        raise ValueError(f"{path}: an FP8 scale artifact needs k_amax/v_amax or k_scale/v_scale, has {sorted(d)}")
    for k, v in kw.items():
        if v.shape[0] != num_layers:
            raise ValueError(f"{path}: {k} has {v.shape[0]} layers, the model has {num_layers}")
        if not np.isfinite(v).all() or (v < 0).any():
            raise ValueError(f"{path}: {k} must be finite and non-negative")
    return Fp8Calibration(calibration_id=cal_id, source=str(path), **kw)


def observe_fp8(params, cfg, ids: np.ndarray, tokens: int, corpus_sha256: str, seq_len: int = 512) -> Fp8Calibration:
    """Per-layer, per-KV-head absmax of exact K/V over the first ``tokens`` calibration tokens."""
    seq_len = min(seq_len, tokens)
    n = tokens // seq_len
    if n < 1 or len(ids) < n * seq_len:
        raise ValueError(f"FP8 observation needs {tokens} calibration tokens, the corpus has {len(ids)}")
    segs = np.asarray(ids[: n * seq_len], np.int32).reshape(n, seq_len)
    k_amax = np.zeros((cfg.num_layers, cfg.num_kv_heads), np.float32)
    v_amax = np.zeros_like(k_amax)
    for s in segs:
        _, k, v = exact_qkv(params, cfg, jnp.asarray(s[None]))
        k_amax = np.maximum(k_amax, np.asarray(jnp.max(jnp.abs(k), axis=(1, 2, 4))))
        v_amax = np.maximum(v_amax, np.asarray(jnp.max(jnp.abs(v), axis=(1, 2, 4))))
    digest = hashlib.sha256(k_amax.tobytes() + v_amax.tobytes()).hexdigest()[:12]
    return Fp8Calibration(calibration_id=f"observed:{corpus_sha256[:12]}:{n * seq_len}:{digest}",
                          source=f"observed on {n * seq_len} calibration tokens", k_amax=k_amax, v_amax=v_amax)


def _verified_id(d: dict, path: Path) -> str:
    """The calibration id of a loaded ``.npz`` (``d`` loses its non-array entries), after its integrity check:
    a signed file's ``manifest`` (sha256 over its canonical JSON, per-array sha256, the id); an unsigned
    ``observed:`` file's id must end with the sha256 prefix of its amax values; any other unsigned file is named by
    its bytes (``<id>@sha256:<file sha256[:16]>``, or ``sha256:...`` without an id)."""
    what = "FP8 scale artifact"
    given = str(d.pop("calibration_id")) if "calibration_id" in d else None
    if "manifest" in d:
        man = verify(parse_manifest(str(d.pop("manifest")), what, path), what, path)
        if man.get("format") != FP8_FORMAT or man.get("calibration_id") != given:
            raise CorruptArtifactError(f"{what}: {path}: corrupt artifact: the manifest's format / calibration_id "
                                       "do not match the file")
        check_arrays(d, man.get("array_sha256", {}), what, path)
        return given
    if given is not None and given.startswith("observed:") and {"k_amax", "v_amax"} <= set(d):
        digest = hashlib.sha256(np.asarray(d["k_amax"], np.float32).tobytes()
                                + np.asarray(d["v_amax"], np.float32).tobytes()).hexdigest()[:12]
        if given.split(":")[-1] != digest:
            raise CorruptArtifactError(f"{what}: {path}: corrupt artifact: calibration_id {given!r} names values "
                                       f"with sha256 {given.split(':')[-1]}, the stored values hash to {digest}")
        return given
    file_id = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return file_id if given is None else f"{given}@{file_id}"


def save_fp8_artifact(cal: Fp8Calibration, path: str | Path) -> None:
    """``.npz`` of the arrays, ``calibration_id`` and a signed ``manifest`` (JSON string; see ``_verified_id``)."""
    arrays = {k: np.asarray(getattr(cal, k)) for k in ("k_amax", "v_amax", "k_scale", "v_scale")
              if getattr(cal, k) is not None}
    man = sign({"format": FP8_FORMAT, "calibration_id": cal.calibration_id, "source": cal.source,
                "array_sha256": {k: array_sha256(a) for k, a in arrays.items()}})
    np.savez(path, calibration_id=np.asarray(cal.calibration_id), manifest=np.asarray(json.dumps(man)), **arrays)
