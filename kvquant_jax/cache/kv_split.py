"""K and V stored in two different formats: ``KVSplitScheme(k=<scheme>, v=<scheme>)`` (registry ``kv``).

A layer's keys are stored exactly as the scheme ``k`` stores its keys, its values exactly as the scheme ``v``
stores its values (``{name: kv, k: int4, v: kivi2}``, inline ``"kv:k=int8,v=kivi2"``; each side is any spec of a
component family whose state fields split into K fields and V fields, see :func:`tensor_of`).  Nothing else
changes: both halves keep their own qparams, residual rings and frontiers (functions of ``lengths``).

Layer state (flat): the K fields of ``k``'s state (``k``, ``k_codes``, ``k_scale``, ...), the V fields of
``v``'s state (``v``, ``v_codes``, ...) and ``geometry: uint8 [B, Hkv, C, D, 0]`` (zero bytes: it only carries the
static capacity and head_dim from which the half a component needs but the composed state does not store is
rebuilt).  A component function is called on its own full state in which the other tensor's fields are a fresh
``init_layer`` allocation (dead inside ``jit``: XLA removes it) and with the other tensor's rows replaced by this
tensor's rows (``k`` appends ``(k, k)``, ``v`` appends ``(v, v)``), so each half's status (finite and encodable)
concerns its own tensor only.

Schema: ``scheme="kv"``, ``key`` = ``k``'s key format, ``value`` = ``v``'s value format, the identity fields
(RoPE, key stage, model, tokenizer, kernel family: both components must agree) and both components' full schemas
in ``extra`` (``k_schema``, ``v_schema``), so reuse between caches whose components differ in ANY field is refused
by ``check_compatible``.  Decode: when both components read in place as one region each, the region pairs ``k``'s
K operand with ``v``'s V operand (the Pallas region kernel reads each operand in its own format: tested against the
float64 oracle; a kernel that cannot take a format says why through ``kernel_unsupported``); otherwise the
materialized view (one dense region, the float reference's input).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvquant_jax.abi.regions import region
from kvquant_jax.cache.interface import BATCH, HEADS, CacheScheme
from kvquant_jax.cache.schema import CacheSchema

GEOMETRY = "geometry"
#: identity fields both components must agree on (the composed schema records one value)
_SHARED_IDENTITY = ("rope_theta", "rope_pairing", "model_id", "tokenizer_hash", "kernel_family")


def tensor_of(field: str) -> str:
    """"k" or "v": which tensor a component state field belongs to (``k``/``k_*`` and ``v``/``v_*``); raises
    ``TypeError`` for a field of neither (e.g. KVQuant's shared ``pos``), which ``kv`` cannot split."""
    for t in ("k", "v"):
        if field == t or field.startswith(t + "_"):
            return t
    raise TypeError(f"kv: state field {field!r} belongs to neither K nor V; its scheme cannot be split per tensor")


def _fields_of(state_cls: type, tensor: str) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(state_cls) if tensor_of(f.name) == tensor)


_STATE_CLASSES: dict[tuple[type, type], type] = {}


def split_state_class(k_cls: type, v_cls: type) -> type:
    """The flat state class: the K fields of ``k_cls``, the V fields of ``v_cls`` and ``geometry`` (one class per
    pair of component state classes)."""
    key = (k_cls, v_cls)
    if key not in _STATE_CLASSES:
        names = _fields_of(k_cls, "k") + _fields_of(v_cls, "v")
        name = f"KVSplit_{k_cls.__name__}_{v_cls.__name__}"
        ann = {n: jax.Array for n in names + (GEOMETRY,)}
        cls = struct.dataclass(type(name, (), {"__annotations__": ann, "__module__": __name__, "__qualname__": name,
                                               "__doc__": f"K fields of {k_cls.__name__}, V fields of "
                                                          f"{v_cls.__name__}, geometry uint8 [B, Hkv, C, D, 0]."}))
        cls.component_fields = {"k": _fields_of(k_cls, "k"), "v": _fields_of(v_cls, "v")}
        _STATE_CLASSES[key] = cls
    return _STATE_CLASSES[key]


