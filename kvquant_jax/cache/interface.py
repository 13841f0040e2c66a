"""The contract every KV-cache scheme implements, and the whole-model cache value the model threads through.

Physical layout (all schemes)
-----------------------------
One *layer state* is a ``flax.struct.dataclass`` whose array fields are head-major: ``[B, Hkv, C, ...]`` (batch,
KV head, capacity rows, per-row payload).  ``C`` is the static capacity.  Row ``i`` of sequence ``b`` holds logical
token position ``i`` (prefix rows included, see ``KVCache.lengths``).  Head-major is the layout the decode kernel
reads: one ``(b, h)`` program streams contiguous token rows.

Frontiers are functions of the committed length
-----------------------------------------------
A layer state never stores its own length.  The single committed ``lengths: int32[B]`` lives on :class:`KVCache`,
and every scheme derives its frontiers (quantized region, residual window, closed groups) from it with pure
functions.  ``append_layer`` may only write physical slots that are *invisible* at the old length (rows beyond the
old frontier, free ring slots); it never edits a row the old length exposes.  Publication is then one update of
``lengths`` for all layers at once.  This is the prepare/publish split of design notes 0x05D/0x0CA obtained from
data layout plus purity: if the step's inputs are non-finite the model keeps the old ``lengths`` and raises, and the
returned cache is logically identical to the old one even when its buffers were donated.

The contract a one-row append must meet under donation: it writes only slots invisible at the old length.
Multi-row appends (prefill) are atomic by purity (the caller keeps the old value).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvquant_jax.abi.regions import Region, dense_operand, region
from kvquant_jax.cache.schema import CacheSchema

LayerState = Any  # a flax.struct.dataclass pytree with [B, Hkv, C, ...] arrays

#: Logical axis names of layer-state fields (:meth:`CacheScheme.field_axes`); ``kvquant_jax.sharding`` maps them
#: onto the mesh: BATCH -> ``data``, HEADS -> ``model`` (when the KV heads divide it; replicated when Hkv < model),
#: HEADS_REPLICATED (a per-head axis holding one per-tensor value broadcast to every head: stored replicated on
#: every shard so no shard can hold its own "per-tensor" value, sliced to the local heads inside per-head compute),
#: None (never sharded: capacity rows, payload, codebook entries).
BATCH, HEADS, HEADS_REPLICATED = "batch", "heads", "heads_replicated"


class CacheScheme(abc.ABC):
    """A cache scheme: static (hashable) description + pure functions over one layer's state.

    Subclasses are frozen dataclasses so they can be static arguments of ``jax.jit``.
    """

    @property
    @abc.abstractmethod
    def schema(self) -> CacheSchema:
        """The full ABI schema of the stored representation."""

    @abc.abstractmethod
    def init_layer(self, batch: int, capacity: int, num_kv_heads: int, head_dim: int) -> LayerState:
        """Empty state for one layer. Arrays are ``[B, Hkv, C, ...]``; contents of invisible rows are unspecified."""

    @abc.abstractmethod
    def append_layer(self, state: LayerState, lengths: jax.Array, k: jax.Array, v: jax.Array,
                     num_new: jax.Array) -> LayerState:
        """Append rows for one layer.

        Args:
          state: the layer state at committed ``lengths`` (int32 ``[B]``).
          k, v: float ``[B, T, Hkv, D]``; keys in the stage the schema declares (post-RoPE unless
            ``schema.key_stage == "pre_rope"``).
          num_new: int32 ``[B]`` in ``[0, T]``. Rows ``t < num_new[b]`` go to positions ``lengths[b] + t``;
            other rows are padding and must not influence any stored code or qparam.
        Returns the successor state for committed length ``lengths + num_new``.  Capacity is checked by the
        caller (statically); writes only slots invisible at ``lengths`` (see module doc).
        """

    @abc.abstractmethod
    def materialize_layer(self, state: LayerState, lengths: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Dequantize every region (the oracle / reference view).

        Returns ``(k, v, valid)``: float32 ``[B, Hkv, C, D]`` twice and bool ``[B, C]``; rows at or beyond
        ``lengths[b]`` are zero and invalid.  Keys are in the schema's stored stage.
        """

    def validate_layer(self, state: LayerState, lengths: jax.Array) -> None:
        """Raise ``ValueError`` if an invariant of the stored representation is broken (host-side, not jitted)."""
        del state, lengths

    def layer_nbytes(self, state: LayerState) -> dict[str, int]:
        """Real ``nbytes`` of one layer state by ledger category (see ``kvquant_jax.quant.ledger``).

        Works on an unstacked layer state and on a stacked group state alike (it sums array ``nbytes``).
        """
        raise NotImplementedError

    # ----- optional parts of the contract (defaults suit schemes whose every row is stored independently) -----

    #: family name used by the registry / serialization (``schema.scheme``).
    family: ClassVar[str] = ""
    #: registry names this class answers to: ``name -> constructor arguments`` (``cache.registry.NAMES``).
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    #: friendly spec keys -> the constructor fields they set (``{"bits": ("k_bits", "v_bits")}``).
    aliases: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: constructor fields that are themselves schemes (a spec there is built by the registry, a ``config()``
    #: there is rebuilt by ``scheme_from_config``): the prefix wrapper's ``body``.
    nested_fields: ClassVar[tuple[str, ...]] = ()
    #: state fields WITHOUT a batch axis (shared by every sequence, e.g. FP8 scales ``[Hkv]``): fork/reorder
    #: leave them alone.  Every other field is ``[B, ...]`` (``[L_g, B, ...]`` stacked).  A body scheme of a window
    #: ring must also give them no row axis (one value per layer: the ring stores them once, ``cache/window.py``)
    #: and update them only in :meth:`observe_shared`.
    unbatched_fields: ClassVar[tuple[str, ...]] = ()
    #: fields that a MULTI-row append may overwrite at slots visible at the old length (residual rings).  A
    #: one-row append never does; :func:`kvquant_jax.cache.ops.publish` keeps the old ring contents when a
    #: multi-row append is rejected, so a rejected prefill is harmless even when the cache was donated.
    ring_fields: ClassVar[tuple[str, ...]] = ()

    def append_keeps_old_view(self, num_rows: int) -> bool:
        """Static: does an append of ``num_rows`` rows (the static T) leave every slot visible at the OLD lengths
        untouched?  Always true for one row (the frontier rule).  For more rows it is true unless the scheme has
        residual rings (``ring_fields``), which a long append may wrap onto live slots.  A model that appends first
        and then reads the updated state at the old lengths (in-place decode) may do so only when this is True;
        otherwise it must read the pre-append state (e.g. chunked prefill with KIVI)."""
        return num_rows == 1 or not self.ring_fields

    def append_layer_with_status(self, state: LayerState, lengths: jax.Array, k: jax.Array, v: jax.Array,
                                 num_new: jax.Array) -> tuple[LayerState, jax.Array]:
        """:meth:`append_layer` plus ``ok: bool [B]``: sequence ``b``'s valid rows were finite and encodable.

        A sequence whose ``ok`` is False must not be published (its new rows may hold garbage).  Schemes whose
        quantizer can reject finite inputs (a stored qparam that overflows its dtype) override this.
        """
        return self.append_layer(state, lengths, k, v, num_new), rows_finite(k, v, num_new)

    # ----- layer-wide (shared) state: the split a container of several body states (a window ring) needs -----

    def observe_shared(self, state: LayerState, lengths: jax.Array, k: jax.Array, v: jax.Array,
                       num_new: jax.Array) -> LayerState:
        """The first half of an append: ``state`` with its *shared* fields (``unbatched_fields``: no batch axis, no
        row axis, one value per layer) updated for appending ``k, v`` (``[B, T, Hkv, D]``, ``num_new`` int32
        ``[B]``) at the LAYER's committed ``lengths`` (int32 ``[B]``); every other field is returned as it is.

        This is where a scheme whose shared state is set from the data decides, from the layer's lengths, whether
        the layer is warm (FP8 ``scales="warmup"``: observe the scales iff the layer holds no row).  A container
        that keeps several body states per layer (``cache/window.py``) calls it once per append with the layer's
        lengths and all the appended rows, then :meth:`append_observed_with_status` per body state.  ``state``
        may be any state of the layer's geometry holding the layer's shared fields (only those are read).
        Default: nothing is observed (right for schemes whose shared fields are fixed: calibrated scales).
        Contract (tested for every family): ``append_layer_with_status(s, L, k, v, n)`` equals
        ``append_observed_with_status(observe_shared(s, L, k, v, n), L, k, v, n)`` bit for bit."""
        del lengths, k, v, num_new
        return state

    def append_observed_with_status(self, state: LayerState, lengths: jax.Array, k: jax.Array, v: jax.Array,
                                    num_new: jax.Array) -> tuple[LayerState, jax.Array]:
        """The second half: :meth:`append_layer_with_status` at this state's own committed ``lengths`` with the
        shared fields taken as given (already observed for the layer by :meth:`observe_shared`) and returned
        unchanged.  Default: the plain append (right whenever :meth:`observe_shared` is the default)."""
        return self.append_layer_with_status(state, lengths, k, v, num_new)

    def supports_window_append(self) -> bool:
        """Static: is :meth:`append_window_with_status` right for this scheme?  A paged engine step then appends
        through a small *window* of the pages it writes (``cache/paged.py``, ``paged.layer_window``;
        ``attention/paged.PagedStep``) instead of the whole contiguous view; otherwise it appends on the view of
        the mapped pages.
        Default False (a new scheme is served correctly, only not window-direct)."""
        return False

    def append_window_with_status(self, state: LayerState, lengths: jax.Array, k: jax.Array, v: jax.Array,
                                  num_new: jax.Array, row0: jax.Array) -> tuple[LayerState, jax.Array]:
        """:meth:`append_layer_with_status` on a *window* state: every capacity-row field holds the rows of
        positions ``[row0[b], row0[b] + W)`` (W = the window's capacity; ``row0`` int32 ``[B]``, a page boundary
        at or below ``sealed_rows(lengths)``, so every row the append writes lies in the window); per-sequence and
        shared fields are whole.  ``lengths`` are the TRUE committed lengths (positions: RoPE, ring slots,
        frontiers).  The result must equal cropping the full-view append to the window, bit for bit.

        Default: the append at shifted lengths ``lengths - row0`` -- right for schemes whose append uses positions
        only as row indices (every row encoded on its own: full, per-token, QServe, static INT); schemes with
        position-dependent state (rings, RoPE, warm-up) override it and :meth:`supports_window_append`."""
        return self.append_layer_with_status(state, lengths - row0, k, v, num_new)

    def rebuild_start(self, old_lengths, new_lengths):
        """Host-side (NumPy int ``[B]``): first position whose full-precision row a truncation from ``old_lengths``
        to ``new_lengths`` must be given again (``== new_lengths`` where the held state suffices).

        Only schemes that discard full-precision rows while they still matter for a shorter length (KIVI: a closed
        K chunk or a V row that left the rolling tail) need rows; see ``kvquant_jax.cache.ops.truncate``.
        """
        del old_lengths
        return new_lengths

    def restore_rows_layer(self, state: LayerState, new_lengths: jax.Array, k: jax.Array, v: jax.Array,
                           start: jax.Array) -> LayerState:
        """Write original rows ``k, v: [B, T, Hkv, D]`` (row ``t`` = position ``start[b] + t``) back into whatever
        full-precision region the state at ``new_lengths`` needs.  Default: nothing to restore."""
        del new_lengths, k, v, start
        return state

    def sealed_rows(self, lengths):
        """Host-side (NumPy int ``[B]``): positions ``[0, sealed)`` whose stored bytes no later append changes.

        A paged cache (``cache/paged.py``) may share such rows' pages between owners; an append writes only pages
        at or past ``sealed_rows(lengths)`` (copy-on-write first where shared).  Default: every committed row is
        final (``lengths``).  KIVI writes codes of rows that sit in its residual window when they close, so its
        sealed frontier is ``min(k_frontier, v_frontier)``."""
        return np.asarray(lengths, np.int64)

    # ----- consumers: decode attention and the byte ledger (a scheme owns how it is read and counted) -----

    #: True when :meth:`decode_regions` / :meth:`materialize_layer` return POST-RoPE keys although the schema's
    #: ``key_stage`` is "pre_rope" (the scheme rotates stored keys at their positions: KVQuant).  A pre-RoPE scheme
    #: without it cannot be attended by ``attention.dispatch`` (the model would have to rotate decoded keys).
    rotates_stored_keys: ClassVar[bool] = False

    def decode_regions(self, state: LayerState, lengths: jax.Array) -> tuple[list[Region], int]:
        """The layer read in place for one decode step: ``(regions, tail_rows)``.

        ``regions``: position-disjoint :class:`~kvquant_jax.abi.regions.Region` s (arrays in the documented
        physical layouts plus static formats) whose live rows are exactly positions ``[0, lengths[b])``, keys
        post-RoPE; ``regions[0]`` is the large one a kernel streams, later ones are small dense regions attended in
        plain JAX.  ``tail_rows``: static row count of those small regions (0: none).  ``lengths``: int32 ``[B]``.
        Default: the :meth:`materialize_layer` view as one dense float32 region (correct for any scheme, but it
        decodes the whole layer: a scheme with a kernel-readable layout overrides this).
        """
        k, v, _ = self.materialize_layer(state, lengths)
        return [region(dense_operand(k), dense_operand(v), lengths)], 0

    def fused_decode_operand(self, state: LayerState, lengths: jax.Array) -> tuple[Any, Any] | None:
        """``(static_format, arrays)`` for a format-specific fused decode kernel (``attention.dispatch`` routes by
        the format's type, e.g. :class:`~kvquant_jax.abi.kvquant.KVQuantFormat`) at committed ``lengths`` (int32
        ``[B]``; a scheme whose operand depends on them derives its bounds here, as ``decode_regions`` does), or
        None (default): the layer is served through :meth:`decode_regions`."""
        del state, lengths
        return None

    def ledger_layer(self, batch: int, heads: int, head_dim: int, rows: int, *, logical: bool,
                     capacity: int) -> dict[tuple[str, str], int]:
        """Bytes of ONE layer by ``(category, "k" | "v")`` from the static description alone (no arrays).

        ``rows`` = the length T for the logical view (every sequence holds T rows), the capacity C for the
        physical one; categories are those of :mod:`kvquant_jax.quant.ledger`.  The physical view must equal
        :meth:`layer_nbytes` of an allocation of that shape (tested for every registered family).  Every term of a
        batched field carries the ``batch`` factor, so ``batch=0, rows=0`` gives the bytes of the shared
        (``unbatched_fields``) state alone: a window ring counts those once (``cache/window.py``)."""
        del batch, heads, head_dim, rows, logical, capacity
        raise ValueError(f"ledger: no byte formula for scheme family {self.family or self.schema.scheme!r} "
                         "(give the scheme a ledger_layer method, see kvquant_jax.quant.ledger)")

    def field_axes(self, state: LayerState) -> dict[str, tuple[str | None, ...]]:
        """Logical axes of every field of ONE (unstacked) layer state: ``{field: (axis, ...)}`` with one entry per
        array dimension, each :data:`BATCH`, :data:`HEADS`, :data:`HEADS_REPLICATED` or None (the sharding
        contract, read by ``kvquant_jax.sharding``; the group's leading layer axis is added there).

        Default: every field is ``[B, Hkv, ...]`` (batch, heads, then unsharded axes).  A scheme with fields of
        another layout (``unbatched_fields``, per-sequence ``[B, C]`` tables) overrides this; an unbatched field
        left to the default raises, so no layout is guessed.  ``state`` may hold ``jax.ShapeDtypeStruct`` s."""
        out: dict[str, tuple[str | None, ...]] = {}
        for f in dataclasses.fields(state):
            if f.name in self.unbatched_fields:
                raise TypeError(f"{type(self).__name__}.field_axes: unbatched field {f.name!r} needs an explicit "
                                "axes declaration (override field_axes)")
            nd = len(getattr(state, f.name).shape)
            out[f.name] = (BATCH, HEADS) + (None,) * (nd - 2)
        return out

    def config(self) -> dict[str, Any]:
        """Plain-JSON constructor arguments plus ``family``: ``registry.scheme_from_config`` rebuilds the scheme."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}
        return {"family": self.family, **d}


def rows_finite(k: jax.Array, v: jax.Array, num_new: jax.Array) -> jax.Array:
    """bool ``[B]``: every valid row (``t < num_new[b]``) of ``k`` and ``v`` (``[B, T, Hkv, D]``) is finite."""
    t = k.shape[1]
    valid = (jnp.arange(t, dtype=jnp.int32)[None, :] < num_new[:, None])[:, :, None, None]
    fin = jnp.where(valid, jnp.isfinite(k) & jnp.isfinite(v), True)
    return jnp.all(fin, axis=(1, 2, 3))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchemeBase(CacheScheme):
    """Identity fields every scheme carries into its schema (keyword-only, so subclasses keep positional fields).

    Attributes:
      rope_theta, rope_pairing: the RoPE convention of the keys (part of the ABI: 0x03E).
      key_stage: "post_rope" (default) or "pre_rope": which keys the caller appends (the model rotates decoded
        keys itself for "pre_rope").
      model_id, tokenizer_hash: identity of what produced the rows ("" = not bound).
      kernel_family: attention consumer family recorded in the schema.
    """

    rope_theta: float = 10000.0
    rope_pairing: str = "half_split"
    key_stage: str = "post_rope"
    model_id: str = ""
    tokenizer_hash: str = ""
    kernel_family: str = "reference"

    def _check_identity(self) -> None:
        if self.rope_pairing not in ("half_split", "interleaved"):
            raise ValueError(f"rope_pairing must be 'half_split' or 'interleaved', got {self.rope_pairing!r}")
        if self.key_stage not in ("post_rope", "pre_rope"):
            raise ValueError(f"key_stage must be 'post_rope' or 'pre_rope', got {self.key_stage!r}")

    def _identity(self) -> dict[str, Any]:
        return dict(rope_theta=float(self.rope_theta), rope_pairing=self.rope_pairing, key_stage=self.key_stage,
                    model_id=self.model_id, tokenizer_hash=self.tokenizer_hash, kernel_family=self.kernel_family)


class LayerGroups:
    """What every whole-model cache value (:class:`KVCache`, ``cache.paged.PagedKVCache``,
    ``attention.paged.PagedStep``) derives from its ``schemes`` (static ``(scheme, first_layer, num_layers)`` per
    group) and ``lengths`` (int32 ``[B]``)."""

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_layers(self) -> int:
        return sum(n for _, _, n in self.schemes)

    @property
    def per_layer_schemes(self) -> tuple:
        return tuple(s for s, _, n in self.schemes for _ in range(n))

    @property
    def schemas(self) -> tuple:
        """Per-layer :class:`CacheSchema` tuple (the ABI of every layer)."""
        return tuple(s.schema for s in self.per_layer_schemes)

    def scheme_for_layer(self, layer: int) -> CacheScheme:
        for scheme, first, n in self.schemes:
            if first <= layer < first + n:
                return scheme
        raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")


@struct.dataclass
class KVCache(LayerGroups):
    """The whole model's cache: one value, published whole.

    Attributes:
      groups: tuple of stacked layer states, one per run of consecutive layers sharing a scheme; arrays of group
        ``g`` are ``[L_g, B, Hkv, C, ...]`` so the model can ``lax.scan`` over them.
      lengths: int32 ``[B]``: committed rows per sequence (prefix rows included).
      schemes: static tuple of ``(scheme, first_layer, num_layers)``, one per group.
      capacity: static row capacity ``C``.
      num_kv_heads, head_dim: static ``Hkv`` and ``D`` (set by :func:`init_cache`).
    """

    groups: tuple
    lengths: jax.Array
    schemes: tuple = struct.field(pytree_node=False)
    capacity: int = struct.field(pytree_node=False)
    num_kv_heads: int = struct.field(pytree_node=False, default=0)
    head_dim: int = struct.field(pytree_node=False, default=0)


def _runs(per_layer: tuple[CacheScheme, ...]) -> list[tuple[CacheScheme, int, int]]:
    runs: list[tuple[CacheScheme, int, int]] = []
    for i, s in enumerate(per_layer):
        if runs and runs[-1][0] == s:
            runs[-1] = (s, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, i, 1))
    return runs


def init_cache(schemes: CacheScheme | tuple[CacheScheme, ...] | list, *, num_layers: int, batch: int,
               capacity: int, num_kv_heads: int, head_dim: int, layer_groups: str = "runs") -> KVCache:
    """Empty cache. ``schemes`` is one scheme for all layers, or a per-layer sequence (mixed policy).

    ``layer_groups``: ``"runs"`` stacks each run of consecutive layers with the same scheme into one group
    ``[L_g, B, Hkv, C, ...]`` (what ``lax.scan`` over layers wants); ``"per_layer"`` gives every layer its own group
    (``L_g = 1``: its own buffers), the serving layout: the model's unrolled decode step then reads and updates
    each layer's buffers in place, where slicing one layer out of a stacked buffer would copy it for a kernel."""
    if layer_groups not in ("runs", "per_layer"):
        raise ValueError(f"layer_groups must be 'runs' or 'per_layer', got {layer_groups!r}")
    if isinstance(schemes, CacheScheme):
        per_layer = (schemes,) * num_layers
    else:
        per_layer = tuple(schemes)
        if len(per_layer) != num_layers:
            raise ValueError(f"mixed policy lists {len(per_layer)} schemes for {num_layers} layers")
    if batch < 1 or capacity < 1:
        raise ValueError(f"batch ({batch}) and capacity ({capacity}) must be >= 1")
    groups = []
    runs = _runs(per_layer) if layer_groups == "runs" else [(s, i, 1) for i, s in enumerate(per_layer)]
    for scheme, _, n in runs:
        one = scheme.init_layer(batch, capacity, num_kv_heads, head_dim)
        groups.append(jax.tree.map(lambda a, n=n: jnp.broadcast_to(a, (n,) + a.shape).copy(), one))
    return KVCache(groups=tuple(groups), lengths=jnp.zeros((batch,), jnp.int32), schemes=tuple(runs),
                   capacity=capacity, num_kv_heads=num_kv_heads, head_dim=head_dim)


def check_room(cache: KVCache, num_new) -> None:
    """Host-side capacity check: raise before any work if ``lengths + num_new`` would exceed capacity."""
    lengths = np.asarray(jax.device_get(cache.lengths))
    need = lengths + np.asarray(num_new)
    if (need > cache.capacity).any():
        b = int(np.argmax(need))
        raise ValueError(f"sequence {b} needs {int(need[b])} cache rows but capacity is {cache.capacity} "
                         f"(committed {int(lengths[b])}, appending {int(np.asarray(num_new).reshape(-1)[b] if np.ndim(num_new) else num_new)})")


def layer_state(cache: KVCache, layer: int):
    """The (unstacked) state of one layer and its scheme."""
    for g, (scheme, first, n) in enumerate(cache.schemes):
        if first <= layer < first + n:
            return scheme, jax.tree.map(lambda a: a[layer - first], cache.groups[g])
    raise IndexError(f"layer {layer} out of range")


def replace_fields(obj, **kw):
    return dataclasses.replace(obj, **kw)
