"""PrefixQuant: outlier-token discovery, static scales that exclude prefix rows, hidden-prefix serving."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache import ops
from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.prefix import model_identity, start_request
from kvquant_jax.calibration.intactkv import extract_prefix
from kvquant_jax.calibration.prefixquant import (discover_prefix, fit_static_scale, outlier_mask, outlier_summary,
                                                 prefixquant_artifact, select_prefix, static_kv_scales)
from kvquant_jax.models.llama import forward
from kvquant_jax.models.testing import random_params, tiny_config
from kvquant_jax.serving.generate import generate
from kvquant_jax.serving.prefixed import generate_with_prefix

TOK = "tok-hash-a"
X = 50              # the token given a massive activation


def outlier_model():
    """A tiny model where token X produces a massive down_proj input (and a large key) in layer 0.

    Hidden dim 0 is reserved for X: every other embedding row is 0 there, so after RMSNorm only X points along it;
    layer 0's gate/up columns 0 and key weights read that dim with a large gain."""
    cfg = tiny_config(head_dim=16, sha256="tiny-outlier")
    p = random_params(cfg, seed=11)
    emb = np.array(p["embed"])
    emb[:, 0] = 0.0
    emb[X, :] = 0.0
    emb[X, 0] = 5.0
    lay = {k: np.array(v) for k, v in p["layers"].items()}
    lay["w_gate"][0, 0, :4] = 6.0
    lay["w_up"][0, 0, :4] = 6.0
    lay["wk"][0, 0, :] = 4.0
    params = {"embed": jnp.asarray(emb), "final_norm": p["final_norm"],
              "layers": {k: jnp.asarray(v) for k, v in lay.items()}}
    return cfg, params


CFG, PARAMS = outlier_model()


def calib_tokens(n, t, seed, with_x=True):
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, CFG.vocab_size, (n, t))
    toks[toks == X] = 3
    toks[:, 0] = CFG.bos_id
    if with_x:
        toks[np.arange(n), rng.integers(2, t, n)] = X
    return toks.astype(np.int32)


def test_selection_rule():
    bos = 1
    tokens = np.array([[1, 5, 9, 5, 7, 1],
                       [1, 9, 5, 3, 3, 4],
                       [1, 8, 8, 6, 2, 4]])
    flags = np.zeros_like(tokens, bool)
    flags[:, 0] = True                      # BOS: always an outlier, never counted
    flags[0, [1, 3, 5]] = True              # 5, 5, and a mid-sequence BOS (not counted)
    flags[1, [1, 2]] = True                 # 9, 5
    flags[2, [1, 2, 3]] = True              # 8, 8, 6
    d = select_prefix(tokens, flags, bos_id=bos, eta=64, tokenizer_hash=TOK)
    # counted per sequence: 2, 2, 3 -> mean 2.33 -> o = 2; by count: 5 (3), 8 (2), then 6 and 9 (1 each)
    assert d.o == 2 and d.outlier_token_ids == (5, 8) and d.prefix_token_ids == (5, 8, 1)
    assert d.mean_outlier_tokens == pytest.approx(7 / 3) and d.outlier_counts == {5: 3, 8: 2, 6: 1, 9: 1}
    assert d.bos_outlier_fraction == pytest.approx(4 / 4) and d.tokenizer_hash == TOK
    capped = select_prefix(tokens, flags, bos_id=bos, eta=64, tokenizer_hash=TOK, max_tokens=1)
    assert capped.prefix_token_ids == (5, 1)
    none = select_prefix(tokens, np.zeros_like(flags), bos_id=bos, eta=64, tokenizer_hash=TOK)
    assert none.prefix_token_ids == (1,) and none.o == 0
    # outlier_mask: eta times the per-(layer, sequence) median
    m = np.array([[[1.0, 1.0, 1.0, 10.0, 70.0]]])
    np.testing.assert_array_equal(outlier_mask(m, 8.0)[0, 0], [False, False, False, True, True])
    s = outlier_summary(m, 64.0)
    assert s["max_ratio"] == pytest.approx(70.0) and s["outlier_tokens_per_sequence"] == 1.0


