"""Fixed-order float projections: the ``reduction: fixed_order`` numerics (TP- and batch-size-invariant results).

With the default numerics (``fast``) every projection is one XLA dot, and on a mesh GSPMD splits it: column-
parallel dots (q/k/v, gate/up, the head) see ``N / model`` output columns, row-parallel ones (o, down) sum ``model``
local partial dots with an all-reduce, and each device's dot sees ``batch / data`` rows.  XLA:CPU picks its GEMM
blocking (and so each output's summation order) from the operand shapes: measured on JAX 0.10.2, a ``[R, 576] @
[576, N]`` row differs in the last bits when ``R`` (1, 2, ..., 32 vs 64 rows) or ``N`` (576 vs 288 / 192 / 144)
changes, and an all-reduce of partial sums rounds differently from the single dot (~7e-7 relative).  Results then
equal the single-device run only to float rounding, which a quantized cache can amplify (a K/V value on a rounding
boundary flips its code).

:class:`FixedOrderLinear` (a ``linear(x, w, name)`` hook, installed on ``cfg.activation`` by
:func:`apply_numerics`) makes every output element's arithmetic independent of the mesh and of the batch:

* every product is a matrix-vector product, one activation row at a time (``lax.map``) on the weight in place:
  XLA:CPU's matrix-vector product gives each output column the same bits whatever the number of columns (a
  column-split weight) and whatever the other rows (measured: bit-identical), unlike its matrix-matrix product;
* a row-parallel contraction (o over heads, down over the FFN width) is cut into a FIXED number of chunks
  ``C`` (o: one per query head; down: ``gcd(intermediate, num_heads)``), a property of the model, not of the mesh:
  each device computes the partials of its ``C / model`` chunks, the partials are all-gathered over ``model``
  (instead of an all-reduce) and summed in a fixed pairwise tree (:func:`tree_sum`) on every device -- the same
  additions in the same order as the unsharded run;
* the head's logits are all-gathered over ``model`` (replicated), so the log-softmax / argmax over the vocabulary
  is one local reduction, not a cross-device sum.

Products accumulate in float32 (``preferred_element_type``) whatever the operand dtype; the result is cast to x's
dtype.  The rest of the forward follows (``is_fixed_order``): RMSNorm means and softmax / log-softmax sums by
:func:`tree_sum`, ``exp`` by :func:`exp_nonpositive`, and the reference attention with the scale folded into q and
batch-major value products (``models.prefill_attention.attend``), in every phase (no kernels, no cuDNN).
Cost: the weights are read once per activation row (a matrix-vector product per row: decode at small batches
costs about the same as one GEMM, long prefills much more), the gathered partials (``C x`` the all-reduce's
bytes) and the gathered logits.  An opt-in numerics mode; the default path is unchanged.
Composes with any cache scheme; not with a W8A8 activation policy (both are the projection hook).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kvquant_jax import sharding as S

__all__ = ["NUMERICS", "FixedOrderLinear", "apply_numerics", "is_fixed_order", "tree_sum", "mean", "softmax",
           "log_softmax", "exp_nonpositive", "rowwise_partials", "row_chunks"]

#: the numerics modes (``model.reduction`` / ``--reduction``)
NUMERICS = ("fast", "fixed_order")

#: projection name -> (parallel role, parameter name in ``kvquant_jax.sharding.WEIGHT_RULES``)
_ROLES = {"q": ("col", "wq"), "k": ("col", "wk"), "v": ("col", "wv"), "gate": ("col", "w_gate"),
          "up": ("col", "w_up"), "lm_head": ("col", "lm_head"), "o": ("row", "wo"), "down": ("row", "w_down")}


def tree_sum(p: jax.Array, axis: int = 0) -> jax.Array:
    """Sum of ``p`` over ``axis`` in a fixed pairwise tree that depends only on that axis' length ``n``: zero-pad
    to the next power of two (adding +0.0 is exact), then halve: ``p[:h] + p[h:]`` per level (explicit adds; no
    reduce op, whose order XLA chooses by shape).  Returns ``p``'s shape without ``axis``."""
    axis = axis % p.ndim
    n = p.shape[axis]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = [(0, 0)] * p.ndim
        pad[axis] = (0, width - n)
        p = jnp.pad(p, pad)
    while width > 1:
        width //= 2
        p = jax.lax.slice_in_dim(p, 0, width, axis=axis) + jax.lax.slice_in_dim(p, width, 2 * width, axis=axis)
    return jnp.squeeze(p, axis)


