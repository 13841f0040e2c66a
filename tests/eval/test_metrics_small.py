"""Bytes per token / bits per element, passkey prompts and scoring, greedy agreement."""
import numpy as np
import pytest

from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.eval.context import ByteTokenizer
from kvquant_jax.eval.footprint import cache_footprint
from kvquant_jax.eval.policy import Policy


@pytest.mark.parametrize("spec, payload_bits", [("fp32", 32.0), ("bf16", 16.0), ("fp8_e4m3", 8.0)])
def test_unscaled_formats_bits(tiny, spec, payload_bits):
    cfg, _ = tiny
    f = cache_footprint(make_scheme(spec), cfg, 64)
    elems = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 64
    qparams = 2 * cfg.num_layers * cfg.num_kv_heads * 4 if spec.startswith("fp8") else 0   # fp32 [Hkv] K and V
    expect = payload_bits * elems / 8 + qparams + 4                                          # + lengths int32[1]
    assert f["logical_bytes"] == expect
    assert f["bits_per_element"] == pytest.approx(8 * expect / elems)
    assert f["ledger_matches_measured"] and f["measured_bytes"] == f["physical_bytes"]


def test_int4_per_token_bits_by_hand(tiny):
    cfg, _ = tiny
    d = cfg.head_dim
    f = cache_footprint(make_scheme("int4"), cfg, 64)
    # 4-bit codes + one fp16 scale per (token, head) for K and V, plus 4 bytes of lengths
    assert f["bits_per_element_excl_metadata"] == pytest.approx(4 + 16 / d)
    assert f["bytes_per_token"] == pytest.approx(f["logical_bytes"] / 64)
    assert not f["simulated"] and f["ledger_matches_measured"]


def test_mixed_policy_sums_layers(tiny):
    cfg, _ = tiny
    full, int4 = make_scheme("fp32"), make_scheme("int4")
    mixed = cache_footprint(Policy(schemes=(full, int4)), cfg, 64)
    a, b = cache_footprint(full, cfg, 64), cache_footprint(int4, cfg, 64)
    assert mixed["logical_bytes"] == pytest.approx((a["logical_bytes"] + b["logical_bytes"]) / 2)
    assert mixed["measured_bytes"] == (a["measured_bytes"] - 4 + b["measured_bytes"] - 4) // 2 + 4   # one lengths


def test_passkey_prompt_has_exact_length_and_depth():
    from kvquant_jax.eval.passkey import FILLER, NEEDLE, first_number, make_prompt

    tok = ByteTokenizer()
    for depth in (0.0, 0.5, 1.0):
        ids = make_prompt(tok, 700, depth, "40417")
        assert len(ids) == 700
        text = tok.decode(ids)
        needle = NEEDLE.format(key="40417")
        at = text.index(needle)
        before = text[:at].count(FILLER)
        total = text.count(FILLER)
        assert abs(before - depth * total) <= 1
    assert first_number(" 40417. Remember") == "40417" and first_number("none") == ""
    with pytest.raises(ValueError, match="shorter than the fixed text"):
        make_prompt(tok, 100, 0.5, "1")


def test_passkey_scores_the_generated_number(tiny, monkeypatch):
    """Scoring: a decode that emits the key is correct, any other number is not."""
    from kvquant_jax.eval import passkey, quantized_ppl

    cfg, params = tiny
    tok = ByteTokenizer()

    def fake_decode(params_, cfg_, policy, prompts, n, **kw):
        texts = [tok.decode(p.tolist()) for p in prompts]
        keys = [passkey.first_number(t[t.index("pass key is"):]) for t in texts]
        gen = [tok.encode(" " + (k if i % 2 == 0 else "0" + k)) for i, k in enumerate(keys)]
        gen = np.asarray([g[: n + 1] + [0] * (n + 1 - len(g[: n + 1])) for g in gen], np.int32)
        return {"first": gen[:, 0], "argmax": gen[:, 1:], "nll": np.zeros(gen[:, 1:].shape)}

    monkeypatch.setattr(quantized_ppl, "decode", fake_decode)
    r = passkey.passkey_accuracy(params, cfg, tok, make_scheme("fp32"), lengths=[320], depths=[0.0, 1.0],
                                 trials=1, digits=5, max_new_tokens=8, batch_size=2, seed=0)
    assert r["accuracy"] == [[1.0, 0.0]] and r["mean"] == 0.5


def test_passkey_runs_on_a_model(tiny):
    from kvquant_jax.eval.passkey import passkey_accuracy

    cfg, params = tiny
    r = passkey_accuracy(params, cfg, ByteTokenizer(), make_scheme("int8"), lengths=[300], depths=[0.0, 0.5, 1.0],
                         trials=1, digits=3, max_new_tokens=3, batch_size=3, seed=0)
    assert np.asarray(r["accuracy"]).shape == (1, 3) and len(r["answers"][0][2]) == 1


def test_greedy_agreement(tiny, tokens):
    from kvquant_jax.eval.agreement import greedy_agreement, reference_generation

    cfg, params = tiny
    prompts = tokens(2, 12, seed=4)
    fp = make_scheme("fp32")
    ref = reference_generation(params, cfg, prompts, fp, 10)
    assert ref.shape == (2, 11)
    same = greedy_agreement(params, cfg, prompts, fp, ref)
    assert same["match"] == 1.0 and same["top1"] == 1.0 and same["first_divergence"] == [10, 10]
    # a reference that differs from step 3 on: free-running matches until 3, teacher-forced top-1 drops
    bad = ref.copy()
    bad[:, 4:] = (bad[:, 4:] + 1) % cfg.vocab_size
    r = greedy_agreement(params, cfg, prompts, fp, bad)
    assert r["first_divergence"] == [3, 3] and r["match"] == pytest.approx(3 / 10)
    assert r["top1"] < 1.0
