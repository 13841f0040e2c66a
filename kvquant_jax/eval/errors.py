"""Per-layer K/V reconstruction error and attention-logit / attention-output error vs full precision.

Exact per-layer ``q, k, v`` of a token sequence come from a full-precision forward.  Each layer's exact K/V are then
stored in a fresh one-layer state of that layer's scheme the way serving stores them -- the first ``prefill``
rows in one append, the remaining rows after (a multi-row append that gives the same stored values as one-row
decode appends for every path-independent scheme: per-token INT, QServe, KIVI (up to fp16 rounding of residual
rows that close during decode), FP8 once its warm-up scale is frozen by the prefill) -- and read back with
``scheme.materialize_layer``.  This isolates the representation error of each layer from the error feedback
through later layers (that end-to-end effect is what the perplexity metrics measure).

Probes: query positions ``t`` evenly spaced in ``[prefill, seq_len - 1]``.  The probe at ``t`` sees the state of
length ``t`` (rows ``[0, t)``, quantized as they would be at that length, e.g. KIVI's residual window ends at
``t``) plus its own exact key/value, exactly as a decode step does (``llama.attend``).

Errors are normalized by the layer's mean square so layers and schemes are comparable:
``nmse = mean((x_hat - x)^2) / mean(x^2)``; the position / head / channel breakdowns use the same denominator, so
their mean is the layer's nmse.  Keys are compared post-RoPE, as attention reads them: every scheme is appended the
model's post-RoPE keys and materializes post-RoPE keys (a ``pre_rope`` scheme such as KVQuant un-rotates and
re-rotates internally; see docs/architecture.md).  Attention metrics: relative RMS logit error, total-variation distance of the
attention weights, relative L2 error of the attention output.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache.interface import layer_state
from kvquant_jax.eval.policy import as_policy
from kvquant_jax.models.llama import attend, embed_tokens, finish_layer, layer_window, project_qkv

NEG = jnp.float32(-1e30)


@functools.partial(jax.jit, static_argnames=("cfg",))
def exact_qkv(params, cfg, tokens):
    """Post-RoPE ``q [L, B, T, Hq, D]``, ``k, v [L, B, T, Hkv, D]`` of a full-precision causal forward."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    num_new = jnp.full((b,), t, jnp.int32)

    def body(x, inp):
        lp, i = inp                      # i: the layer (its RoPE base and attention window, Gemma-3)
        q, k, v = project_qkv(cfg, x, lp, positions, layer=i)
        x = finish_layer(cfg, x, lp, attend(q, k, v, num_new, None, window=layer_window(cfg, i)))
        return x, (q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))

    n = cfg.num_layers
    _, (q, k, v) = jax.lax.scan(body, embed_tokens(params, cfg, tokens), (params["layers"],
                                                                          jnp.arange(n, dtype=jnp.int32)))
    return q, k, v


def _nmse_parts(x_hat, x, valid):
    """x_hat, x: [Hkv, C, D]; valid: [C]. Returns (nmse, by_pos [C], by_head [Hkv], by_chan [D], max_abs)."""
    m = valid[None, :, None]
    err = jnp.where(m, (x_hat - x) ** 2, jnp.float32(0))
    n = jnp.maximum(jnp.sum(valid).astype(jnp.float32), 1.0)
    h, _, d = x.shape
    ms = jnp.sum(jnp.where(m, x * x, jnp.float32(0))) / (n * h * d)
    ms = jnp.maximum(ms, jnp.float32(1e-30))
    return (jnp.sum(err) / (n * h * d) / ms, jnp.mean(err, axis=(0, 2)) / ms, jnp.sum(err, axis=(1, 2)) / (n * d) / ms,
            jnp.sum(err, axis=(0, 1)) / (n * h) / ms, jnp.max(jnp.where(m, jnp.abs(x_hat - x), jnp.float32(0))))