def mean(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """``x``'s mean over ``axis`` through :func:`tree_sum` (the RMSNorm statistic of the fixed-order numerics)."""
    m = tree_sum(x, axis) / jnp.asarray(x.shape[axis], x.dtype)
    return jnp.expand_dims(m, axis) if keepdims else m


_LN2_HI, _LN2_LO = 0.693145751953125, 1.428606765330187e-06      # Cody-Waite split of ln 2 (HI: 16 bits)
_EXP_TAYLOR = (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 0.5, 1.0, 1.0)


def exp_nonpositive(z: jax.Array) -> jax.Array:
    """float32 ``exp(z)`` for ``z <= 0`` from IEEE adds and multiplies only (relative error <= 1e-7, ~1 ulp;
    0 below -87): ``2^n * p(r)``, ``n = round(z / ln 2)``, ``r = z - n ln 2`` (two-step), ``p`` the degree-7
    Taylor polynomial by Horner, ``2^n`` built in the exponent bits.  Why not ``jnp.exp``: measured on XLA:CPU,
    ``exp(s - max(s))`` fused with the reduction rounds differently at different batch sizes (tens of elements
    of a softmax row set differ by an ulp); every operation here is correctly rounded, so the bits depend on
    ``z`` alone."""
    z = z.astype(jnp.float32)
    n = jnp.maximum(jnp.round(z * jnp.float32(1.4426950408889634)), jnp.float32(-126.0))
    r = (z - n * jnp.float32(_LN2_HI)) - n * jnp.float32(_LN2_LO)
    p = jnp.full_like(r, _EXP_TAYLOR[0])
    for c in _EXP_TAYLOR[1:]:
        p = p * r + jnp.float32(c)
    two_n = jax.lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)
    return jnp.where(z < -87.0, jnp.float32(0.0), p * two_n)


def softmax(s: jax.Array, axis: int = -1) -> jax.Array:
    """float32 ``jax.nn.softmax`` from :func:`exp_nonpositive` and a :func:`tree_sum` normalizer (the max is
    order-free)."""
    e = exp_nonpositive(s - jax.lax.stop_gradient(jnp.max(s, axis=axis, keepdims=True)))
    return e / jnp.expand_dims(tree_sum(e, axis), axis)


def log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """float32 ``jax.nn.log_softmax`` with the log-sum-exp from :func:`exp_nonpositive` and :func:`tree_sum`."""
    z = x.astype(jnp.float32) - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True)).astype(jnp.float32)
    return z - jnp.log(jnp.expand_dims(tree_sum(exp_nonpositive(z), axis), axis))


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def rowwise_partials(x: jax.Array, w: jax.Array, *, chunks: int) -> jax.Array:
    """Per-chunk partial products ``float32 [chunks, R, N]`` of ``x [R, K] @ w [K, N]``: chunk ``c`` contracts
    ``K`` columns ``[c K_c, (c + 1) K_c)`` (``K_c = K / chunks``).  One row at a time (``lax.map`` over ``R``),
    each a batch over chunks of matrix-vector products ``[1, K_c] @ [K_c, N]`` on the weight in place (``w``
    reshaped to ``[chunks, K_c, N]``, no copy).  XLA:CPU's matrix-vector product gives every output column the
    same bits whatever ``N`` (a column-split weight) and whatever other rows exist (measured), unlike its
    matrix-matrix product, whose blocking depends on both."""
    r, k = x.shape
    n = w.shape[1]
    kc = k // chunks
    wc = w.astype(x.dtype).reshape(chunks, kc, n)
    rows = max(r, 2)        # a one-trip map is unrolled and its dot compiled differently: map two rows (measured)
    xp = jnp.pad(x, ((0, rows - r), (0, 0))).reshape(rows, chunks, kc)

    def row(xr):                                                                    # [C, Kc] -> [C, N]
        return jnp.einsum("ck,ckn->cn", xr, wc, precision=_precision(x.dtype), preferred_element_type=jnp.float32)

    return jnp.swapaxes(jax.lax.map(row, xp), 0, 1)[:, :r]


def row_chunks(name: str, k: int, num_heads: int) -> int:
    """The fixed chunk count of a projection's contraction (``k`` its global width): o one per query head, down
    ``gcd(k, num_heads)`` (every admissible ``model`` divides the head count, and it splits the FFN only when it
    divides the width too, so it divides this), column-parallel projections 1 (their contraction is never split)."""
    if _ROLES[name][0] == "col":
        return 1
    return num_heads if name == "o" else math.gcd(k, num_heads)


