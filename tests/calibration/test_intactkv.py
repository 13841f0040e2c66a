"""IntactKV: extraction (vs a float64 NumPy oracle), Optax calibration, checkpoints, bit-exact artifacts."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.prefix import load_artifact, model_identity, save_artifact
from kvquant_jax.cache.static_int import per_token_int
from kvquant_jax.calibration.intactkv import (IntactKVConfig, bos_prefix, calibrate_intactkv, extract_prefix,
                                              heldout_error, layer_mse, system_prefix)
from kvquant_jax.calibration.prefix_model import artifact_rows, prefix_forward
from kvquant_jax.models.testing import random_params, tiny_config

CFG = tiny_config(head_dim=16, sha256="tiny-model-a")
PARAMS = random_params(CFG, seed=5)
TOK = "tok-hash-a"
RT = dict(rope_theta=CFG.rope_theta, rope_pairing=CFG.rope_pairing)


def oracle_prefix_kv(params, cfg, ids):
    """float64 NumPy LLaMA over ``ids`` at positions 0..P-1: per-layer post-RoPE K and V ``[L, Hkv, P, D]``."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    t, d, hq, hkv = len(ids), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    x = p["embed"][np.asarray(ids)]
    ang = np.arange(t)[:, None] * (cfg.rope_theta ** (-np.arange(0, d, 2) / d))[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(z):   # half_split pairing
        a, b = z[..., : d // 2], z[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def rms(z, w):
        return z / np.sqrt(np.mean(z * z, axis=-1, keepdims=True) + cfg.rms_eps) * w

    ks, vs = [], []
    for l in range(cfg.num_layers):
        lp = {k: v[l] for k, v in p["layers"].items()}
        h = rms(x, lp["attn_norm"])
        q = rope((h @ lp["wq"]).reshape(t, hq, d))
        k = rope((h @ lp["wk"]).reshape(t, hkv, d))
        v = (h @ lp["wv"]).reshape(t, hkv, d)
        ks.append(k.transpose(1, 0, 2))
        vs.append(v.transpose(1, 0, 2))
        kk, vv = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
        s = np.einsum("thd,shd->hts", q, kk) / np.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", pr, vv).reshape(t, hq * d) @ lp["wo"]
        h = rms(x, lp["ffn_norm"])
        g = h @ lp["w_gate"]
        x = x + (g / (1 + np.exp(-g)) * (h @ lp["w_up"])) @ lp["w_down"]
    return np.stack(ks), np.stack(vs)


class StubChatTokenizer:
    """ChatML-like stub: BOS = <|im_start|> (1), EOS = <|im_end|> (2), newline 9."""

    bos_id, eos_id, chat_template, hash = 1, 2, "stub-template", "stub-tok"

    def encode_chat(self, prompt, system=None):
        user = [40 + (ord(c) % 20) for c in prompt]
        return [1, 30, 9, 31, 32, 33, 2, 9] + [1, 34, 9] + user + [2, 9, 1, 35, 9]


def test_fixed_prefixes():
    tok = StubChatTokenizer()
    assert bos_prefix(tok) == [1]
    assert system_prefix(tok) == [1, 30, 9, 31, 32, 33, 2, 9]      # cut before the user turn's <|im_start|>

    class NoBos(StubChatTokenizer):
        def encode_chat(self, prompt, system=None):
            return super().encode_chat(prompt)[1:]

    assert system_prefix(NoBos()) == [1, 30, 9, 31, 32, 33, 2, 9]  # BOS prepended when the template lacks it


def test_extraction_matches_float64_oracle():
    ids = [1, 17, 4, 60, 33]
    art = extract_prefix(PARAMS, CFG, ids, tokenizer_hash=TOK)
    k, v = oracle_prefix_kv(PARAMS, CFG, ids)
    assert art.k.shape == (CFG.num_layers, CFG.num_kv_heads, len(ids), CFG.head_dim) and art.k.dtype == np.float32
    np.testing.assert_allclose(art.k, k, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(art.v, v, rtol=1e-4, atol=1e-4)
    idn = art.identity
    assert (idn.model_sha256, idn.tokenizer_hash, idn.prefix_token_ids) == ("tiny-model-a", TOK, tuple(ids))
    assert (idn.rope_theta, idn.rope_pairing, idn.key_stage, idn.dtype) == (CFG.rope_theta, "half_split",
                                                                             "post_rope", "fp32")
    assert art.kind == "intactkv-extracted" and art.visibility == "visible"
    # a model without a file hash is identified by its weights
    anon = extract_prefix(PARAMS, tiny_config(head_dim=16), ids[:1], tokenizer_hash=TOK)
    assert len(anon.identity.model_sha256) == 64
    assert anon.identity.model_sha256 != extract_prefix(random_params(tiny_config(head_dim=16), seed=6),
                                                        tiny_config(head_dim=16), ids[:1],
                                                        tokenizer_hash=TOK).identity.model_sha256


def test_ste_gradient_is_exact_for_a_lossless_body():
    """With a full-precision fp32 body the STE history equals the exact one: same loss and same gradient."""
    art = extract_prefix(PARAMS, CFG, [1, 9], tokenizer_hash=TOK)
    toks = jnp.asarray(np.random.default_rng(0).integers(3, CFG.vocab_size, (2, 8)), jnp.int32)
    pk, pv = artifact_rows(art)
    target = prefix_forward(PARAMS, CFG, toks, pk * 1.1, pv * 0.9, chunk=4, want=("hidden",))["hidden"]

    def loss(theta, body):
        out = prefix_forward(PARAMS, CFG, toks, theta["k"], theta["v"], body=body, chunk=4, want=("hidden",))
        return layer_mse(out["hidden"], target)

    theta = {"k": pk, "v": pv}
    l0, g0 = jax.value_and_grad(loss)(theta, None)
    l1, g1 = jax.value_and_grad(loss)(theta, FullPrecisionScheme(**RT))
    assert float(l0) > 0 and abs(float(l1) - float(l0)) <= 1e-6 * float(l0)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert float(jnp.max(jnp.abs(a))) > 0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)


def test_calibration_decreases_loss_reports_heldout_and_restores_bit_exactly(tmp_path):
    import orbax.checkpoint as ocp

    art = extract_prefix(PARAMS, CFG, [1, 9], tokenizer_hash=TOK)
    rng = np.random.default_rng(1)
    train = rng.integers(3, CFG.vocab_size, (4, 16)).astype(np.int32)
    held = rng.integers(3, CFG.vocab_size, (2, 16)).astype(np.int32)
    body = per_token_int(8, **RT)
    # start from damaged rows: the objective must pull them back toward what the full-precision model produces
    init = art.replace(k=art.k + rng.normal(0, 0.5, art.k.shape).astype(np.float32),
                       v=art.v + rng.normal(0, 0.5, art.v.shape).astype(np.float32))
    conf = IntactKVConfig(steps=12, batch=2, chunk=4, lr=5e-2, warmup=2, eval_every=4)
    cal, rec = calibrate_intactkv(PARAMS, CFG, art, body, train, held, config=conf, init=init,
                                  checkpoint_dir=tmp_path / "ckpt", corpus={"name": "random", "sha256": "x"})
    losses = rec["train_loss"]
    assert len(losses) == 12 and all(np.isfinite(losses))
    # the two training batches alternate: each one's loss fell
    assert losses[-2] < 0.7 * losses[0] and losses[-1] < 0.7 * losses[1]
    dist = lambda a: float(np.abs(a.k - art.k).mean() + np.abs(a.v - art.v).mean())  # noqa: E731
    assert dist(cal) < dist(init)
    steps = [c["step"] for c in rec["heldout_curve"]]
    assert steps == [0, 4, 8, 12]
    assert rec["heldout_after"] < rec["heldout_before"] and rec["selected_step"] > 0
    assert rec["heldout_after"] == min(c["heldout"] for c in rec["heldout_curve"])
    assert rec["equals_extracted"] is False and not cal.same_tensors(art)
    assert rec["optimizer"]["name"] == "adamw" and rec["corpus"]["sha256"] == "x"
    assert "straight-through" in rec["rounding_gradient"] and rec["extracted_artifact_id"] == art.artifact_id
    assert rec["init_artifact_id"] == init.artifact_id
    assert cal.kind == "intactkv-calibrated" and cal.identity == art.identity
    # held-out error recomputed independently of the training loop
    again = heldout_error(PARAMS, CFG, art, cal, body, held, chunk=4)
    assert abs(again - rec["heldout_after"]) <= 1e-5 * rec["heldout_after"]
    # the selected Orbax checkpoint holds exactly the calibrated rows
    mgr = ocp.CheckpointManager(tmp_path / "ckpt")
    assert rec["selected_step"] in mgr.all_steps()
    got = mgr.restore(rec["selected_step"], args=ocp.args.StandardRestore())["prefix"]
    assert np.asarray(got["k"])[:, 0].tobytes() == cal.k.tobytes()
    # the artifact file restores bit-exactly; a corrupted manifest is refused
    path = save_artifact(cal, tmp_path / "cal")
    back = load_artifact(path, expect=model_identity(CFG, TOK))
    assert back.same_tensors(cal) and back.artifact_id == cal.artifact_id
    assert back.provenance["calibration"]["selected_step"] == rec["selected_step"]
    with pytest.raises(FileExistsError):
        save_artifact(cal, path)
    man = json.loads((path / "manifest.json").read_text())
    man["sha256"]["v"] = "0" * 64
    (path / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match="sha256"):
        load_artifact(path)
    with pytest.raises(FileExistsError):
        calibrate_intactkv(PARAMS, CFG, art, body, train, held, config=conf, checkpoint_dir=tmp_path / "ckpt")


def test_cli_subcommands_are_registered(capsys):
    from kvquant_jax.cli import main

    for argv in (["intactkv", "extract", "--help"], ["intactkv", "calibrate", "--help"],
                 ["prefixquant", "discover", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--checkpoint-dir" in out and "--eta" in out