@functools.partial(jax.jit, static_argnames=("scheme", "prefill"))
def layer_errors(scheme, state, q, k, v, probes, *, prefill: int):
    """Errors of one layer.  state: a fresh ``[n, ...]`` layer state of ``scheme`` (calibrated state installed);
    q: [T, Hq, D], k, v: [T, Hkv, D] exact post-RoPE; probes: int32 [n] positions in ``[prefill, T - 1]`` (the last
    is the largest)."""
    t, hkv, d = k.shape
    hq = q.shape[1]
    g = hq // hkv
    n = probes.shape[0]
    kb = jnp.broadcast_to(k[None], (n, t, hkv, d))
    vb = jnp.broadcast_to(v[None], (n, t, hkv, d))
    st = scheme.append_layer(state, jnp.zeros((n,), jnp.int32), kb[:, :prefill], vb[:, :prefill],
                             jnp.full((n,), prefill, jnp.int32))
    if t > prefill:
        st = scheme.append_layer(st, jnp.full((n,), prefill, jnp.int32), kb[:, prefill:], vb[:, prefill:],
                                 probes - prefill)
    kh, vh, valid = scheme.materialize_layer(st, probes)                  # [n, Hkv, C >= t, D], post-RoPE keys
    kh, vh, valid = kh[:, :, :t], vh[:, :, :t], valid[:, :t]
    # reconstruction at the largest probe
    last = n - 1
    k_rec = _nmse_parts(kh[last], jnp.swapaxes(k, 0, 1), valid[last])
    v_rec = _nmse_parts(vh[last], jnp.swapaxes(v, 0, 1), valid[last])
    # attention at every probe
    kx = jnp.broadcast_to(jnp.swapaxes(k, 0, 1)[None], (n, hkv, t, d))
    vx = jnp.broadcast_to(jnp.swapaxes(v, 0, 1)[None], (n, hkv, t, d))
    qt = q[probes]                                                          # [n, Hq, D]
    k_self, v_self = k[probes][:, None], v[probes][:, None]                # [n, 1, Hkv, D]
    hp = jax.lax.Precision.HIGHEST
    scale = jnp.float32(1.0 / d ** 0.5)
    qg = qt.reshape(n, hkv, g, d)
    s_x = jnp.einsum("nkgd,nkcd->nkgc", qg, kx, precision=hp) * scale
    s_q = jnp.einsum("nkgd,nkcd->nkgc", qg, kh, precision=hp) * scale
    s_self = jnp.einsum("nkgd,nkd->nkg", qg, k_self[:, 0], precision=hp)[..., None] * scale
    vm = valid[:, None, None, :]
    diff = jnp.where(vm, s_q - s_x, jnp.float32(0))
    cnt = jnp.maximum(jnp.sum(valid, axis=1).astype(jnp.float32), 1.0)[:, None]             # [n, 1]
    logit_rms = jnp.sqrt(jnp.sum(diff ** 2, axis=(2, 3)) / (cnt * g))                        # [n, Hkv]
    logit_ref = jnp.sqrt(jnp.sum(jnp.where(vm, s_x, jnp.float32(0)) ** 2, axis=(2, 3)) / (cnt * g))
    p_x = jax.nn.softmax(jnp.concatenate([jnp.where(vm, s_x, NEG), s_self], axis=-1), axis=-1)
    p_q = jax.nn.softmax(jnp.concatenate([jnp.where(vm, s_q, NEG), s_self], axis=-1), axis=-1)
    tv = 0.5 * jnp.sum(jnp.abs(p_q - p_x), axis=-1)                                          # [n, Hkv, G]
    one = jnp.ones((n,), jnp.int32)
    o_x = attend(qt[:, None], k_self, v_self, one, (kx, vx, valid))[:, 0]                  # [n, Hq, D]
    o_q = attend(qt[:, None], k_self, v_self, one, (kh, vh, valid))[:, 0]
    out_rel = jnp.linalg.norm(o_q - o_x, axis=-1) / jnp.maximum(jnp.linalg.norm(o_x, axis=-1), 1e-30)
    sat_fn = getattr(scheme, "saturated_layer", None)      # FP8: finite values stored as +-max (cache.status)
    sat = sat_fn(st, kb, vb, probes)[last] if sat_fn is not None else jnp.zeros((2,), jnp.int32)
    return {
        "saturated": sat,                                                  # [2] K, V elements of rows [0, t_last)
        "k_nmse": k_rec[0], "k_nmse_by_pos": k_rec[1], "k_nmse_by_head": k_rec[2], "k_nmse_by_chan": k_rec[3],
        "k_max_abs": k_rec[4],
        "v_nmse": v_rec[0], "v_nmse_by_pos": v_rec[1], "v_nmse_by_head": v_rec[2], "v_nmse_by_chan": v_rec[3],
        "v_max_abs": v_rec[4],
        "logit_rel_rms": logit_rms / jnp.maximum(logit_ref, 1e-30),      # [n, Hkv]
        "logit_rms": logit_rms,
        "attn_tv": jnp.mean(tv, axis=-1),                                  # [n, Hkv]
        "out_rel": out_rel.reshape(n, hkv, g).mean(axis=-1),               # [n, Hkv]
    }