def test_discovery_finds_the_injected_outlier_token():
    toks = calib_tokens(6, 16, seed=0)
    d = discover_prefix(PARAMS, CFG, toks, tokenizer_hash=TOK, eta=16.0)
    assert d.prefix_token_ids == (X, CFG.bos_id) and d.o == 1
    assert d.outlier_counts[X] == 6 and d.tokenizer_hash == TOK and d.eta == 16.0
    strict = discover_prefix(PARAMS, CFG, toks, tokenizer_hash=TOK, eta=1e6)
    assert strict.prefix_token_ids == (CFG.bos_id,)
    art = prefixquant_artifact(PARAMS, CFG, d, tokenizer_hash=TOK)
    assert art.kind == "prefixquant" and art.visibility == "hidden" and art.token_ids == (X, CFG.bos_id)
    assert art.identity.tokenizer_hash == TOK and art.provenance["discovery"]["prefix_token_ids"] == [X, 1]
    with pytest.raises(ValueError, match="tokenizer"):
        prefixquant_artifact(PARAMS, CFG, d, tokenizer_hash="another-tokenizer")


def test_static_scales_exclude_prefix_rows():
    art = extract_prefix(PARAMS, CFG, [X, CFG.bos_id], tokenizer_hash=TOK, kind="prefixquant", visibility="hidden")
    body = calib_tokens(3, 8, seed=3, with_x=False)[:, 1:]
    ks, vs, info = static_kv_scales(PARAMS, CFG, body, art, bits=4, method="amax")
    # independent reference: the same body rows run through llama.forward into a full-precision prefix cache
    cache = start_request(art, FullPrecisionScheme(rope_theta=CFG.rope_theta), 3, 2 + 7,
                          expect=model_identity(CFG, TOK))
    _, cache, ok = forward(PARAMS, CFG, jnp.asarray(body), cache)
    assert bool(ok)
    for layer in range(CFG.num_layers):
        k, v, _ = ops.decode_reference(cache, layer)
        kb, vb = np.abs(np.asarray(k)[:, :, 2:]), np.abs(np.asarray(v)[:, :, 2:])
        assert ks[layer] == pytest.approx(kb.max() / 7, rel=1e-4)
        assert vs[layer] == pytest.approx(vb.max() / 7, rel=1e-4)
    # the excluded prefix row really is an outlier: including it would have changed the layer-0 K scale a lot
    assert np.abs(art.k[0]).max() > 3 * ks[0] * 7
    assert info["population"].startswith("body rows only") and info["prefix_artifact"] == art.artifact_id
    # the mse search never does worse than amax on the same rows
    x = np.random.default_rng(0).standard_t(3, 4000).astype(np.float32)
    err = lambda s: np.mean((np.clip(np.rint(x / s), -7, 7) * s - x) ** 2)  # noqa: E731
    assert err(fit_static_scale(x, 4, "mse")) <= err(fit_static_scale(x, 4, "amax"))


def test_hidden_prefix_serving_positions_and_accounting():
    art = extract_prefix(PARAMS, CFG, [X, CFG.bos_id], tokenizer_hash=TOK, kind="prefixquant", visibility="hidden")
    expect = model_identity(CFG, TOK)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    full = FullPrecisionScheme(rope_theta=CFG.rope_theta)
    res, acct = generate_with_prefix(PARAMS, CFG, prompts, art, full, expect=expect, max_new_tokens=4, capacity=64,
                                     eos_id=-1)
    # greedy tokens equal a plain generation over the served sequence prefix + prompt (positions 0..)
    ref = generate(PARAMS, CFG, [[X, 1] + p for p in prompts], max_new_tokens=4, capacity=64, eos_id=-1)
    assert res.tokens == ref.tokens
    assert acct.prompt_tokens == [5, 3] and acct.hidden_prefix_tokens == 2 and acct.prefix_tokens == 2
    assert acct.cache_rows == [2 + 5 + 3, 2 + 3 + 3] and acct.capacity == 64 and acct.max_user_tokens == 62
    with pytest.raises(ValueError, match="capacity"):
        generate_with_prefix(PARAMS, CFG, [list(range(3, 62))], art, full, expect=expect, max_new_tokens=4,
                             capacity=64)
    with pytest.raises(ValueError, match="context length"):
        generate_with_prefix(PARAMS, dataclasses.replace(CFG, max_position=40), [list(range(3, 38))], art, full,
                             expect=model_identity(dataclasses.replace(CFG, max_position=40), TOK),
                             max_new_tokens=4, capacity=64)
    visible = art.replace(visibility="visible", kind="intactkv-extracted")
    with pytest.raises(ValueError, match="does not start with"):
        generate_with_prefix(PARAMS, CFG, prompts, visible, full, expect=expect, max_new_tokens=4, capacity=64)
