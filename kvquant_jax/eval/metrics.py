"""The evaluation metrics of a resolved config, behind one interface: ``compute(session, cfg, metric) -> values``.

A :class:`Session` holds what several points share: loaded models, tokenized corpora, FP8 calibrations and the
full-precision reference generations, so a sweep loads the model and tokenizes the corpus once.
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from kvquant_jax.calibration import smoothattention as SA
from kvquant_jax.calibration import smoothquant as SQ
from kvquant_jax.calibration.kvquant import load as load_kvquant_calibration
from kvquant_jax.config import METRICS, CacheConfig, ExperimentConfig, SchemeSpec
from kvquant_jax.eval import calib
from kvquant_jax.eval.agreement import greedy_agreement, reference_generation
from kvquant_jax.eval.context import EvalModel, TokenizedCorpus, load_eval_model, tokenize_corpus
from kvquant_jax.eval.errors import bin_means, kv_errors
from kvquant_jax.eval.footprint import cache_footprint
from kvquant_jax.eval.passkey import passkey_accuracy
from kvquant_jax.eval.policy import Policy, build_policy, needs_fp8_artifact, needs_kvquant_artifact
from kvquant_jax.eval.ppl import perplexity
from kvquant_jax.eval.quantized_ppl import make_nll_fn, serving_decode
from kvquant_jax.models.w8a8 import apply_policy
from kvquant_jax.sharding import current_mesh, params_on_current_mesh

# metrics whose rows carry a delta against the full-precision baseline (same tokens, same settings)
DELTA_FIELDS = {"ppl": ("ppl", "nll"), "serving_ppl": ("ppl", "nll"), "passkey": ("mean",)}


def baseline_config(cfg: ExperimentConfig, spec: SchemeSpec) -> ExperimentConfig:
    """``cfg`` with every layer's cache replaced by the baseline scheme (no mixed layers, no calibration)."""
    return dataclasses.replace(cfg, cache=CacheConfig(scheme=spec))