def probe_positions(seq_len: int, prefill: int, probes: int) -> np.ndarray:
    """``probes`` distinct query positions evenly spaced in ``[prefill, seq_len - 1]`` (ascending)."""
    return np.unique(np.linspace(prefill, seq_len - 1, probes).round().astype(np.int32))


def bin_means(x: np.ndarray, bins: int) -> list[float]:
    """Means of ``x`` over ``bins`` (at most ``len(x)``) nearly equal consecutive slices."""
    edges = np.linspace(0, len(x), min(bins, len(x)) + 1).round().astype(int)
    return [float(x[a:b].mean()) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def kv_errors(params, cfg, tokens, policy, *, prefill: int, probes: int, position_bins: int = 32) -> dict:
    """Reconstruction and attention errors of ``policy`` on one sequence ``tokens`` (int32 [T]); see module doc.

    Returns plain floats / lists: per-layer lists (``k_nmse``, ``v_nmse``, ``logit_rel_rms``, ``attn_tv``,
    ``out_rel``), their layer means, ``k_saturated`` / ``v_saturated`` (elements of the largest probe's rows a
    saturating scheme -- FP8 -- stored as +-max; ``saturated_by_layer`` ``[L][K, V]``), and breakdowns averaged over layers (``*_by_pos``: rows ``[0, last probe)`` of the largest probe's
    state, binned into ``position_bins``, ``*_by_head``, ``*_by_chan``, attention ``*_by_probe``)."""
    policy = as_policy(policy)
    tokens = np.asarray(tokens, np.int32).reshape(1, -1)
    t = tokens.shape[1]
    if not 1 <= prefill <= t - 1:
        raise ValueError(f"kv_errors: prefill must be in [1, {t - 1}], got {prefill}")
    q, k, v = exact_qkv(params, cfg, jnp.asarray(tokens))
    pr = probe_positions(t, prefill, probes)
    fresh = policy.init(cfg, len(pr), t)        # every layer's fresh state, calibrated state installed
    per_layer = []
    for layer in range(cfg.num_layers):
        scheme, state = layer_state(fresh, layer)
        if getattr(scheme, "row_positions", None) is not None:
            raise ValueError(f"kv_errors: layer {layer} keeps a sliding-window ring ({type(scheme).__name__}), whose "
                             "rows are not positions; the per-position error metric does not support it yet "
                             "(disable tasks.kv_error for sliding-window models)")
        out = layer_errors(scheme, state, q[layer, 0], k[layer, 0], v[layer, 0], jnp.asarray(pr), prefill=prefill)
        per_layer.append({name: np.asarray(a, np.float64) for name, a in out.items()})
    stack = {name: np.stack([p[name] for p in per_layer]) for name in per_layer[0]}
    res: dict = {"probes": pr.tolist(), "seq_len": t, "prefill": prefill}
    for name in ("k_nmse", "v_nmse", "k_max_abs", "v_max_abs"):
        res[name + "_by_layer"] = stack[name].tolist()
        res[name] = float(stack[name].mean()) if "nmse" in name else float(stack[name].max())
    for name in ("k_nmse", "v_nmse"):
        res[name + "_by_pos"] = bin_means(stack[name + "_by_pos"].mean(axis=0)[: pr[-1]], position_bins)
        res[name + "_by_head"] = stack[name + "_by_head"].mean(axis=0).tolist()
        res[name + "_by_chan"] = stack[name + "_by_chan"].mean(axis=0).tolist()
    sat = stack["saturated"].astype(np.int64)                             # [L, 2]
    res["saturated_by_layer"] = sat.tolist()
    res["k_saturated"], res["v_saturated"] = int(sat[:, 0].sum()), int(sat[:, 1].sum())
    for name in ("logit_rel_rms", "attn_tv", "out_rel"):
        a = stack[name]                                                    # [L, n, Hkv]
        res[name + "_by_layer"] = a.mean(axis=(1, 2)).tolist()
        res[name + "_by_probe"] = a.mean(axis=(0, 2)).tolist()
        res[name + "_by_head"] = a.mean(axis=(0, 1)).tolist()
        res[name] = float(a.mean())
    return res
