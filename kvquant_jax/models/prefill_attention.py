"""Attention of a forward over [stored history, this forward's exact K/V]: the float32 reference and cuDNN flash.

Shapes: B batch, T tokens in this forward, Hq query heads, Hkv KV heads, G = Hq // Hkv, D head_dim, C history rows.
Both implementations compute ONE softmax over the history rows (``valid``) and the causal current chunk (keys
``s <= t`` and ``s < num_new``):

* :func:`attend` (reference): float32 scores ``[B, Hkv, G, T, C + T]`` materialized; exact (HIGHEST precision),
  the CPU and parity path; memory ``O(T * (C + T))`` per head, so it cannot serve long prompts.
* :func:`prefill_attention_cudnn` (GPU, bf16/fp16 models): two cuDNN fused flash-attention calls, the causal current chunk and the
  history (padding mask ``kv_seqlen = #valid``), each returning its float32 softmax statistics (log-sum-exp of the
  scaled logits); the two partial outputs merge exactly by their log-sum-exps. No ``[T, T]`` scores exist in HBM.
  Operands in the compute dtype (bf16/fp16; float32 inputs are rounded to bf16), float32 accumulation. Requires
  the history rows to be contiguous from row 0 (``valid[b] == arange(C) < n_b``), which every scheme's
  ``materialize_layer`` satisfies (rows are positions).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kvquant_jax.models import fixed_order as FO

ATTENTION_IMPLS = ("auto", "kernel", "reference")
NEG_INF = -1e30


QUERY_BLOCK = 1024    # attend() scores at most this many query rows at once (memory O(QUERY_BLOCK * (C + T)))


def attend(q: jax.Array, k_cur: jax.Array, v_cur: jax.Array, num_new: jax.Array,
           hist: tuple[jax.Array, jax.Array, jax.Array] | None, *, window=0, q_start=None,
           hist_pos=None, query_block: int = QUERY_BLOCK, fixed_order: bool = False) -> jax.Array:
    """One softmax over [history, current chunk].

    A forward of more than ``query_block`` tokens is scored ``query_block`` query rows at a time (``lax.map``
    over row blocks; every row sees the same keys and the same mask as unblocked, so a long exact prefill needs
    ``O(query_block * (C + T))`` score memory per head instead of ``O(T * (C + T))``).

    q: [B, T, Hq, D]; k_cur, v_cur: [B, T, Hkv, D]; num_new: int32 [B] (keys t >= num_new are padding);
    hist: optional (k [B, Hkv, C, D] f32, v [B, Hkv, C, D] f32, valid bool [B, C]).
    window: sliding attention window W (0 = unbounded; a Python int, or an int32 scalar under ``lax.scan``): the
    query at position p sees keys at positions s with ``p - W < s <= p`` (transformers' convention).  Query ``t``
    sits at ``q_start[b] + t`` (int32 [B], default 0) and history row ``c`` at ``hist_pos[b, c]`` (int32 [B, C],
    default ``c``).
    fixed_order: the ``fixed_order`` numerics (``kvquant_jax.models.fixed_order``): the 1/sqrt(D) scale folded into
    q (XLA:CPU fuses ``scores * scale - max`` into an FMA in some fusions and not in others), ``exp`` and the
    softmax normalizer from IEEE adds / multiplies in a fixed order (``fixed_order.softmax``), and the
    probability-weighted values formed batch-major (``[B, Hkv, G, T, D]``, then one transpose; the output-layout
    einsum changes kernels when a per-device batch or head count is 1).  Every (sequence, head) row is then
    bit-identical whatever the number of sequences and heads alongside it.  Off by default (rounds differently).
    Returns [B, T, Hq, D] in q's dtype; scores and softmax in float32.
    """
    b, t, hq, d = q.shape
    if query_block < 1:
        raise ValueError(f"attend: query_block must be >= 1, got {query_block}")
    if t > query_block:
        nb = -(-t // query_block)
        qp = jnp.pad(q, ((0, 0), (0, nb * query_block - t), (0, 0), (0, 0)))
        blocks = jnp.moveaxis(qp.reshape(b, nb, query_block, hq, d), 1, 0)           # [nb, B, Tq, Hq, D]

        def one(args):
            q_blk, off = args
            return _attend_rows(q_blk, off, k_cur, v_cur, num_new, hist, window, q_start, hist_pos, fixed_order)

        out = jax.lax.map(one, (blocks, jnp.arange(nb, dtype=jnp.int32) * query_block))
        return jnp.moveaxis(out, 0, 1).reshape(b, nb * query_block, hq, d)[:, :t]
    return _attend_rows(q, jnp.int32(0), k_cur, v_cur, num_new, hist, window, q_start, hist_pos, fixed_order)


def _attend_rows(q, row0, k_cur, v_cur, num_new, hist, window, q_start, hist_pos, fixed_order=False):
    """:func:`attend` for the query rows ``row0 + [0, Tq)`` of the forward (``q [B, Tq, Hq, D]``); keys are the
    whole current chunk ``k_cur, v_cur [B, T, Hkv, D]`` and the history."""
    b, tq, hq, d = q.shape
    t = k_cur.shape[1]
    hkv = k_cur.shape[2]
    g = hq // hkv
    scale = jnp.float32(1.0 / (d ** 0.5))
    qf = q.astype(jnp.float32).reshape(b, tq, hkv, g, d)
    if fixed_order:    # scale folded into q: no product feeding the softmax's subtraction (XLA:CPU fuses it, FMA)
        qf, scale = qf * scale, jnp.float32(1.0)
    kc, vc = k_cur.astype(jnp.float32), v_cur.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    s_cur = jnp.einsum("btkgd,bskd->bkgts", qf, kc, precision=hp) * scale          # [B, Hkv, G, Tq, S=T]
    ti = row0 + jnp.arange(tq, dtype=jnp.int32)                                    # query rows
    si = jnp.arange(t, dtype=jnp.int32)                                            # key rows of this chunk
    causal = (si[None, :] <= ti[:, None])[None] & (si[None, None, :] < num_new[:, None, None])  # [B, Tq, S]
    bounded = not isinstance(window, int) or window > 0
    win = jnp.where(jnp.asarray(window) > 0, jnp.asarray(window, jnp.int32), jnp.int32(2 ** 30)) if bounded else 0
    if bounded:
        causal = causal & ((ti[:, None] - si[None, :]) < win)[None]
    s_cur = jnp.where(causal[:, None, None], s_cur, jnp.float32(NEG_INF))
    if hist is not None:
        hk, hv, valid = hist
        s_hist = jnp.einsum("btkgd,bkcd->bkgtc", qf, hk, precision=hp) * scale      # [B, Hkv, G, T, C]
        keep = jnp.broadcast_to(valid[:, None, :], (b, tq, valid.shape[-1]))          # [B, Tq, C]
        if bounded:
            c = valid.shape[-1]
            qp = (jnp.zeros((b,), jnp.int32) if q_start is None else q_start.astype(jnp.int32))[:, None] + ti[None]
            hpos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c)) if hist_pos is None else hist_pos
            keep = keep & (hpos[:, None, :] > qp[:, :, None] - win)
        s_hist = jnp.where(keep[:, None, None], s_hist, jnp.float32(NEG_INF))
        s = jnp.concatenate([s_hist, s_cur], axis=-1)
    else:
        s = s_cur
    p = FO.softmax(s, axis=-1) if fixed_order else jax.nn.softmax(s, axis=-1)

    def weighted(p, v, keys):                 # p [B, Hkv, G, Tq, S], v [B, S, Hkv, D] or [B, Hkv, S, D]
        if not fixed_order:
            return jnp.einsum(f"bkgt{keys[0]},{keys[1]}->btkgd", p, v, precision=hp)
        return jnp.einsum(f"bkgt{keys[0]},{keys[1]}->bkgtd", p, v, precision=hp).transpose(0, 3, 1, 2, 4)

    if hist is not None:
        c = hk.shape[2]
        out = weighted(p[..., :c], hv, ("c", "bkcd")) + weighted(p[..., c:], vc, ("s", "bskd"))
    else:
        out = weighted(p, vc, ("s", "bskd"))
    return out.reshape(b, tq, hq, d).astype(q.dtype)


def resolve_decode_impl(attention_impl: str, platform: str | None = None) -> str:
    """The decode (T == 1) path for a forward's ``attention_impl``: "auto" on CPU is the model's float32 reference
    (materialize the stored history; exactly the CPU results before "auto" became the default), elsewhere the
    dispatcher (``attention.dispatch.decode_attention``, kernels where they serve the layout)."""
    platform = platform or jax.default_backend()
    if attention_impl == "auto" and platform == "cpu":
        return "reference"
    return attention_impl


def resolve_prefill_impl(attention_impl: str, platform: str | None = None, dtype=jnp.bfloat16) -> str:
    """The prefill (T > 1) attention for a forward's ``attention_impl`` and compute ``dtype``: ``"cudnn"`` on GPU
    for "auto"/"kernel" with bf16/fp16 activations; ``"reference"`` otherwise (CPU and TPU, and float32 models on
    GPU, which keep float32 parity: cuDNN would round their operands to bf16)."""
    platform = platform or jax.default_backend()
    if attention_impl == "reference" or platform not in ("gpu", "cuda"):
        return "reference"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return "reference"
    return "cudnn"


def prefill_attention(q, k_cur, v_cur, num_new, hist, *, impl: str = "reference", fixed_order: bool = False):
    """:func:`attend` (``impl="reference"``, with ``fixed_order``) or :func:`prefill_attention_cudnn`
    (``"cudnn"``); same arguments."""
    if impl == "reference":
        return attend(q, k_cur, v_cur, num_new, hist, fixed_order=fixed_order)
    if impl == "cudnn":
        return prefill_attention_cudnn(q, k_cur, v_cur, num_new, hist)
    raise ValueError(f"prefill attention impl must be 'reference' or 'cudnn', got {impl!r}")


def _cudnn_with_stats(q, k, v, q_len, kv_len, *, causal: bool, layout: str):
    """One cuDNN flash-attention call -> (out in q's dtype, float32 log-sum-exp ``[B, Hq, T]``)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    d = q.shape[-1]
    out, lse = dot_product_attention(q, k, v, q_seqlen=q_len, kv_seqlen=kv_len, scale=float(1.0 / d ** 0.5),
                                     mask_type=MaskType.PADDING_CAUSAL if causal else MaskType.PADDING,
                                     qkv_layout=layout, return_residual=True)
    return out, lse.astype(jnp.float32)


def prefill_attention_cudnn(q, k_cur, v_cur, num_new, hist):
    """cuDNN flash attention over [history, causal current chunk], merged by log-sum-exp (module docstring).

    q: [B, T, Hq, D]; k_cur, v_cur: [B, T, Hkv, D]; num_new: int32 [B]; hist: optional (k [B, Hkv, C, D],
    v [B, Hkv, C, D], valid bool [B, C]). Returns [B, T, Hq, D] in q's dtype; rows ``t >= num_new`` are 0.
    """
    b, t, hq, d = q.shape
    cdt = q.dtype if q.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
    qc = q.astype(cdt)
    num_new = num_new.astype(jnp.int32)
    out_c, lse_c = _cudnn_with_stats(qc, k_cur.astype(cdt), v_cur.astype(cdt), num_new, num_new, causal=True,
                                     layout="BTNH")
    q_valid = (jnp.arange(t)[None, :] < num_new[:, None])[:, :, None, None]          # [B, T, 1, 1]
    out_c = out_c.astype(jnp.float32)
    if hist is None:
        return jnp.where(q_valid, out_c, 0.0).astype(q.dtype)
    hk, hv, valid = hist
    n_hist = jnp.sum(valid, axis=-1).astype(jnp.int32)                                   # [B]
    has = n_hist > 0
    out_h, lse_h = _cudnn_with_stats(jnp.swapaxes(qc, 1, 2), hk.astype(cdt), hv.astype(cdt), num_new,
                                     jnp.maximum(n_hist, 1), causal=False, layout="BNTH")
    out_h = jnp.swapaxes(out_h, 1, 2).astype(jnp.float32)                               # [B, T, Hq, D]
    lse_h = jnp.swapaxes(lse_h, 1, 2)[..., None]                                          # [B, T, Hq, 1]
    lse_c = jnp.swapaxes(lse_c, 1, 2)[..., None]
    lse_h = jnp.where(has[:, None, None, None], lse_h, -jnp.inf)
    m = jnp.maximum(lse_h, lse_c)
    w_h = jnp.where(has[:, None, None, None], jnp.exp(lse_h - m), 0.0)
    w_c = jnp.exp(lse_c - m)
    out = (w_h * jnp.where(has[:, None, None, None], out_h, 0.0) + w_c * out_c) / (w_h + w_c)
    return jnp.where(q_valid, out, 0.0).astype(q.dtype)