class Session:
    """Caches shared by the points of a run.  ``artifact_dir``: where observed calibration artifacts are saved."""

    def __init__(self, artifact_dir=None, log=None):
        self.artifact_dir = artifact_dir
        self.log = log or (lambda msg: None)
        self._models: dict[str, EvalModel] = {}
        self._corpora: dict[tuple, TokenizedCorpus] = {}
        self._fp8: dict[tuple, object] = {}
        self._refs: dict[tuple, np.ndarray] = {}
        self._serving_refs: dict[tuple, jax.Array] = {}
        self._kvquant: dict[tuple, object] = {}
        self._placed: dict[tuple, EvalModel] = {}

    # ----- shared inputs
    def model(self, cfg: ExperimentConfig, raw: bool = False) -> EvalModel:
        """The config's model; with an ``activation`` block that transforms it (SmoothQuant / SmoothAttention
        folds, W8A8 weights + policy on ``cfg.activation``) the transformed one unless ``raw``."""
        key = cfg.digest("model")
        if key not in self._models:
            t0 = time.perf_counter()
            self._models[key] = load_eval_model(cfg.model)
            self.log(f"model {cfg.model.name}: loaded in {time.perf_counter() - t0:.1f} s")
        if raw or not cfg.activation.transforms_model:
            return self._on_mesh(self._models[key])
        tkey = cfg.digest("model", "activation", "data")
        if tkey not in self._models:
            self._models[tkey] = self._transformed(cfg, self._models[key])
        return self._on_mesh(self._models[tkey])

    def _on_mesh(self, m: EvalModel) -> EvalModel:
        """The model with its weights on the current mesh (``kvq eval/sweep --mesh``; unchanged without one),
        placed once per model and mesh."""
        mesh = current_mesh()
        if mesh is None:
            return m
        key = (id(m), id(mesh))
        if key not in self._placed:
            self._placed[key] = dataclasses.replace(m, params=params_on_current_mesh(m.params, m.cfg))
        return self._placed[key]

    def _transformed(self, cfg: ExperimentConfig, m: EvalModel) -> EvalModel:
        a = cfg.activation
        params, mcfg, notes = m.params, m.cfg, []
        if a.smooth_alpha is not None or a.smooth_attention_alpha is not None:
            c = self.calibration_corpus(cfg, "activation: smoothing statistics")
            windows = c.take(a.smooth_len, a.smooth_windows, "activation smoothing statistics")
            t0 = time.perf_counter()
            stats = SQ.collect_stats(params, mcfg, windows)
            if a.smooth_attention_alpha is not None:
                params = SA.smooth_attention(params, mcfg, stats, alpha=a.smooth_attention_alpha)
                notes.append(f"SmoothAttention α={a.smooth_attention_alpha}")
            if a.smooth_alpha is not None:
                params = SQ.smooth_params(params, mcfg, stats, SQ.SmoothQuantConfig(alpha=a.smooth_alpha,
                                                                                    sites=a.smooth_sites))
                notes.append(f"SmoothQuant α={a.smooth_alpha} {list(a.smooth_sites)}")
            self.log(f"smoothing statistics: {a.smooth_windows}x{a.smooth_len} tokens of {c.name} "
                     f"({time.perf_counter() - t0:.1f} s)")
        policy = a.policy()
        if policy is not None:
            params, mcfg = apply_policy(params, mcfg, policy)
            notes.append(f"W8A8 {list(policy.linears)} prefill={policy.prefill} decode={policy.decode}")
        self.log("model transforms: " + "; ".join(notes))
        return dataclasses.replace(m, params=params, cfg=mcfg)

    def corpus(self, cfg: ExperimentConfig, calibration: bool = False) -> TokenizedCorpus:
        d = cfg.data
        spec, split = (d.calibration_corpus, d.calibration_split) if calibration else (d.corpus, d.split)
        key = (cfg.digest("model"), spec, split, d.fallback, 0 if calibration else d.offset)
        if key not in self._corpora:
            t0 = time.perf_counter()
            try:
                c = tokenize_corpus(self.model(cfg, raw=True).tokenizer, spec, split, d.fallback, key[-1])
            except FileNotFoundError as e:
                what = "data.calibration_corpus" if calibration else "data.corpus"
                raise FileNotFoundError(f"{what}: {e}") from None
            self._corpora[key] = c
            self.log(f"corpus {c.name} ({c.source}): {len(c.ids)} tokens in {time.perf_counter() - t0:.1f} s")
        return self._corpora[key]

    def calibration_corpus(self, cfg: ExperimentConfig, what: str) -> TokenizedCorpus:
        """The calibration corpus, refused (``ValueError`` naming ``what``) when it is the evaluation text."""
        c = self.corpus(cfg, calibration=True)
        if c.sha256 == self.corpus(cfg).sha256:
            raise ValueError(f"{what}: the calibration text ({c.source}) is the evaluation text; set "
                             "data.calibration_corpus to other text")
        return c

    def fp8_calibration(self, cfg: ExperimentConfig):
        src = cfg.calibration.fp8_scales
        if src is None:
            return None
        m = self.model(cfg)
        key = (cfg.digest("model"), src, cfg.calibration.observe_tokens, cfg.data.calibration_corpus,
               cfg.data.calibration_split)
        if key not in self._fp8:
            if src == "observe":
                c = self.calibration_corpus(cfg, "calibration.fp8_scales: observe")
                cal = calib.observe_fp8(m.params, m.cfg, c.ids, cfg.calibration.observe_tokens, c.sha256)
                if self.artifact_dir is not None:
                    path = self.artifact_dir / f"fp8_scales_{cal.calibration_id.split(':')[-1]}.npz"
                    calib.save_fp8_artifact(cal, path)
                    cal = dataclasses.replace(cal, source=f"{cal.source} (saved to {path.name})")
                self.log(f"fp8 scales: {cal.calibration_id}")
            else:
                try:
                    cal = calib.load_fp8_artifact(src, m.cfg.num_layers)
                except FileNotFoundError as e:
                    raise FileNotFoundError(f"calibration.fp8_scales: {e}") from None
            self._fp8[key] = cal
        return self._fp8[key]

    def policy(self, cfg: ExperimentConfig) -> Policy:
        m = self.model(cfg)
        return build_policy(cfg.cache, m.cfg, fp8=self.fp8_calibration(cfg) if needs_fp8_artifact(cfg) else None,
                            kvquant=self.kvquant_calibration(cfg) if needs_kvquant_artifact(cfg) else None)

    def kvquant_calibration(self, cfg: ExperimentConfig):
        """The KVQuant artifact of ``calibration.kvquant``, checked against the model and tokenizer."""
        path = cfg.calibration.kvquant
        m = self.model(cfg)
        key = (cfg.digest("model"), path)
        if key not in self._kvquant:
            try:
                self._kvquant[key] = load_kvquant_calibration(path, expect_model=m.cfg,
                                                               expect_tokenizer_hash=m.tokenizer.hash)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"calibration.kvquant: {e}") from None
            except ValueError as e:
                raise ValueError(f"calibration.kvquant: {e}") from None
            self.log(f"kvquant calibration: {self._kvquant[key].calibration_id} ({path})")
        return self._kvquant[key]

    def serving_reference(self, cfg: ExperimentConfig, baseline: SchemeSpec, segs: np.ndarray, prefill: int,
                          attention_impl: str):
        """The baseline cache's serving-path run on ``segs``: ``nll [S, N]`` and the log-softmax ``logprobs
        [S, N, V]`` (device float32) of every scored step, the reference of the serving KL / top-1.  Cached per
        model (as the activation block transforms it), data, baseline and segments; only the latest is kept."""
        key = (cfg.digest("model", "activation", "data"), str(baseline), segs.tobytes(), prefill, attention_impl)
        if key not in self._serving_refs:
            m = self.model(cfg)
            self._serving_refs = {key: serving_decode(m.params, m.cfg, segs,
                                                      self.policy(baseline_config(cfg, baseline)), prefill,
                                                      attention_impl=attention_impl, return_logprobs=True)}
        return self._serving_refs[key]

    def reference_generation(self, cfg: ExperimentConfig, baseline: SchemeSpec, prompts: np.ndarray, n: int):
        key = (cfg.digest("model"), cfg.digest("data"), str(baseline), prompts.tobytes(), n)
        if key not in self._refs:
            m = self.model(cfg)
            self._refs[key] = reference_generation(m.params, m.cfg, prompts,
                                                   self.policy(baseline_config(cfg, baseline)), n)
        return self._refs[key]


