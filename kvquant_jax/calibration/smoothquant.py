"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights with an exact per-channel rescale.

For a linear ``Y = X W`` (``X [M, K]``, ``W [K, N]``) and a positive vector ``s [K]``::

    Y = (X diag(s)^-1) (diag(s) W),      s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

``max|X_j|`` is the per-INPUT-channel activation absmax collected on calibration text (WikiText-2 VALIDATION
windows, never test: :func:`validation_windows`), ``max|W_j|`` the absmax of input row ``j`` over every output
channel of every weight that reads the same activation.  ``s`` is clipped to ``[1e-5, 1e5]`` and is 1 where either
maximum is 0.  The division by ``s`` is folded offline into whatever produced ``X``, so the float model is unchanged
(to float32 rounding) and no run-time op is added:

* ``"qkv"``: X = RMSNorm(x) * attn_norm feeds q, k, v -> ``attn_norm /= s``, ``wq, wk, wv *= s`` (one ``s`` over
  the three weights: ``max|W_j|`` over their concatenation).
* ``"gate_up"``: the same with ``ffn_norm`` and ``w_gate, w_up``.
* ``"down"`` (optional): X = silu(gate) * up -> ``w_up`` columns ``/= s``, ``w_down`` rows ``*= s``.
* ``"o"`` (optional): X = attention output; per-KV-head channel scale (the G query heads of a group read the same
  V channel, so ``s`` is shared across the group: maxima taken over the group) -> ``wv`` columns ``/= s``,
  ``wo`` rows ``*= s``.

