"""Perplexity paths: plain (no cache) = fast (chunked through the cache) = serving (prefill + T=1 decode) for a
full-precision cache, and the definitions line up for a lossy cache."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.eval.ppl import _segment_nll, perplexity
from kvquant_jax.eval.quantized_ppl import chunked_nll, make_nll_fn, serving_nll


def _plain(tiny, toks):
    cfg, params = tiny
    return np.asarray(_segment_nll(params, cfg, jnp.asarray(toks)), np.float64)


def test_full_precision_fast_equals_plain(tiny, tokens):
    cfg, params = tiny
    toks = tokens(2, 40)
    plain = _plain(tiny, toks)
    for chunk in (7, 40):          # a chunk that does not divide T (padded last chunk) and a single forward
        fast = np.asarray(chunked_nll(params, cfg, toks, make_scheme("fp32"), chunk), np.float64)
        assert fast.shape == plain.shape == (2, 39)
        np.testing.assert_allclose(fast, plain, rtol=0, atol=5e-5)


def test_full_precision_serving_equals_fast_equals_plain(tiny, tokens):
    cfg, params = tiny
    toks = tokens(2, 40, seed=1)
    prefill = 11
    plain = _plain(tiny, toks)
    fp = make_scheme("fp32")
    serving = np.asarray(serving_nll(params, cfg, toks, fp, prefill), np.float64)
    fast = np.asarray(chunked_nll(params, cfg, toks, fp, 16), np.float64)
    assert serving.shape == (2, 40 - prefill - 1)
    np.testing.assert_allclose(serving, plain[:, prefill:], rtol=0, atol=5e-5)
    np.testing.assert_allclose(serving, fast[:, prefill:], rtol=0, atol=5e-5)
    # and as perplexities on the same tokens
    ppl = [math.exp(x[:, prefill:].mean()) for x in (plain, fast)] + [math.exp(serving.mean())]
    assert max(ppl) / min(ppl) - 1 < 1e-5


def test_lossy_cache_paths_line_up(tiny, tokens):
    """chunk = 1 feeds every token alone: that IS the serving path with a 1-token prefill.  chunk >= T never reads
    the cache, so it equals plain perplexity even for a lossy cache.  A real lossy cache changes the NLL."""
    cfg, params = tiny
    toks = tokens(1, 33, seed=2)
    scheme = make_scheme("int4")
    one = np.asarray(chunked_nll(params, cfg, toks, scheme, 1), np.float64)
    serving = np.asarray(serving_nll(params, cfg, toks, scheme, 1), np.float64)
    np.testing.assert_allclose(one[:, 1:], serving, rtol=0, atol=5e-5)
    whole = np.asarray(chunked_nll(params, cfg, toks, scheme, 64), np.float64)
    np.testing.assert_allclose(whole, _plain(tiny, toks), rtol=0, atol=5e-5)
    assert np.abs(one - _plain(tiny, toks)).max() > 1e-3


def test_make_nll_fn_plugs_into_perplexity(tiny, tokens):
    cfg, params = tiny
    ids = tokens(1, 100, seed=3)[0].tolist()
    a = perplexity(params, cfg, ids, seq_len=32, max_segments=3)
    b = perplexity(params, cfg, ids, seq_len=32, max_segments=3, nll_fn=make_nll_fn(make_scheme("fp32"), chunk=8))
    assert b.segments == 3 and b.tokens == 3 * 31
    assert abs(a.nll - b.nll) < 5e-5


def test_bad_arguments_raise(tiny, tokens):
    cfg, params = tiny
    with pytest.raises(ValueError, match="chunk"):
        chunked_nll(params, cfg, tokens(1, 8), make_scheme("fp32"), 0)
    with pytest.raises(ValueError, match="prefill"):
        serving_nll(params, cfg, tokens(1, 8), make_scheme("fp32"), 7)


@pytest.mark.slow
@pytest.mark.model
def test_smollm_paths_agree_and_int8_is_close(smollm, wikitext_test_path):
    """On the real model: fp32 serving = fast = plain NLL on the same WikiText-2 tokens; INT8 moves ppl < 1%."""
    from kvquant_jax.data import load_corpus

    ids = smollm.tokenizer.encode(load_corpus(str(wikitext_test_path)).text[:4000])
    toks = np.asarray(ids[:97], np.int32)[None]
    p, c = smollm.params, smollm.cfg
    plain = np.asarray(_segment_nll(p, c, jnp.asarray(toks)), np.float64)
    fp = make_scheme("fp32", rope_theta=c.rope_theta)
    fast = np.asarray(chunked_nll(p, c, toks, fp, 32), np.float64)
    serving = np.asarray(serving_nll(p, c, toks, fp, 64), np.float64)
    np.testing.assert_allclose(fast, plain, rtol=0, atol=2e-3)
    np.testing.assert_allclose(serving, plain[:, 64:], rtol=0, atol=2e-3)
    q = np.asarray(serving_nll(p, c, toks, make_scheme("int8", rope_theta=c.rope_theta), 64), np.float64)
    assert abs(math.exp(q.mean()) / math.exp(plain[:, 64:].mean()) - 1) < 0.01


def test_serving_kl_and_top1_against_a_float64_oracle(tiny, tokens):
    """KL(reference || point) and top-1 agreement inside the decode scan equal a float64 NumPy computation on the
    two runs' own log-softmaxes; the baseline against itself gives KL 0 and agreement 1."""
    from kvquant_jax.eval.quantized_ppl import serving_decode

    cfg, params = tiny
    toks = tokens(2, 30, seed=5)
    ref = serving_decode(params, cfg, toks, make_scheme("fp32"), 9, return_logprobs=True)
    q = serving_decode(params, cfg, toks, make_scheme("int2"), 9, return_logprobs=True)
    got = serving_decode(params, cfg, toks, make_scheme("int2"), 9, reference_logprobs=ref["logprobs"])
    lr, lq = np.asarray(ref["logprobs"], np.float64), np.asarray(q["logprobs"], np.float64)
    want = np.sum(np.exp(lr) * (lr - lq), axis=-1)
    assert want.shape == (2, 20) and want.mean() > 1e-4            # a lossy cache: a KL the test can see
    np.testing.assert_allclose(got["kl"], want, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(got["agree"], (lr.argmax(-1) == lq.argmax(-1)).astype(np.float32))
    np.testing.assert_allclose(got["nll"], q["nll"], rtol=0, atol=0)
    same = serving_decode(params, cfg, toks, make_scheme("fp32"), 9, reference_logprobs=ref["logprobs"])
    np.testing.assert_allclose(same["kl"], 0.0, atol=1e-6)
    assert np.all(same["agree"] == 1.0)
    with pytest.raises(ValueError, match="reference_logprobs must be"):
        serving_decode(params, cfg, toks, make_scheme("fp32"), 9, reference_logprobs=ref["logprobs"][:, :3])


def test_serving_decode_in_row_blocks_equals_one_call(tiny, tokens):
    """Row blocks (a small ``block_bytes``: 2 rows per call of 5) give the same NLL, log-softmax, KL and top-1 as
    one call over every row: rows never interact, each block has its own fresh cache."""
    from kvquant_jax.eval.quantized_ppl import rows_per_block, serving_decode

    cfg, params = tiny
    toks = tokens(5, 24, seed=11)
    n = 24 - 7 - 1
    two_rows = 2 * 4 * n * cfg.vocab_size
    assert rows_per_block(n, cfg.vocab_size, 5, two_rows) == 2
    assert rows_per_block(n, cfg.vocab_size, 5, 1) == 1 and rows_per_block(n, cfg.vocab_size, 5, 1 << 40) == 5
    whole = serving_decode(params, cfg, toks, make_scheme("fp32"), 7, return_logprobs=True)
    blocked = serving_decode(params, cfg, toks, make_scheme("fp32"), 7, return_logprobs=True, block_bytes=two_rows)
    assert isinstance(blocked["logprobs"], np.ndarray) and blocked["logprobs"].shape == (5, n, cfg.vocab_size)
    # (another batch size may reassociate XLA's float32 sums: ~1e-5 of a log-probability, not a behaviour change)
    np.testing.assert_allclose(blocked["logprobs"], np.asarray(whole["logprobs"]), rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(blocked["nll"], whole["nll"], rtol=1e-5, atol=3e-5)
    q_whole = serving_decode(params, cfg, toks, make_scheme("int2"), 7, reference_logprobs=whole["logprobs"])
    q_blocked = serving_decode(params, cfg, toks, make_scheme("int2"), 7, reference_logprobs=blocked["logprobs"],
                               block_bytes=two_rows)
    assert q_whole["kl"].mean() > 1e-4                               # a lossy cache: a KL the test can see
    # Through int2 a ulp of another batch size can flip a stored code (a third of the row's range), which moves
    # one prediction by ~1e-4 (measured: 1.8e-4 on one NLL, 3e-4 on one KL of 1.5): NLL and KL to 1e-3 (rel and
    # abs); the top-1 may differ only at the odd near-tie (at most 2 of the 80 predictions).  Rows mixed or
    # shifted between blocks move NLLs by O(1) and most top-1s.
    for k in ("nll", "kl"):
        np.testing.assert_allclose(q_blocked[k], q_whole[k], rtol=1e-3, atol=1e-3, err_msg=k)
    for k in ("agree", "argmax"):
        assert (q_blocked[k] != q_whole[k]).sum() <= 2, k
    np.testing.assert_array_equal(q_blocked["first"], q_whole["first"])
    with pytest.raises(ValueError, match="reference_logprobs must be"):
        serving_decode(params, cfg, toks, make_scheme("int2"), 7, reference_logprobs=blocked["logprobs"][:3],
                       block_bytes=two_rows)
