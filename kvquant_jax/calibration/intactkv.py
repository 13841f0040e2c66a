"""IntactKV (design notes 0x07G / 0x07H): extract the full-precision K/V of a fixed prefix, optionally calibrate it.

Extraction
    :func:`extract_prefix` runs the full-precision model (``llama.forward`` into a full-precision cache, the
    serving path itself) over a fixed prefix -- ``[BOS]`` (:func:`bos_prefix`) or ``[BOS] + the chat template's
    system block`` (:func:`system_prefix`) -- and returns its exact per-layer K/V as an immutable
    :class:`~kvquant_jax.cache.prefix.PrefixArtifact` (kind ``"intactkv-extracted"``) bound to the model sha256,
    tokenizer hash, prefix ids, RoPE convention, layout and dtype.

Calibration (a different variant, kind ``"intactkv-calibrated"``)
    The prefix K/V of every layer are the ONLY trainable parameters; the model is frozen.  Objective (per batch of
    calibration sequences = prefix + text)::

        loss = sum over layers l of mean_{b, t, h} (X_l^fp[b, t, h] - X_l^q[b, t, h])^2

    ``X_l^fp``: output of layer ``l`` (residual stream) of the full-precision model with the extracted prefix and
    exact history; ``X_l^q``: the same with the trainable prefix and the body history read through the quantized
    body scheme (chunked exactly like serving, :mod:`kvquant_jax.calibration.prefix_model`).  Body tokens only (the
    prefix is not recomputed).  Rounding: straight-through estimator (forward = dequantized rows, backward =
    identity); gradients reach the prefix rows through every attention that reads them.  Optimizer: AdamW with a
    warmup + cosine schedule and global-norm clipping (optax); steps are checkpointed with an Orbax
    ``CheckpointManager`` whose best-kept metric is the held-out loss, and the selected checkpoint is the
    lowest held-out loss among the saved steps (step 0 = the extracted prefix is a candidate, so calibration never
    returns something worse on held-out data than what it started from).  The record keeps optimizer, objective,
    corpus hash, steps, held-out error before/after and whether the final rows still equal the extracted ones.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.interface import CacheScheme, init_cache
from kvquant_jax.cache.prefix import PrefixArtifact, PrefixIdentity, model_identity
from kvquant_jax.calibration.prefix_model import artifact_rows, init_body_state, prefix_forward
from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.models.llama import forward


# ----------------------------------------------------------------------------------------------------------------
# fixed prefixes
# ----------------------------------------------------------------------------------------------------------------
def bos_prefix(tokenizer) -> list[int]:
    """``[BOS]``."""
    return [int(tokenizer.bos_id)]


def template_hash(tokenizer) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16]


def system_prefix(tokenizer) -> list[int]:
    """``[BOS] +`` the chat template's system block: the token ids every chat prompt starts with, cut before the
    first user turn.

    Derived, not hard-coded: the common token prefix of two chat renderings with different user messages, cut at
    the last occurrence of the BOS/turn-start token after position 0 (ChatML: ``<|im_start|>system ...<|im_end|>\\n``
    ends where ``<|im_start|>user`` begins, so the next token is a special token and the cut is BPE-stable).  BOS
    is prepended when the rendering does not start with it.
    """
    a = tokenizer.encode_chat("alpha beta")
    b = tokenizer.encode_chat("Zeta 42?")
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    common = a[:n]
    starts = [i for i, t in enumerate(common) if t == tokenizer.bos_id and i > 0]
    if starts:
        common = common[:starts[-1]]
    if not common:
        raise ValueError("system_prefix: the chat template renders no fixed prefix")
    return ([] if common[0] == tokenizer.bos_id else [int(tokenizer.bos_id)]) + [int(t) for t in common]


# ----------------------------------------------------------------------------------------------------------------
# extraction
# ----------------------------------------------------------------------------------------------------------------
def extract_prefix(params, cfg: LlamaConfig, prefix_ids: Sequence[int], *, tokenizer_hash: str,
                   compute_dtype: str = "fp32", dtype: str = "fp32", kind: str = "intactkv-extracted",
                   visibility: str = "visible", template: str = "", provenance: dict | None = None) -> PrefixArtifact:
    """Run the full-precision model over ``prefix_ids`` (positions ``0..P-1``) and keep its exact K/V.

    ``dtype`` is the stored tensor dtype ("fp32" keeps the rows bit-exact as the fp32 model produced them).
    """
    ids = [int(t) for t in prefix_ids]
    if not ids:
        raise ValueError("extract_prefix: empty prefix")
    if len(ids) > cfg.max_position:
        raise ValueError(f"extract_prefix: prefix of {len(ids)} tokens exceeds the context length {cfg.max_position}")
    scheme = FullPrecisionScheme(dtype=dtype, rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
    cache = init_cache(scheme, num_layers=cfg.num_layers, batch=1, capacity=len(ids), num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim)
    _, cache, ok = jax.jit(forward, static_argnames=("cfg",))(params, cfg, jnp.asarray([ids], jnp.int32), cache)
    if not bool(ok):
        raise ValueError("extract_prefix: the model produced non-finite K/V for the prefix")
    k = np.asarray(cache.groups[0].k[:, 0])      # [L, Hkv, P, D]
    v = np.asarray(cache.groups[0].v[:, 0])
    ident = model_identity(cfg, tokenizer_hash, compute_dtype=compute_dtype, params=params)
    identity = PrefixIdentity(**ident, prefix_token_ids=tuple(ids), dtype=dtype, template_hash=template)
    prov = {"extracted_by": "kvquant_jax.calibration.intactkv.extract_prefix",
            "model_name": getattr(cfg, "name", "")}
    prov.update(provenance or {})
    return PrefixArtifact(k=k, v=v, identity=identity, kind=kind, visibility=visibility, provenance=prov)


# ----------------------------------------------------------------------------------------------------------------
# calibration
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class IntactKVConfig:
    """Calibration recipe (defaults sized for a 2-core CPU; the paper's recipes are source-reported, not these).

    Attributes:
      steps: optimizer steps; batch: sequences per step; chunk: tokens per forward (serving chunking).
      lr: peak learning rate; warmup: linear warmup steps, then cosine decay to ``lr * end_lr_ratio``.
      weight_decay: AdamW decoupled decay (0 by default: decay would pull K/V rows toward zero).
      clip_norm: global gradient-norm clip.
      eval_every: held-out evaluation + checkpoint period (steps); step 0 and the last step are always saved.
      max_to_keep: checkpoints Orbax keeps (the best by held-out loss).
      seed: order of the training batches.
    """

    steps: int = 30
    batch: int = 4
    chunk: int = 64
    lr: float = 2e-3
    warmup: int = 3
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    eval_every: int = 5
    max_to_keep: int = 3
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.batch < 1 or self.eval_every < 1 or self.chunk < 1:
            raise ValueError(f"IntactKVConfig: steps, batch, chunk and eval_every must be >= 1: {self}")
        if not (self.lr > 0 and self.clip_norm > 0 and 0 <= self.end_lr_ratio <= 1 and self.weight_decay >= 0):
            raise ValueError(f"IntactKVConfig: bad optimizer settings: {self}")


def make_optimizer(c: IntactKVConfig):
    import optax

    warmup = min(c.warmup, c.steps - 1)
    sched = optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=c.lr, warmup_steps=warmup,
                                               decay_steps=max(c.steps, warmup + 1), end_value=c.lr * c.end_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(c.clip_norm),
                       optax.adamw(sched, weight_decay=c.weight_decay)), sched


def layer_mse(hidden, target):
    """sum over layers of the mean squared error (``[L, B, T, H]`` each) -> float32 scalar."""
    return jnp.sum(jnp.mean(jnp.square(hidden - target), axis=(1, 2, 3)))


def _teacher(params, cfg, tokens, art, chunk):
    pk, pv = artifact_rows(art)
    return prefix_forward(params, cfg, tokens, pk, pv, body=None, chunk=chunk, want=("hidden",))["hidden"]


def calibrate_intactkv(params, cfg: LlamaConfig, artifact: PrefixArtifact, body: CacheScheme, train_tokens,
                       heldout_tokens, *, config: IntactKVConfig = IntactKVConfig(), checkpoint_dir: str | Path,
                       corpus: dict | None = None, static_scales=None, init: PrefixArtifact | None = None,
                       log=None) -> tuple[PrefixArtifact, dict]:
    """Calibrate the prefix K/V of ``artifact`` against the quantized body scheme ``body``.

    Args:
      train_tokens, heldout_tokens: int ``[N, T]`` / ``[M, T]`` body token sequences (calibration split text; the
        prefix is prepended implicitly at positions ``0..P-1``).  ``T`` must be a multiple of ``config.chunk``.
      checkpoint_dir: Orbax ``CheckpointManager`` directory (must not hold checkpoints yet).
      corpus: provenance of the tokens, e.g. ``{"name": ..., "sha256": ..., "split": "validation"}``.
      static_scales: ``(k_scales, v_scales)`` for a static-scale body scheme.
      init: rows to start from (same identity; e.g. an earlier calibration); default the extracted rows.  The
        teacher always uses ``artifact``'s exact rows.
    Returns the calibrated artifact (kind ``"intactkv-calibrated"``, provenance = the record) and the record.
    """
    import optax
    import orbax.checkpoint as ocp

    train = np.asarray(train_tokens, np.int32)
    held = np.asarray(heldout_tokens, np.int32)
    if train.ndim != 2 or held.ndim != 2 or train.shape[1] != held.shape[1]:
        raise ValueError(f"calibrate_intactkv: token arrays must be [N, T] with one T, got {train.shape} and "
                         f"{held.shape}")
    if len(train) < config.batch:
        raise ValueError(f"calibrate_intactkv: {len(train)} training sequences for batch {config.batch}")
    if init is not None and (init.identity != artifact.identity or init.k.shape != artifact.k.shape):
        raise ValueError("calibrate_intactkv: init rows must have the artifact's identity and shape")
    t = train.shape[1]
    chunk = min(config.chunk, t)
    ckpt = Path(checkpoint_dir).absolute()
    if ckpt.exists() and any(ckpt.iterdir()):
        raise FileExistsError(f"calibrate_intactkv: checkpoint dir {ckpt} is not empty")
    log = log or (lambda *a: None)
    t0 = time.perf_counter()

    def body_state(b):
        if static_scales is None:
            return None
        return init_body_state(body, cfg, b, t, k_scales=static_scales[0], v_scales=static_scales[1])

    def batches(tokens):
        return [tokens[i:i + config.batch] for i in range(0, len(tokens), config.batch)]

    # teacher targets (full-precision model, extracted prefix, exact history)
    train_tgt = [_teacher(params, cfg, jnp.asarray(x), artifact, chunk) for x in batches(train)]
    held_b = batches(held)
    held_tgt = [_teacher(params, cfg, jnp.asarray(x), artifact, chunk) for x in held_b]
    train_b = batches(train)

    def loss_fn(theta, tokens, target, st):
        out = prefix_forward(params, cfg, tokens, theta["k"], theta["v"], st, body=body, chunk=chunk,
                             want=("hidden",))
        return layer_mse(out["hidden"], target)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))

    def heldout(theta):   # reuses the one compiled value-and-grad (compiling a loss-only twin costs more on CPU)
        tot = 0.0
        for x, tg in zip(held_b, held_tgt):
            tot += float(grad_fn(theta, jnp.asarray(x), tg, body_state(len(x)))[0]) * len(x)
        return tot / len(held)

    pk, pv = artifact_rows(init if init is not None else artifact)
    theta = {"k": pk, "v": pv}
    opt, _ = make_optimizer(config)
    opt_state = opt.init(theta)

    @jax.jit
    def apply_updates(grads, opt_state, theta):
        # optax mixes Python floats with int32 step counts; keep the repository's strict promotion elsewhere
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = opt.update(grads, opt_state, theta)
            return optax.apply_updates(theta, updates), opt_state

    options = ocp.CheckpointManagerOptions(max_to_keep=config.max_to_keep, best_fn=lambda m: m["heldout"],
                                           best_mode="min", keep_checkpoints_without_metrics=False,
                                           enable_async_checkpointing=False)
    mgr = ocp.CheckpointManager(ckpt, options=options)

    def save(step, theta, opt_state, err):
        mgr.save(step, args=ocp.args.StandardSave({"prefix": theta, "opt_state": opt_state}),
                 metrics={"heldout": float(err)})

    heldout_before = heldout(theta)
    curve = [{"step": 0, "heldout": heldout_before}]
    save(0, theta, opt_state, heldout_before)
    log(f"[intactkv] step 0 held-out {heldout_before:.6g}")
    order = np.random.default_rng(config.seed).permutation(len(train_b))
    losses, grad_norms = [], []
    for step in range(1, config.steps + 1):
        i = int(order[(step - 1) % len(order)])
        x = train_b[i]
        loss, grads = grad_fn(theta, jnp.asarray(x), train_tgt[i], body_state(len(x)))
        grad_norms.append(float(optax.global_norm(grads)))
        theta, opt_state = apply_updates(grads, opt_state, theta)
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"calibrate_intactkv: non-finite loss at step {step}")
        if step % config.eval_every == 0 or step == config.steps:
            err = heldout(theta)
            curve.append({"step": step, "heldout": err})
            save(step, theta, opt_state, err)
            log(f"[intactkv] step {step} train {losses[-1]:.6g} held-out {err:.6g}")
    mgr.wait_until_finished()
    best = int(mgr.best_step())
    restored = mgr.restore(best, args=ocp.args.StandardRestore({"prefix": theta, "opt_state": opt_state}))
    mgr.close()
    k = np.asarray(restored["prefix"]["k"])[:, 0].astype(artifact.k.dtype)
    v = np.asarray(restored["prefix"]["v"])[:, 0].astype(artifact.v.dtype)
    heldout_after = next(c["heldout"] for c in curve if c["step"] == best)
    calibrated_rows = PrefixArtifact(k=k, v=v, identity=artifact.identity, kind="intactkv-calibrated",
                                     visibility=artifact.visibility)
    equals = calibrated_rows.same_tensors(artifact)
    record: dict[str, Any] = {
        "variant": "intactkv-calibrated",
        "objective": "sum over layers of mean squared error between layer outputs (residual stream) of the "
                     "full-precision model (extracted prefix, exact history) and the quantized-cache model "
                     "(trainable prefix, body history through the body scheme); body tokens only",
        "rounding_gradient": "straight-through estimator (forward: dequantized rows; backward: identity)",
        "trainable": "prefix K (post-RoPE) and V of every layer; model frozen",
        "optimizer": {"name": "adamw", "peak_lr": config.lr, "schedule": "linear warmup + cosine decay",
                      "warmup_steps": min(config.warmup, config.steps - 1), "end_lr": config.lr * config.end_lr_ratio,
                      "weight_decay": config.weight_decay, "clip_global_norm": config.clip_norm,
                      "b1": 0.9, "b2": 0.999, "eps": 1e-8},
        "config": dataclasses.asdict(config),
        "body_scheme": body.schema.to_dict(),
        "body_config": body.config(),
        "static_scales": None if static_scales is None else [np.asarray(s, np.float32).tolist()
                                                                for s in static_scales],
        "corpus": dict(corpus or {}),
        "train_sequences": int(len(train)), "heldout_sequences": int(len(held)), "seq_len": int(t),
        "chunk": int(chunk), "steps": config.steps, "train_loss": losses, "grad_norm": grad_norms,
        "heldout_curve": curve, "selected_step": best, "selection": "lowest held-out loss among saved steps",
        "heldout_before": heldout_before, "heldout_after": heldout_after,
        "equals_extracted": bool(equals),
        "extracted_artifact_id": artifact.artifact_id,
        "init_artifact_id": (init if init is not None else artifact).artifact_id,
        "checkpoint_dir": str(ckpt),
        "seconds": time.perf_counter() - t0,
    }
    out = calibrated_rows.replace(provenance={**artifact.provenance, "calibration": record})
    record["artifact_id"] = out.artifact_id
    return out, record


def heldout_error(params, cfg: LlamaConfig, reference: PrefixArtifact, candidate: PrefixArtifact,
                  body: CacheScheme, tokens, *, chunk: int = 64, static_scales=None) -> float:
    """The calibration objective of ``candidate`` on ``tokens`` (teacher: ``reference``'s exact rows)."""
    x = jnp.asarray(np.asarray(tokens, np.int32))
    chunk = min(chunk, x.shape[1])
    target = _teacher(params, cfg, x, reference, chunk)
    st = None if static_scales is None else init_body_state(body, cfg, x.shape[0], x.shape[1],
                                                            k_scales=static_scales[0], v_scales=static_scales[1])
    pk, pv = artifact_rows(candidate)
    out = prefix_forward(params, cfg, x, pk, pv, st, body=body, chunk=chunk, want=("hidden",))
    return float(layer_mse(out["hidden"], target))