The default (the paper's LLaMA recipe) smooths ``("qkv", "gate_up")``.  Statistics of every site come from one
pass (:func:`collect_stats`), which also records key-channel maxima for SmoothAttention.

Shapes: ``L`` layers, ``H`` hidden, ``F`` intermediate, ``Hq``/``Hkv`` heads, ``D`` head_dim.  Statistics are
float32 ``[L, K]`` per linear input (``"q"``: ``[L, H]``, ``"o"``: ``[L, Hq*D]``, ``"down"``: ``[L, F]``) plus
``"k_post_rope"`` / ``"k_pre_rope"``: ``[L, Hkv, D]``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.data import load_corpus
from kvquant_jax.models import llama
from kvquant_jax.models.config import LlamaConfig

SITES = ("qkv", "gate_up", "down", "o")


@dataclasses.dataclass(frozen=True)
class SmoothQuantConfig:
    """alpha: migration strength in [0, 1] (0.5 default); sites: subset of ``SITES``; clip: s range."""

    alpha: float = 0.5
    sites: tuple[str, ...] = ("qkv", "gate_up")
    clip: tuple[float, float] = (1e-5, 1e5)

    def __post_init__(self):
        object.__setattr__(self, "sites", tuple(self.sites))
        if not 0.0 <= float(self.alpha) <= 1.0:
            raise ValueError(f"SmoothQuantConfig: alpha must be in [0, 1], got {self.alpha}")
        bad = [s for s in self.sites if s not in SITES]
        if bad:
            raise ValueError(f"SmoothQuantConfig: unknown site(s) {bad}; allowed {list(SITES)}")


# ------------------------------------------------------------------------------------------------ statistics
def validation_windows(tokenizer, n: int, seq_len: int) -> tuple[np.ndarray, dict]:
    """``n`` disjoint, contiguous ``seq_len``-token windows (no BOS) from the START of the WikiText-2 VALIDATION
    split: int32 ``[n, seq_len]`` and a provenance record (name, sha256, split, n, seq_len)."""
    corpus = load_corpus(None, split="validation", fallback=False)
    ids = tokenizer.encode(corpus.text)
    if len(ids) < n * seq_len:
        raise ValueError(f"validation split has {len(ids)} tokens, need {n * seq_len}")
    rec = {"name": corpus.name, "sha256": corpus.sha256, "split": "validation", "windows": n, "seq_len": seq_len}
    return np.asarray(ids[: n * seq_len], np.int32).reshape(n, seq_len), rec


def _absmax(a: jax.Array, keep: int) -> jax.Array:
    """max |a| over every axis but the last ``keep`` ones, in float32."""
    return jnp.max(jnp.abs(a.astype(jnp.float32)), axis=tuple(range(a.ndim - keep)))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _layer_stats(cfg: LlamaConfig, x, lp, positions):
    stats: dict = {}

    def linear(h, w, name):
        stats[name] = _absmax(h, 1)
        y = llama.dense(h, w, name)
        if name == "k":
            stats["k_pre_rope"] = _absmax(y, 1).reshape(cfg.num_kv_heads, cfg.head_dim)
        return y

    def attn(q, k, v):
        stats["k_post_rope"] = _absmax(k, 2)
        num_new = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
        return llama.attend(q, k, v, num_new, None)

    x, _, _ = llama.decoder_layer(cfg, x, lp, positions, attn, linear)
    return x, stats


def collect_stats(params, cfg: LlamaConfig, tokens, *, batch: int = 1) -> dict[str, np.ndarray]:
    """Per-channel absmax statistics of every linear input (and of keys) over ``tokens`` int32 ``[N, T]``.

    Runs the float model layer by layer (one jitted layer function). Returns float32 NumPy arrays keyed by linear
    name (``"q"``/``"k"``/``"v"`` share the input; ``"gate"``/``"up"`` too): ``[L, K]``, and ``"k_post_rope"``,
    ``"k_pre_rope"``: ``[L, Hkv, D]``.
    """
    tokens = np.asarray(tokens, np.int32)
    acc: dict[str, np.ndarray] = {}
    for s in range(0, len(tokens), batch):
        tk = jnp.asarray(tokens[s:s + batch])
        b, t = tk.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x = params["embed"][tk]
        per_layer = []
        for i in range(cfg.num_layers):
            lp = jax.tree.map(lambda a, i=i: a[i], params["layers"])
            x, st = _layer_stats(cfg, x, lp, positions)
            per_layer.append(st)
        for k in per_layer[0]:
            v = np.stack([np.asarray(st[k]) for st in per_layer])
            acc[k] = v if k not in acc else np.maximum(acc[k], v)
    return acc


# ------------------------------------------------------------------------------------------------ the fold
def smoothing_scale(x_absmax, w_absmax, alpha: float, clip=(1e-5, 1e5)) -> jax.Array:
    """``s = clip(x^alpha / w^(1-alpha))``, 1 where either maximum is 0 (float32, any shape)."""
    x = jnp.asarray(x_absmax, jnp.float32)
    w = jnp.asarray(w_absmax, jnp.float32)
    ok = (x > 0) & (w > 0)
    xs, ws = jnp.where(ok, x, jnp.float32(1)), jnp.where(ok, w, jnp.float32(1))
    s = jnp.power(xs, jnp.float32(alpha)) / jnp.power(ws, jnp.float32(1.0 - alpha))
    return jnp.where(ok, jnp.clip(s, jnp.float32(clip[0]), jnp.float32(clip[1])), jnp.float32(1))


def _row_absmax(*ws) -> jax.Array:
    """``[L, K]`` absmax of each input row over the output channels of all ``ws [L, K, N_i]``."""
    return jnp.max(jnp.stack([jnp.max(jnp.abs(w.astype(jnp.float32)), axis=-1) for w in ws]), axis=0)


def _scale_rows(w, s):  # w [L, K, N] * s[L, K]
    return (w.astype(jnp.float32) * s[:, :, None]).astype(w.dtype)


def _scale_cols(w, s, inverse=False):  # w [L, K, N] * s[L, N]  (or / s)
    f = w.astype(jnp.float32)
    return (f / s[:, None, :] if inverse else f * s[:, None, :]).astype(w.dtype)


def smooth_scales(params, cfg: LlamaConfig, stats: dict, config: SmoothQuantConfig = SmoothQuantConfig()) -> dict:
    """The per-site smoothing vectors ``{site: s}``: qkv ``[L, H]``, gate_up ``[L, H]``, down ``[L, F]``,
    o ``[L, Hkv, D]`` (float32)."""
    ly, a = params["layers"], float(config.alpha)
    out = {}
    if "qkv" in config.sites:
        out["qkv"] = smoothing_scale(stats["q"], _row_absmax(ly["wq"], ly["wk"], ly["wv"]), a, config.clip)
    if "gate_up" in config.sites:
        out["gate_up"] = smoothing_scale(stats["gate"], _row_absmax(ly["w_gate"], ly["w_up"]), a, config.clip)
    if "down" in config.sites:
        out["down"] = smoothing_scale(stats["down"], _row_absmax(ly["w_down"]), a, config.clip)
    if "o" in config.sites:
        n, hkv, g, d = cfg.num_layers, cfg.num_kv_heads, cfg.group_size, cfg.head_dim
        xo = jnp.max(jnp.asarray(stats["o"], jnp.float32).reshape(n, hkv, g, d), axis=2)
        wo = jnp.max(_row_absmax(ly["wo"]).reshape(n, hkv, g, d), axis=2)
        out["o"] = smoothing_scale(xo, wo, a, config.clip)
    return out


def apply_smoothing(params, cfg: LlamaConfig, scales: dict) -> dict:
    """Fold ``scales`` (from :func:`smooth_scales`) into a float params pytree; returns a new pytree (same
    structure, dtypes). The float model computes the same function (up to float rounding)."""
    ly = dict(params["layers"])
    if "qkv" in scales:
        s = scales["qkv"]
        ly["attn_norm"] = (ly["attn_norm"].astype(jnp.float32) / s).astype(ly["attn_norm"].dtype)
        for k in ("wq", "wk", "wv"):
            ly[k] = _scale_rows(ly[k], s)
    if "gate_up" in scales:
        s = scales["gate_up"]
        ly["ffn_norm"] = (ly["ffn_norm"].astype(jnp.float32) / s).astype(ly["ffn_norm"].dtype)
        for k in ("w_gate", "w_up"):
            ly[k] = _scale_rows(ly[k], s)
    if "down" in scales:
        s = scales["down"]
        ly["w_up"] = _scale_cols(ly["w_up"], s, inverse=True)
        ly["w_down"] = _scale_rows(ly["w_down"], s)
    if "o" in scales:
        s = scales["o"]                                         # [L, Hkv, D]
        n = s.shape[0]
        ly["wv"] = _scale_cols(ly["wv"], s.reshape(n, -1), inverse=True)
        s_q = jnp.broadcast_to(s[:, :, None, :], (n, cfg.num_kv_heads, cfg.group_size, cfg.head_dim))
        ly["wo"] = _scale_rows(ly["wo"], s_q.reshape(n, -1))
    return {**params, "layers": ly}


def smooth_params(params, cfg: LlamaConfig, stats: dict, config: SmoothQuantConfig = SmoothQuantConfig()) -> dict:
    """:func:`smooth_scales` then :func:`apply_smoothing`."""
    return apply_smoothing(params, cfg, smooth_scales(params, cfg, stats, config))