def _fixed_matmul(x2, w, *, chunks, gather_axis=None):
    """``x2 [R, K_local] @ w [K_local, N]`` from ``chunks`` local chunks; ``gather_axis``: the mesh axis the
    chunks are split over (their partials are all-gathered, then summed in the fixed tree)."""
    p = rowwise_partials(x2, w, chunks=chunks)
    if gather_axis is not None:
        p = jax.lax.all_gather(p, gather_axis, axis=0, tiled=True)
    return tree_sum(p)


@dataclasses.dataclass(frozen=True)
class FixedOrderLinear:
    """The ``linear(x, w, name)`` hook of the ``fixed_order`` numerics (see the module doc).

    ``x [B, T, K]`` (any float dtype), ``w [K, N]`` -> ``[B, T, N]`` in x's dtype.  Under a ``(data, model)`` mesh
    (``kvquant_jax.sharding.mesh_context``) it runs in ``shard_map`` with the weight layout of
    ``kvquant_jax.sharding.param_spec`` (rows over ``data``; column-parallel outputs stay split over ``model``
    except the head's, which is gathered).  Raises ``ValueError`` naming the sizes when ``model`` does not divide
    a row-parallel chunk count.  ``models.llama.logits_from_hidden`` routes the float head (tied: the embedding
    transposed) through it as ``"lm_head"``."""

    num_heads: int
    num_kv_heads: int

    @classmethod
    def for_config(cls, cfg, **kw) -> "FixedOrderLinear":
        return cls(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, **kw)

    def __call__(self, x: jax.Array, w: jax.Array, name: str) -> jax.Array:
        if name not in _ROLES:
            raise ValueError(f"fixed_order: unknown projection {name!r} (known: {', '.join(_ROLES)})")
        role, pname = _ROLES[name]
        b, t, k = x.shape
        chunks = row_chunks(name, k, self.num_heads)
        mesh = S.active_mesh()
        m = 1 if mesh is None else int(mesh.shape[S.MODEL])
        wspec = S.param_spec(pname, w.shape, model=m, num_kv_heads=self.num_kv_heads)
        split = m > 1 and any(a == S.MODEL for a in wspec)
        if split and role == "row" and chunks % m:
            raise ValueError(f"fixed_order: model={m} does not divide the {chunks} chunks of projection {name!r}")
        local_chunks = chunks // m if (split and role == "row") else chunks
        gather = S.MODEL if (split and role == "row") else None

        def local(x, w):
            bl = x.shape[0]
            y = _fixed_matmul(x.reshape(bl * t, x.shape[2]), w, chunks=local_chunks, gather_axis=gather)
            if split and name == "lm_head":            # logits whole on every device: local vocab reductions
                y = jax.lax.all_gather(y, S.MODEL, axis=1, tiled=True)
            return y.reshape(bl, t, -1).astype(x.dtype)

        if mesh is None:
            return local(x, w)
        S.check_mesh(mesh, batch=b)
        col_out = split and role == "col" and name != "lm_head"
        xspec = P(S.DATA, None, S.MODEL if (split and role == "row") else None)
        ospec = P(S.DATA, None, S.MODEL if col_out else None)
        return jax.shard_map(local, mesh=mesh, in_specs=(xspec, wspec), out_specs=ospec, check_vma=False)(x, w)


def is_fixed_order(linear) -> bool:
    """True when a projection hook (a ``cfg.activation`` or ``linear=`` argument) is :class:`FixedOrderLinear`."""
    return isinstance(linear, FixedOrderLinear)


def apply_numerics(cfg, reduction: str):
    """``cfg`` with the projection numerics ``reduction`` (:data:`NUMERICS`): "fast" returns it unchanged,
    "fixed_order" installs :class:`FixedOrderLinear` as ``cfg.activation`` (refused with a W8A8 policy there)."""
    if reduction not in NUMERICS:
        raise ValueError(f"reduction must be one of {NUMERICS}, got {reduction!r}")
    if reduction == "fast":
        return cfg
    if isinstance(cfg.activation, FixedOrderLinear):
        return cfg
    if cfg.activation is not None:
        raise ValueError("reduction=fixed_order replaces the projection hook; it does not combine with a W8A8 "
                         f"activation policy ({type(cfg.activation).__name__})")
    return dataclasses.replace(cfg, activation=FixedOrderLinear.for_config(cfg))
