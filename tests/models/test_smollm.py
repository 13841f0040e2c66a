"""The real SmolLM2-135M-Instruct: parity with transformers, tokenizer parity, perplexity, generation, errors."""
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.models.llama import forward_nocache
from kvquant_jax.serving.generate import generate

from hf_reference import transformers_from_gguf, wiki_test_ids

pytestmark = pytest.mark.model

# transformers fp32 on the first 8x1024 tokens of the WikiText-2 test split (whole file tokenized once, no BOS,
# contiguous segments, mean NLL of 1023 predictions per segment), measured 2026-11-29 with transformers 5.24.0;
# the per-segment mean NLLs re-measured 2026-12-02 (transformers 5.24.0, fp32 logits, float64 log-softmax): their
# 8-segment ppl is 29.18533, the figure above.
TRANSFORMERS_PPL_8x1024 = 29.1851
TRANSFORMERS_SEGMENT_NLL_4DP = [2.6177, 3.3946, 3.1818, 3.3638, 3.8013, 3.4237, 3.7367, 3.4696]


@pytest.fixture(scope="module")
def wiki_ids(smollm, wikitext_test_path):
    return wiki_test_ids(smollm, wikitext_test_path)


@pytest.fixture(scope="module")
def hf_model(smollm):
    return transformers_from_gguf(smollm)


@pytest.mark.ref
def test_logits_parity_with_transformers(smollm, hf_model, wiki_ids):
    import torch

    ids = wiki_ids[1000:1256]
    ours = np.asarray(jax.jit(forward_nocache, static_argnums=1)(smollm.params, smollm.cfg,
                                                                 jnp.asarray([ids], jnp.int32)))[0]
    with torch.no_grad():
        ref = hf_model[0](torch.tensor([ids])).logits[0].numpy()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel


@pytest.mark.ref
def test_tokenizer_matches_transformers_on_whole_test_split(smollm, hf_model, wiki_ids, wikitext_test_path):
    from kvquant_jax.data import load_corpus

    text = load_corpus(str(wikitext_test_path)).text
    ref = hf_model[1](text, add_special_tokens=False)["input_ids"]
    assert len(ref) == len(wiki_ids) and ref == wiki_ids
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert smollm.tokenizer.apply_chat_template(msgs) == hf_model[1].apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_interleaved_rope_loading_gives_same_logits(smollm, wiki_ids):
    from kvquant_jax.models import load_model

    other = load_model(rope_pairing="interleaved")
    ids = jnp.asarray([wiki_ids[:64]], jnp.int32)
    f = jax.jit(forward_nocache, static_argnums=1)
    a, b = np.asarray(f(smollm.params, smollm.cfg, ids)), np.asarray(f(other.params, other.cfg, ids))
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-5
    # ... while the stored K rows really are in different channel orders
    assert not np.allclose(np.asarray(smollm.params["layers"]["wk"]), np.asarray(other.params["layers"]["wk"]))


@pytest.mark.slow
def test_kvq_ppl_matches_transformers(wikitext_test_path, smollm):
    """``kvq ppl`` (1024-token contiguous segments, no BOS) against transformers' per-segment NLLs.  CI scores the
    first 2 segments (2 x 1023 predictions; the second starts at token 1024, so the segmenting is checked; segments
    3-8 run the same code on other text), and the record of all 8 is held to the 8-segment ppl (29.1851)."""
    assert abs(math.exp(np.mean(TRANSFORMERS_SEGMENT_NLL_4DP)) / TRANSFORMERS_PPL_8x1024 - 1) < 1e-4
    out = subprocess.run([sys.executable, "-m", "kvquant_jax.cli", "ppl", "--corpus", str(wikitext_test_path),
                          "--seq-len", "1024", "--max-segments", "2"], capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["segments"] == 2 and row["seq_len"] == 1024 and row["tokens"] == 2 * 1023 and row["bos"] is False
    ref = math.exp(np.mean(TRANSFORMERS_SEGMENT_NLL_4DP[:2]))
    assert abs(row["ppl"] / ref - 1) < 0.005, (row["ppl"], ref)


def test_generate_france_paris(smollm):
    tok = smollm.tokenizer
    res = generate(smollm.params, smollm.cfg, [tok.encode_chat("What is the capital of France?")],
                   max_new_tokens=32)
    assert "Paris" in tok.decode(res.tokens[0])


def test_batched_generation_equals_one_at_a_time(smollm):
    tok = smollm.tokenizer
    prompts = [tok.encode_chat("What is the capital of France?"), tok.encode_chat("Name three colors."),
               tok.encode("The quick brown fox")]
    assert len({len(p) for p in prompts}) == 3
    batched = generate(smollm.params, smollm.cfg, prompts, max_new_tokens=16, capacity=128)
    for i, p in enumerate(prompts):
        single = generate(smollm.params, smollm.cfg, [p], max_new_tokens=16, capacity=128)
        assert single.tokens[0] == batched.tokens[i]


def test_generation_bad_inputs(smollm):
    with pytest.raises(ValueError, match="empty"):
        generate(smollm.params, smollm.cfg, [[5, 6], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="capacity"):
        generate(smollm.params, smollm.cfg, [[5] * 60], max_new_tokens=8, capacity=64)
    with pytest.raises(ValueError, match="context length"):
        generate(smollm.params, smollm.cfg, [[5] * 10], max_new_tokens=9000, capacity=9100)
