"""Prefix rows on the same cache: immutable full-precision prefix K/V (IntactKV, PrefixQuant) + any body scheme.

Design notes 0x07G/0x07H (IntactKV) and 0x08C (PrefixQuant): a fixed prefix ``p_1..p_P`` is run once by the
full-precision model; its exact per-layer K/V rows become a :class:`PrefixArtifact`.  A request then starts from
those rows and appends its own rows under any (quantized) scheme.  Every row takes part in ONE softmax at its real
position: the prefix is ordinary causal history with a different storage provenance, not a separate correction.

Cache layout (:class:`PrefixScheme` wraps a body scheme)
--------------------------------------------------------
Logical row ``i`` of a sequence is position ``i``; rows ``0..P-1`` are the prefix, rows ``P..`` the body.
* ``KVCache.lengths`` counts prefix rows (a request starts at ``lengths == P``), so ``llama.forward``'s positions
  ``lengths + t`` put user tokens at ``P + t`` with no extra offset argument, and ``KVCache.capacity`` (``C``) counts
  the hidden prefix rows: a cache of capacity ``C`` holds ``C - P`` body rows (``check_room`` sees the real total).
* The layer state is flat: ``prefix_k, prefix_v: [1 or B, Hkv, P, D]`` (full precision, ``prefix_dtype``) plus
  every field of the body scheme's state unchanged, allocated with capacity ``C - P``.  The body scheme works in
  its own row index ``position - P`` with committed length ``lengths - P``, so its frontiers / K groups / residual
  windows are exactly those of a plain body cache holding the same body rows (the prefix does not shift them).
  Flatness keeps ``ops.fork`` / ``reorder`` / ``publish`` / ``validate`` working: a shared prefix (batch axis 1)
  is an ``unbatched_field`` (forks share it), body rings stay ``ring_fields``.
* ``materialize_layer`` returns ``[B, Hkv, P + C_body, D]`` = prefix rows then body rows, row ``i`` = position
  ``i``: the layout every consumer (``llama.attend``, pre-RoPE key rotation) expects.
* Frontier rule: the prefix is never written after :func:`start_request`; a body append writes only body slots
  invisible at the old body length (the body scheme's guarantee), so publication is still one ``lengths`` update.
  An append at ``lengths < P`` (a cache not made by :func:`start_request`) reports ``ok = False``.

Identity and compatibility (0x05E)
----------------------------------
A :class:`PrefixArtifact` carries a :class:`PrefixIdentity` (model sha256, tokenizer hash, prefix token ids, RoPE
theta/pairing, key stage, geometry, layout, compute dtype).  :func:`start_request` refuses an artifact whose
identity differs from the serving model's (:func:`model_identity`) or a body scheme with another RoPE convention /
key stage / bound model, raising :class:`~kvquant_jax.cache.schema.IncompatibleSchemaError` that lists every
differing field.  A started prefix cache reused for another request goes through ``kvquant_jax.cache.reuse.reuse_prefix`` with the
request's :func:`prefix_policy`: the full per-layer :class:`CacheSchema` is compared, and it names the prefix
artifact id, dtype, sharing, the model / tokenizer and the body ABI.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvquant_jax.abi.regions import dense_operand, region
from kvquant_jax.cache import _rows, checks
from kvquant_jax.cache.interface import BATCH, HEADS, CacheScheme, KVCache, init_cache
from kvquant_jax.cache.schema import Compatibility, IncompatibleSchemaError, check_compatible
from kvquant_jax.integrity import CorruptArtifactError, guarded, parse_manifest, sign, verify
from kvquant_jax.quant.dtypes import DTYPE_BYTES, DTYPES

LAYOUT = "prefix_rows/v1"   # k, v: [L, Hkv, P, D]; keys post-RoPE at positions 0..P-1
KINDS = ("intactkv-extracted", "intactkv-calibrated", "prefixquant")
VISIBILITY = ("visible", "hidden")
# identity fields a serving model must match (prefix_token_ids too, when the request names its prefix)
MODEL_FIELDS = ("model_sha256", "tokenizer_hash", "compute_dtype", "num_layers", "num_kv_heads", "head_dim",
                "rope_theta", "rope_pairing", "key_stage", "layout")


# ----------------------------------------------------------------------------------------------------------------
# identity
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PrefixIdentity:
    """What produced the prefix rows and how they are laid out (the compatibility record of an artifact).

    Attributes:
      model_sha256: weights identity (GGUF file sha256, or :func:`params_sha256` of in-memory weights).
      tokenizer_hash: ``Tokenizer.hash`` of the tokenizer that produced ``prefix_token_ids``.
      prefix_token_ids: the prefix (token strings are not identity: 0x08B).
      compute_dtype: dtype the model ran in when the rows were produced.
      num_layers, num_kv_heads, head_dim: geometry of the rows.
      rope_theta, rope_pairing, key_stage: the keys' RoPE convention (post-RoPE at positions ``0..P-1``).
      layout: tensor layout version (:data:`LAYOUT`).
      dtype: stored tensor dtype.
      template_hash: sha256 prefix of the chat template the prefix was cut from ("" when not from a template).
    """

    model_sha256: str
    tokenizer_hash: str
    prefix_token_ids: tuple
    compute_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_pairing: str
    key_stage: str = "post_rope"
    layout: str = LAYOUT
    dtype: str = "fp32"
    template_hash: str = ""

    def __post_init__(self):
        object.__setattr__(self, "prefix_token_ids", tuple(int(t) for t in self.prefix_token_ids))
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        if not self.prefix_token_ids:
            raise ValueError("PrefixIdentity: the prefix has no tokens")
        if not self.model_sha256 or not self.tokenizer_hash:
            raise ValueError("PrefixIdentity: model_sha256 and tokenizer_hash must be set (an unbound prefix cannot "
                             "be checked before reuse)")
        if self.dtype not in DTYPES:
            raise ValueError(f"PrefixIdentity: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["prefix_token_ids"] = list(self.prefix_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PrefixIdentity":
        return cls(**dict(d))


def params_sha256(params) -> str:
    """sha256 over every parameter array (path, dtype, shape, bytes): identity of in-memory weights."""
    h = hashlib.sha256()
    for path, a in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda pa: jax.tree_util.keystr(pa[0])):
        a = np.asarray(jax.device_get(a))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def model_identity(cfg, tokenizer_hash: str, *, compute_dtype: str = "fp32", params=None,
                   prefix_token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """The serving side of the compatibility check: a dict of :data:`MODEL_FIELDS` (plus ``prefix_token_ids`` when
    given) for a model config (``LlamaConfig``-like).  ``cfg.sha256`` names the weights; when it is empty
    ``params`` are hashed instead (raises if neither is available)."""
    sha = getattr(cfg, "sha256", "") or (params_sha256(params) if params is not None else "")
    if not sha:
        raise ValueError("model_identity: the config has no sha256 and no params were given to hash")
    d = dict(model_sha256=sha, tokenizer_hash=tokenizer_hash, compute_dtype=compute_dtype,
             num_layers=int(cfg.num_layers), num_kv_heads=int(cfg.num_kv_heads), head_dim=int(cfg.head_dim),
             rope_theta=float(cfg.rope_theta), rope_pairing=cfg.rope_pairing, key_stage="post_rope", layout=LAYOUT)
    if prefix_token_ids is not None:
        d["prefix_token_ids"] = [int(t) for t in prefix_token_ids]
    return d


# ----------------------------------------------------------------------------------------------------------------
# the artifact
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class PrefixArtifact:
    """Immutable prefix K/V rows plus their identity.

    Attributes:
      k, v: float ``[L, Hkv, P, D]`` NumPy arrays (read-only); keys post-RoPE at positions ``0..P-1``.
      identity: :class:`PrefixIdentity`.
      kind: "intactkv-extracted" (exact full-precision rows), "intactkv-calibrated" (trained rows, 0x07H) or
        "prefixquant" (rows of discovered outlier tokens, 0x08).
      visibility: "visible" (the prefix is part of the user's prompt, e.g. [BOS] + system prompt) or "hidden"
        (inserted method state: the user's prompt comes after it and reported token counts exclude it).
      provenance: JSON-able record (calibration record, discovery statistics); not part of compatibility.
    """

    k: np.ndarray
    v: np.ndarray
    identity: PrefixIdentity
    kind: str = "intactkv-extracted"
    visibility: str = "visible"
    provenance: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"PrefixArtifact: kind must be one of {KINDS}, got {self.kind!r}")
        if self.visibility not in VISIBILITY:
            raise ValueError(f"PrefixArtifact: visibility must be one of {VISIBILITY}, got {self.visibility!r}")
        idn = self.identity
        dt = np.dtype(DTYPES[idn.dtype])
        want = (idn.num_layers, idn.num_kv_heads, len(idn.prefix_token_ids), idn.head_dim)
        arrs = {}
        for name in ("k", "v"):
            a = np.array(jax.device_get(getattr(self, name)), copy=True)
            if a.shape != want:
                raise ValueError(f"PrefixArtifact: {name} has shape {a.shape}, identity says [L, Hkv, P, D] = {want}")
            if a.dtype != dt:
                raise ValueError(f"PrefixArtifact: {name} is {a.dtype}, identity says {idn.dtype}")
            if not np.isfinite(a.astype(np.float32)).all():
                raise ValueError(f"PrefixArtifact: {name} has non-finite values")
            a.setflags(write=False)
            arrs[name] = a
        object.__setattr__(self, "k", arrs["k"])
        object.__setattr__(self, "v", arrs["v"])

    @property
    def prefix_len(self) -> int:
        return len(self.identity.prefix_token_ids)

    @property
    def token_ids(self) -> tuple:
        return self.identity.prefix_token_ids

    @property
    def artifact_id(self) -> str:
        """sha256 (first 16 hex) of identity, kind and the exact tensor bytes."""
        h = hashlib.sha256()
        h.update(json.dumps(self.identity.to_dict(), sort_keys=True).encode())
        h.update(self.kind.encode())
        h.update(self.k.tobytes())
        h.update(self.v.tobytes())
        return h.hexdigest()[:16]

    def same_tensors(self, other: "PrefixArtifact") -> bool:
        """Bitwise equality of the K/V tensors (dtype, shape and bytes)."""
        return all(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
                   for a, b in ((self.k, other.k), (self.v, other.v)))

    def compatibility(self, expect: Mapping[str, Any]) -> Compatibility:
        """Compare against a serving identity (:func:`model_identity`): the :data:`MODEL_FIELDS`, plus
        ``prefix_token_ids`` when ``expect`` names them."""
        fields = MODEL_FIELDS + (("prefix_token_ids",) if "prefix_token_ids" in expect else ())
        mine = self.identity.to_dict()
        return check_compatible({f: mine[f] for f in fields}, {f: expect.get(f, "<absent>") for f in fields})

    def require_compatible(self, expect: Mapping[str, Any], what: str = "prefix artifact") -> None:
        """Raise ``IncompatibleSchemaError`` listing every field that differs from ``expect``."""
        c = self.compatibility(expect)
        if not c.ok:
            raise IncompatibleSchemaError(what, c)

    def replace(self, **kw) -> "PrefixArtifact":
        return dataclasses.replace(self, **kw)


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def save_artifact(artifact: PrefixArtifact, path: str | Path) -> Path:
    """Write ``path/manifest.json`` (identity, kind, visibility, provenance, per-tensor sha256) and the tensors as an
    Orbax checkpoint ``path/tensors``.  ``path`` must not exist yet (artifacts are immutable)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists():
        raise FileExistsError(f"save_artifact: {path} exists (prefix artifacts are immutable; pick a new path)")
    path.mkdir(parents=True)
    ck = ocp.StandardCheckpointer()
    ck.save(path / "tensors", {"k": artifact.k, "v": artifact.v})
    ck.wait_until_finished()
    manifest = {"format": "kvquant_jax.prefix_artifact/v1", "artifact_id": artifact.artifact_id,
                "identity": artifact.identity.to_dict(), "kind": artifact.kind, "visibility": artifact.visibility,
                "provenance": artifact.provenance, "sha256": {"k": _sha(artifact.k), "v": _sha(artifact.v)}}
    (path / "manifest.json").write_text(json.dumps(sign(manifest), indent=1, sort_keys=True))
    return path


def load_artifact(path: str | Path, *, expect: Mapping[str, Any] | None = None) -> PrefixArtifact:
    """Read an artifact written by :func:`save_artifact`; verify the tensor sha256 and the artifact id (so a
    restored artifact is bit-identical to the saved one) and, with ``expect``, compatibility."""
    import orbax.checkpoint as ocp

    what = "prefix artifact"
    path = Path(path).absolute()
    if not (path / "manifest.json").is_file():
        raise ValueError(f"{path}: not a prefix artifact (no manifest.json)")
    man = parse_manifest((path / "manifest.json").read_bytes(), what, path)
    if man.get("format") != "kvquant_jax.prefix_artifact/v1":
        raise ValueError(f"{path}: not a prefix artifact (format {man.get('format')!r})")
    verify(man, what, path)

    def restore():
        t = ocp.StandardCheckpointer().restore(path / "tensors")
        return {n: np.asarray(t[n]) for n in ("k", "v")}

    tensors = guarded(what, path, restore)
    for n, a in tensors.items():
        if _sha(a) != man["sha256"][n]:
            raise CorruptArtifactError(f"{path}: tensor {n} does not match its recorded sha256 (corrupt artifact)")
    art = guarded(what, path, lambda: PrefixArtifact(
        k=tensors["k"], v=tensors["v"], identity=PrefixIdentity.from_dict(man["identity"]), kind=man["kind"],
        visibility=man["visibility"], provenance=man.get("provenance", {})))
    if art.artifact_id != man["artifact_id"]:
        raise ValueError(f"{path}: artifact id {art.artifact_id} != recorded {man['artifact_id']}")
    if expect is not None:
        art.require_compatible(expect, f"prefix artifact {path}")
    return art


# ----------------------------------------------------------------------------------------------------------------
# the wrapper scheme
# ----------------------------------------------------------------------------------------------------------------
_STATE_CLASSES: dict[type, type] = {}


def prefixed_state_class(body_cls: type) -> type:
    """The flat layer-state class ``prefix_k, prefix_v`` + the body state's fields (one class per body class)."""
    if body_cls in _STATE_CLASSES:
        return _STATE_CLASSES[body_cls]
    fields = dataclasses.fields(body_cls)
    names = tuple(f.name for f in fields)
    if {"prefix_k", "prefix_v"} & set(names):
        raise TypeError(f"{body_cls.__name__} already has prefix_k / prefix_v fields")
    if any(not f.metadata.get("pytree_node", True) for f in fields):
        raise TypeError(f"{body_cls.__name__} has static fields; a prefix body state must be all arrays")
    name = f"Prefixed{body_cls.__name__}"
    ann = {"prefix_k": jax.Array, "prefix_v": jax.Array, **{n: jax.Array for n in names}}
    cls = struct.dataclass(type(name, (), {"__annotations__": ann, "__module__": __name__, "__qualname__": name,
                                           "__doc__": f"Prefix rows + the fields of {body_cls.__name__}."}))
    cls.body_class, cls.body_fields = body_cls, names
    _STATE_CLASSES[body_cls] = cls
    return cls


def split_state(state):
    """``(prefix_k, prefix_v, body_state)`` of a prefixed layer state."""
    cls = type(state)
    return state.prefix_k, state.prefix_v, cls.body_class(**{n: getattr(state, n) for n in cls.body_fields})


def join_state(prefix_k, prefix_v, body_state):
    cls = prefixed_state_class(type(body_state))
    return cls(prefix_k=prefix_k, prefix_v=prefix_v,
               **{n: getattr(body_state, n) for n in cls.body_fields})


@dataclasses.dataclass(frozen=True)
class PrefixScheme(CacheScheme):
    """``prefix_len`` immutable full-precision rows followed by rows stored under ``body`` (see module doc).

    Attributes:
      body: the scheme of the request's own rows (any scheme: full, fp8, per_token, kivi, static_int ...).
      prefix_len: P >= 1.
      prefix_dtype: storage of the prefix rows ("fp32", "bf16", "fp16").
      prefix_id: ``PrefixArtifact.artifact_id`` of the rows (part of the schema: other rows, other ABI).
      model_id, tokenizer_hash: identity of the model / tokenizer that produced the prefix rows.
      shared: the prefix arrays have batch axis 1 and are shared by every sequence (fork does not copy them);
        False gives each sequence its own copy ``[B, ...]``.
    """

    family: ClassVar[str] = "prefix"
    #: ``{"name": "prefix", "body": <any scheme spec>, "prefix_len": P, ...}``; the bare name: one fp32 row
    presets: ClassVar[dict] = {"prefix": {"body": "fp32", "prefix_len": 1}}
    aliases: ClassVar[dict] = {"prefix_length": ("prefix_len",)}
    nested_fields: ClassVar[tuple] = ("body",)

    body: CacheScheme
    prefix_len: int
    prefix_dtype: str = "fp32"
    prefix_id: str = ""
    model_id: str = ""
    tokenizer_hash: str = ""
    shared: bool = True

    def __post_init__(self):
        if not isinstance(self.body, CacheScheme) or isinstance(self.body, PrefixScheme):
            raise TypeError("PrefixScheme: body must be a (non-prefix) CacheScheme")
        if not isinstance(self.prefix_len, int) or self.prefix_len < 1:
            raise ValueError(f"PrefixScheme: prefix_len must be a positive int, got {self.prefix_len!r}")
        if self.prefix_dtype not in DTYPES:
            raise ValueError(f"PrefixScheme: prefix_dtype must be one of {sorted(DTYPES)}, got {self.prefix_dtype!r}")

    # identity fields of the body are the cache's
    def __getattr__(self, name):
        if name in ("rope_theta", "rope_pairing", "key_stage", "kernel_family"):
            return getattr(self.body, name)
        raise AttributeError(name)

    @property
    def unbatched_fields(self):  # type: ignore[override]
        return tuple(self.body.unbatched_fields) + (("prefix_k", "prefix_v") if self.shared else ())

    @property
    def ring_fields(self):  # type: ignore[override]
        return tuple(self.body.ring_fields)

    @property
    def rotates_stored_keys(self):  # type: ignore[override]
        return self.body.rotates_stored_keys

    @property
    def schema(self):
        bs = self.body.schema
        extra = dict(bs.extra)
        extra.update(prefix_id=self.prefix_id, prefix_dtype=self.prefix_dtype, prefix_rows="immutable",
                     prefix_positions=f"0..{self.prefix_len - 1}", prefix_sharing="shared" if self.shared else "copy")
        return dataclasses.replace(bs, sink=self.prefix_len, model_id=self.model_id or bs.model_id,
                                   tokenizer_hash=self.tokenizer_hash or bs.tokenizer_hash,
                                   extra=tuple(sorted((k, str(v)) for k, v in extra.items())))

    def body_lengths(self, lengths):
        return jnp.maximum(lengths - self.prefix_len, 0)

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        if capacity <= self.prefix_len:
            raise ValueError(f"PrefixScheme: capacity {capacity} leaves no row after the {self.prefix_len} prefix "
                             "rows (capacity counts the prefix)")
        body = self.body.init_layer(batch, capacity - self.prefix_len, num_kv_heads, head_dim)
        z = jnp.zeros((1 if self.shared else batch, num_kv_heads, self.prefix_len, head_dim),
                      DTYPES[self.prefix_dtype])
        return join_state(z, z, body)

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        pk, pv, body = split_state(state)
        new, ok = self.body.append_layer_with_status(body, self.body_lengths(lengths), k, v, num_new)
        return join_state(pk, pv, new), ok & (lengths >= self.prefix_len)

    def supports_window_append(self) -> bool:
        return self.body.supports_window_append()

    def append_window_with_status(self, state, lengths, k, v, num_new, row0):
        """The body's window append at body lengths and ``row0 - P`` (the window holds body rows only)."""
        pk, pv, body = split_state(state)
        new, ok = self.body.append_window_with_status(body, self.body_lengths(lengths), k, v, num_new,
                                                      row0 - self.prefix_len)
        return join_state(pk, pv, new), ok & (lengths >= self.prefix_len)

    def append_layer(self, state, lengths, k, v, num_new):
        pk, pv, body = split_state(state)
        return join_state(pk, pv, self.body.append_layer(body, self.body_lengths(lengths), k, v, num_new))

    def field_axes(self, state):
        """Prefix rows ``[1 or B, Hkv, P, D]`` (batch axis unsharded when shared) + the body state's own axes."""
        pk, _, body = split_state(state)
        lead = None if self.shared else BATCH
        return {"prefix_k": (lead, HEADS, None, None), "prefix_v": (lead, HEADS, None, None),
                **self.body.field_axes(body)}

    def materialize_layer(self, state, lengths):
        pk, pv, body = split_state(state)
        bk, bv, bvalid = self.body.materialize_layer(body, self.body_lengths(lengths))
        b = lengths.shape[0]
        pvalid = _rows.valid_rows(lengths, self.prefix_len)                       # [B, P]
        m = pvalid[:, None, :, None]
        shape = (b,) + pk.shape[1:]
        pk = jnp.where(m, jnp.broadcast_to(pk.astype(jnp.float32), shape), jnp.float32(0))
        pv = jnp.where(m, jnp.broadcast_to(pv.astype(jnp.float32), shape), jnp.float32(0))
        return (jnp.concatenate([pk, bk], axis=2), jnp.concatenate([pv, bv], axis=2),
                jnp.concatenate([pvalid, bvalid], axis=1))

    def validate_layer(self, state, lengths):
        lh = _rows.host(lengths)
        if (lh < self.prefix_len).any():
            raise ValueError(f"prefix: committed lengths {lh.tolist()} are below the {self.prefix_len} prefix rows "
                             "(a prefix cache starts at lengths == P and is never truncated into its prefix)")
        pk, pv, body = split_state(state)
        full = np.full((pk.shape[0],), self.prefix_len)
        checks.finite_rows("prefix K", pk, full)
        checks.finite_rows("prefix V", pv, full)
        self.body.validate_layer(body, jnp.asarray(lh - self.prefix_len, jnp.int32))

    def layer_nbytes(self, state):
        pk, pv, body = split_state(state)
        out = dict(self.body.layer_nbytes(body))
        out["sink_prefix"] = out.get("sink_prefix", 0) + _rows.nbytes(pk, pv)
        return out

    def decode_regions(self, state, lengths):
        """The body scheme's regions at ``lengths - P`` plus the ``P`` immutable full-precision prefix rows as a
        small dense region (attended in plain JAX, same softmax)."""
        pk, pv, body = split_state(state)
        full = (lengths.shape[0],) + pk.shape[1:]
        sink = region(dense_operand(jnp.broadcast_to(pk, full)), dense_operand(jnp.broadcast_to(pv, full)),
                      jnp.minimum(lengths, self.prefix_len))
        body_regions, tail_rows = self.body.decode_regions(body, self.body_lengths(lengths))
        return body_regions + [sink], max(tail_rows, self.prefix_len)

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        """The body's bytes for its own ``C - P`` rows (at ``T - P`` for the logical view) plus the prefix rows."""
        p = self.prefix_len
        body_rows = max(rows - p, 0) if logical else capacity - p
        out = dict(self.body.ledger_layer(batch, heads, head_dim, body_rows, logical=logical, capacity=capacity - p))
        n = (1 if self.shared else batch) * heads * p * head_dim * DTYPE_BYTES[self.prefix_dtype]
        for t in "kv":
            out[("sink_prefix", t)] = out.get(("sink_prefix", t), 0) + n
        return out

    def sealed_rows(self, lengths):
        p = self.prefix_len
        body = np.maximum(np.asarray(lengths, np.int64) - p, 0)
        return np.asarray(self.body.sealed_rows(body), np.int64) + p

    def rebuild_start(self, old_lengths, new_lengths):
        old, new = np.asarray(old_lengths, np.int64), np.asarray(new_lengths, np.int64)
        if (new < self.prefix_len).any():
            raise ValueError(f"prefix: cannot truncate below the {self.prefix_len} immutable prefix rows "
                             f"(new lengths {new.tolist()}); start a new request instead")
        p = self.prefix_len
        return np.asarray(self.body.rebuild_start(old - p, new - p), np.int64) + p

    def restore_rows_layer(self, state, new_lengths, k, v, start):
        pk, pv, body = split_state(state)
        p = self.prefix_len
        return join_state(pk, pv, self.body.restore_rows_layer(body, new_lengths - p, k, v, start - p))

    def config(self) -> dict[str, Any]:
        return {"family": self.family, "body": self.body.config(), "prefix_len": self.prefix_len,
                "prefix_dtype": self.prefix_dtype, "prefix_id": self.prefix_id, "model_id": self.model_id,
                "tokenizer_hash": self.tokenizer_hash, "shared": self.shared}


# ----------------------------------------------------------------------------------------------------------------
# requests
# ----------------------------------------------------------------------------------------------------------------
def _body_policy(body, num_layers: int) -> tuple:
    per = (body,) * num_layers if isinstance(body, CacheScheme) else tuple(body)
    if len(per) != num_layers:
        raise ValueError(f"prefix: body policy lists {len(per)} schemes for {num_layers} layers")
    return per


def check_body(body: CacheScheme, identity: PrefixIdentity) -> Compatibility:
    """The body scheme must read keys with the prefix's RoPE convention and stage, and (where it is bound to one)
    the same model and tokenizer."""
    mine = {"rope_theta": identity.rope_theta, "rope_pairing": identity.rope_pairing,
            "key_stage": identity.key_stage}
    theirs = {f: getattr(body, f, "<absent>") for f in mine}
    if isinstance(theirs["rope_theta"], (int, float)):
        theirs["rope_theta"] = float(theirs["rope_theta"])
    for f, have in (("model_id", identity.model_sha256), ("tokenizer_hash", identity.tokenizer_hash)):
        if getattr(body, f, ""):
            mine[f], theirs[f] = have, getattr(body, f)
    return check_compatible(mine, theirs)


def prefix_policy(artifact: PrefixArtifact, body, *, prefix_dtype: str | None = None,
                  shared: bool = True) -> tuple[PrefixScheme, ...]:
    """Per-layer :class:`PrefixScheme` policy for ``artifact`` over ``body`` (one scheme or a per-layer tuple);
    refuses a body whose RoPE convention / key stage / bound model differs from the artifact's."""
    idn = artifact.identity
    out = []
    for i, b in enumerate(_body_policy(body, idn.num_layers)):
        c = check_body(b, idn)
        if not c.ok:
            raise IncompatibleSchemaError(f"prefix body scheme (layer {i})", c)
        out.append(PrefixScheme(b, artifact.prefix_len, prefix_dtype or idn.dtype, artifact.artifact_id,
                                model_id=idn.model_sha256, tokenizer_hash=idn.tokenizer_hash, shared=shared))
    return tuple(out)


def start_request(artifact: PrefixArtifact, body, batch: int, capacity: int, *, expect: Mapping[str, Any],
                  prefix_dtype: str | None = None, shared: bool = True) -> KVCache:
    """A cache whose ``batch`` sequences start with the artifact's prefix rows committed (``lengths == P``).

    Args:
      body: body scheme (or per-layer tuple) for the request's own rows.
      capacity: TOTAL rows per sequence, hidden/visible prefix rows included (``capacity - P`` body rows).
      expect: the serving model's identity (:func:`model_identity`); checked before anything is built.
      prefix_dtype: storage of the prefix rows (default: the artifact's dtype).
    Raises ``IncompatibleSchemaError`` (listing every differing field) for another model / tokenizer / RoPE /
    geometry / layout, or a body scheme that does not fit the prefix; ``ValueError`` for ``capacity <= P``.
    """
    artifact.require_compatible(expect, "prefix artifact")
    idn = artifact.identity
    if capacity <= artifact.prefix_len:
        raise ValueError(f"start_request: capacity {capacity} must exceed the {artifact.prefix_len} prefix rows "
                         "(capacity counts hidden prefix rows)")
    policy = prefix_policy(artifact, body, prefix_dtype=prefix_dtype, shared=shared)
    cache = init_cache(policy, num_layers=idn.num_layers, batch=batch, capacity=capacity,
                       num_kv_heads=idn.num_kv_heads, head_dim=idn.head_dim)
    groups = []
    for (scheme, first, n), st in zip(cache.schemes, cache.groups):
        dt = DTYPES[scheme.prefix_dtype]
        pb = st.prefix_k.shape[1]

        def rows(a, first=first, n=n, pb=pb, dt=dt):
            x = jnp.asarray(a[first:first + n][:, None], dt)
            return jnp.broadcast_to(x, (n, pb) + x.shape[2:]) if pb != 1 else x

        groups.append(st.replace(prefix_k=rows(artifact.k), prefix_v=rows(artifact.v)))
    return cache.replace(groups=tuple(groups), lengths=jnp.full((batch,), artifact.prefix_len, jnp.int32))


def prefix_rows(cache: KVCache) -> int:
    """Rows of ``cache`` that are prefix (0 for a plain cache): part of ``capacity`` and of ``lengths``."""
    ps = {getattr(s, "prefix_len", 0) for s in cache.per_layer_schemes}
    if len(ps) != 1:
        raise ValueError(f"prefix_rows: layers disagree on the prefix length {sorted(ps)}")
    return ps.pop()