@dataclasses.dataclass(frozen=True)
class KVSplitScheme(CacheScheme):
    """Keys stored by scheme ``k``, values by scheme ``v`` (see module doc)."""

    family = "kv"
    presets = {"kv": {"k": "fp32", "v": "fp32"}}     # override k / v: {name: kv, k: int8, v: kivi2}
    nested_fields = ("k", "v")

    k: CacheScheme = None  # type: ignore[assignment]
    v: CacheScheme = None  # type: ignore[assignment]

    def __post_init__(self):
        for t in ("k", "v"):
            part = getattr(self, t)
            if not isinstance(part, CacheScheme):
                raise ValueError(f"kv: {t} must be a cache scheme spec, got {part!r}")
            if part.family in ("kv", "prefix", "window"):
                raise ValueError(f"kv: {t}={part.family!r} is a wrapper; wrap the kv scheme instead "
                                 "(e.g. {name: prefix, body: {name: kv, ...}})")
            if part.rotates_stored_keys or part.schema.key_stage != "post_rope":
                raise ValueError(f"kv: {t}={part.family!r} stores pre-RoPE keys; only post-RoPE components split")
        a, b = self.k.schema, self.v.schema
        bad = [f for f in _SHARED_IDENTITY if getattr(a, f) != getattr(b, f)]
        if bad:
            raise ValueError(f"kv: k and v components disagree on {bad}: "
                             + ", ".join(f"{f} {getattr(a, f)!r} vs {getattr(b, f)!r}" for f in bad))

    # ------------------------------------------------------------------ the two halves
    def _part(self, tensor: str) -> CacheScheme:
        return self.k if tensor == "k" else self.v

    def _geometry(self, state) -> tuple[tuple[int, ...], tuple[int, int, int, int]]:
        """``(lead, (B, Hkv, C, D))``: leading (stacked layer) axes and the layer geometry ``state`` records."""
        shape = state.geometry.shape
        return tuple(shape[:-5]), tuple(shape[-5:-1])

    def _full(self, tensor: str, state):
        """Component ``tensor``'s own full state: this tensor's fields from ``state``, the other tensor's fields a
        fresh allocation of the geometry ``state`` records (broadcast over leading layer axes of a group)."""
        lead, (b, h, c, d) = self._geometry(state)
        fresh = self._part(tensor).init_layer(b, c, h, d)
        mine = type(state).component_fields[tensor]
        fill = {f.name: jnp.broadcast_to(getattr(fresh, f.name), lead + getattr(fresh, f.name).shape)
                for f in dataclasses.fields(fresh) if f.name not in mine}
        return dataclasses.replace(fresh, **fill, **{n: getattr(state, n) for n in mine})

    def _join(self, k_state, v_state, geometry):
        cls = split_state_class(type(k_state), type(v_state))
        return cls(**{n: getattr(k_state, n) for n in cls.component_fields["k"]},
                   **{n: getattr(v_state, n) for n in cls.component_fields["v"]}, geometry=geometry)

    def _halves(self, state):
        return self._full("k", state), self._full("v", state)

    # ------------------------------------------------------------------ contract
    @property
    def schema(self) -> CacheSchema:
        a, b = self.k.schema, self.v.schema
        return CacheSchema(scheme="kv", key=a.key, value=b.value, residual=max(a.residual, b.residual),
                           residual_rule="per_tensor", residual_dtype=a.residual_dtype, sink=0,
                           key_stage="post_rope", rope_theta=a.rope_theta, rope_pairing=a.rope_pairing,
                           layout_version=1, kernel_family=a.kernel_family,
                           calibration_id=f"k:{a.calibration_id},v:{b.calibration_id}", model_id=a.model_id,
                           tokenizer_hash=a.tokenizer_hash,
                           extra=(("k_schema", a.to_json()), ("v_schema", b.to_json())))

    @property
    def unbatched_fields(self):  # type: ignore[override]
        return tuple(f for t in ("k", "v") for f in self._part(t).unbatched_fields if tensor_of(f) == t)

    @property
    def ring_fields(self):  # type: ignore[override]
        return tuple(f for t in ("k", "v") for f in self._part(t).ring_fields if tensor_of(f) == t)

    def append_keeps_old_view(self, num_rows: int) -> bool:
        return self.k.append_keeps_old_view(num_rows) and self.v.append_keeps_old_view(num_rows)

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        geometry = jnp.zeros((batch, num_kv_heads, capacity, head_dim, 0), jnp.uint8)
        return self._join(self.k.init_layer(batch, capacity, num_kv_heads, head_dim),
                          self.v.init_layer(batch, capacity, num_kv_heads, head_dim), geometry)

    def _append_halves(self, method: str, state, lengths, k, v, num_new):
        """``method`` (an appending ``CacheScheme`` method returning ``(state, ok)``) on each half: the K component
        stores ``k`` (from ``(k, k)``), the V component ``v``; ``ok`` of both."""
        ks, vs = self._halves(state)
        ks, ok_k = getattr(self.k, method)(ks, lengths, k, k, num_new)
        vs, ok_v = getattr(self.v, method)(vs, lengths, v, v, num_new)
        return self._join(ks, vs, state.geometry), ok_k & ok_v

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        return self._append_halves("append_layer_with_status", state, lengths, k, v, num_new)

    def observe_shared(self, state, lengths, k, v, num_new):
        """Each component observes its own tensor's shared fields (``k`` from ``(k, k)``, ``v`` from ``(v, v)``)."""
        ks, vs = self._halves(state)
        return self._join(self.k.observe_shared(ks, lengths, k, k, num_new),
                          self.v.observe_shared(vs, lengths, v, v, num_new), state.geometry)

    def append_observed_with_status(self, state, lengths, k, v, num_new):
        return self._append_halves("append_observed_with_status", state, lengths, k, v, num_new)

    def append_layer(self, state, lengths, k, v, num_new):
        ks, vs = self._halves(state)
        return self._join(self.k.append_layer(ks, lengths, k, k, num_new),
                          self.v.append_layer(vs, lengths, v, v, num_new), state.geometry)

    def materialize_layer(self, state, lengths):
        ks, vs = self._halves(state)
        k, _, valid = self.k.materialize_layer(ks, lengths)
        _, v, _ = self.v.materialize_layer(vs, lengths)
        return k, v, valid

    def validate_layer(self, state, lengths):
        for t, st in zip(("k", "v"), self._halves(state)):
            try:
                self._part(t).validate_layer(st, lengths)
            except ValueError as e:
                raise ValueError(f"kv ({t}={self._part(t).schema.scheme}): {e}") from None

    def layer_nbytes(self, state):
        """Each component's count over the fields this scheme stores (the other tensor's fields as empty arrays of
        their dtype); ``geometry`` holds no bytes.  Unstacked or stacked states alike."""
        _, (b, h, c, d) = self._geometry(state)
        out: dict[str, int] = {}
        for t in ("k", "v"):
            part = self._part(t)
            shape = jax.eval_shape(lambda part=part: part.init_layer(b, c, h, d))
            mine = type(state).component_fields[t]
            only = type(shape)(**{f.name: getattr(state, f.name) if f.name in mine
                                  else jnp.zeros((0,), getattr(shape, f.name).dtype)
                                  for f in dataclasses.fields(shape)})
            for cat, n in part.layer_nbytes(only).items():
                out[cat] = out.get(cat, 0) + int(n)
        return out

    def field_axes(self, state):
        out: dict[str, tuple] = {}
        for t, st in zip(("k", "v"), self._halves(state)):
            axes = self._part(t).field_axes(st)
            out.update({n: axes[n] for n in type(state).component_fields[t]})
        out[GEOMETRY] = (BATCH, HEADS, None, None, None)
        return out

    def decode_regions(self, state, lengths):
        """Both components in place as one region each: ``k``'s K operand with ``v``'s V operand; otherwise the
        materialized view (one dense float32 region)."""
        ks, vs = self._halves(state)
        (kr, kt), (vr, vt) = self.k.decode_regions(ks, lengths), self.v.decode_regions(vs, lengths)
        if len(kr) == 1 and len(vr) == 1 and kt == 0 and vt == 0:
            return [region(kr[0].k, vr[0].v, kr[0].end, kr[0].start)], 0
        return CacheScheme.decode_regions(self, state, lengths)

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        out: dict[tuple[str, str], int] = {}
        for t in ("k", "v"):
            led = self._part(t).ledger_layer(batch, heads, head_dim, rows, logical=logical, capacity=capacity)
            out.update({key: n for key, n in led.items() if key[1] == t})
        return out

    def sealed_rows(self, lengths):
        return np.minimum(self.k.sealed_rows(lengths), self.v.sealed_rows(lengths))

    def rebuild_start(self, old_lengths, new_lengths):
        return np.minimum(self.k.rebuild_start(old_lengths, new_lengths),
                          self.v.rebuild_start(old_lengths, new_lengths))

    def restore_rows_layer(self, state, new_lengths, k, v, start):
        ks, vs = self._halves(state)
        return self._join(self.k.restore_rows_layer(ks, new_lengths, k, k, start),
                          self.v.restore_rows_layer(vs, new_lengths, v, v, start), state.geometry)

    def config(self) -> dict[str, Any]:
        return {"family": self.family, "k": self.k.config(), "v": self.v.config()}


def tensor_bits(scheme: CacheScheme, tensor: str, *, rows: int, num_kv_heads: int, head_dim: int) -> float:
    """Stored bits per element of ``tensor`` ("k" or "v") of any scheme at ``rows`` tokens of one sequence: the
    ledger's logical bytes of that tensor (codes, qparams, residual rows, metadata) x 8 / (Hkv x rows x D)."""
    if tensor not in ("k", "v"):
        raise ValueError(f"tensor must be 'k' or 'v', got {tensor!r}")
    led = scheme.ledger_layer(1, num_kv_heads, head_dim, rows, logical=True, capacity=rows)
    return 8.0 * sum(n for (_, t), n in led.items() if t == tensor) / (num_kv_heads * rows * head_dim)