def compute(session: Session, cfg: ExperimentConfig, metric: str, *,
            baseline: SchemeSpec = SchemeSpec("fp32")) -> dict:
    """Values of one metric for one resolved config (plain JSON types)."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {list(METRICS)}")
    m = session.model(cfg)
    policy = session.policy(cfg)
    t = getattr(cfg.tasks, metric)
    if metric == "bytes":
        return cache_footprint(policy, m.cfg, t.length)
    what, n = _context_needed(metric, t)
    if n > m.cfg.max_position:
        raise ValueError(f"tasks.{metric}: {what} = {n} exceeds the context length {m.cfg.max_position} of model "
                         f"{m.cfg.name}")
    corpus = session.corpus(cfg)
    if metric == "ppl":
        r = perplexity(m.params, m.cfg, corpus.ids.tolist(), seq_len=t.seq_len, max_segments=t.max_segments,
                       batch_size=t.batch_size, nll_fn=make_nll_fn(policy, t.chunk),
                       bos_id=m.cfg.bos_id if m.cfg.bos_required else None)    # the model's protocol (kvq ppl)
        if r.segments < t.max_segments:
            raise ValueError(f"tasks.ppl: corpus {corpus.name} has only {r.segments} segments of {t.seq_len} tokens, "
                             f"max_segments is {t.max_segments}")
        return {"ppl": r.ppl, "nll": r.nll, "tokens": r.tokens, "segments": r.segments, "seq_len": t.seq_len,
                "chunk": t.chunk, "segment_nll": r.segment_nll, **({"bos": True} if r.bos else {})}
    if metric == "serving_ppl":
        segs = corpus.take(t.prefill + t.decode + 1, t.segments, "tasks.serving_ppl")
        ref = session.serving_reference(cfg, baseline, segs, t.prefill, t.attention)
        if cfg.digest() == baseline_config(cfg, baseline).digest():      # the baseline row: its own reference
            r = {"nll": ref["nll"], "kl": np.zeros_like(ref["nll"]), "agree": np.ones_like(ref["nll"])}
        else:
            r = serving_decode(m.params, m.cfg, segs, policy, t.prefill, attention_impl=t.attention,
                               reference_logprobs=ref["logprobs"])
        nll, kl = np.asarray(r["nll"], np.float64), np.asarray(r["kl"], np.float64)
        return {"ppl": math.exp(float(nll.mean())), "nll": float(nll.mean()), "tokens": int(nll.size),
                "prefill": t.prefill, "decode": t.decode, "segments": t.segments,
                "segment_nll": nll.mean(axis=1).tolist(),
                "nll_by_step": bin_means(nll.mean(axis=0), 16),
                # against the baseline cache on the same tokens, every scored step of the serving path
                "kl": float(kl.mean()), "segment_kl": kl.mean(axis=1).tolist(),
                "top1": float(np.mean(r["agree"]))}
    if metric == "passkey":
        return passkey_accuracy(m.params, m.cfg, m.tokenizer, policy, lengths=t.lengths, depths=t.depths,
                                trials=t.trials, digits=t.digits, max_new_tokens=t.max_new_tokens,
                                batch_size=t.batch_size, seed=t.seed)
    if metric == "kv_error":
        toks = corpus.take(t.seq_len, 1, "tasks.kv_error")[0]
        return kv_errors(m.params, m.cfg, toks, policy, prefill=t.prefill, probes=t.probes,
                         position_bins=t.position_bins)
    if metric == "agreement":
        prompts = corpus.take(t.prompt_tokens, t.segments, "tasks.agreement")
        ref = session.reference_generation(cfg, baseline, prompts, t.new_tokens)
        return greedy_agreement(m.params, m.cfg, prompts, policy, ref)
    raise AssertionError(metric)


def _context_needed(metric: str, t) -> tuple[str, int]:
    """The longest sequence a task runs the model on (must fit the model's context)."""
    if metric in ("ppl", "kv_error"):
        return "seq_len", t.seq_len
    if metric == "serving_ppl":
        return "prefill + decode + 1", t.prefill + t.decode + 1
    if metric == "agreement":
        return "prompt_tokens + new_tokens", t.prompt_tokens + t.new_tokens
    return "max(lengths) + max_new_tokens", max(t.lengths) + t.max_new_tokens


def deltas(metric: str, values: dict, base: dict) -> dict:
    """``<field>`` differences against the baseline's values (``delta_<field>``), for :data:`DELTA_FIELDS`."""
    return {f"delta_{f}": values[f] - base[f] for f in DELTA_FIELDS.get(metric, ()) if f in values and f in base}
