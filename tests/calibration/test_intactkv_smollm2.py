"""IntactKV on the real SmolLM2: [BOS] + system-prompt rows, served at their real positions (slow, model)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.prefix import model_identity, start_request
from kvquant_jax.cache.schema import IncompatibleSchemaError
from kvquant_jax.calibration.intactkv import extract_prefix, system_prefix, template_hash
from kvquant_jax.models.llama import forward, forward_nocache


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_system_prefix_rows_reproduce_the_plain_forward(smollm):
    cfg, params, tok = smollm.cfg, smollm.params, smollm.tokenizer
    pre = system_prefix(tok)
    assert pre[0] == cfg.bos_id and len(pre) == 21
    assert tok.decode(pre, skip_special=False) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                                                   "trained by Hugging Face<|im_end|>\n")
    ids = tok.encode_chat("What is the capital of France?")
    assert ids[:len(pre)] == pre
    art = extract_prefix(params, cfg, pre, tokenizer_hash=tok.hash, template=template_hash(tok))
    assert art.identity.model_sha256 == cfg.sha256 and art.identity.template_hash == template_hash(tok)
    body = np.asarray([ids[len(pre):]], np.int32)
    cache = start_request(art, FullPrecisionScheme(rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing), 1,
                          len(ids), expect=model_identity(cfg, tok.hash))
    logits, cache, ok = forward(params, cfg, jnp.asarray(body), cache)
    ref = forward_nocache(params, cfg, jnp.asarray([ids], jnp.int32))[:, len(pre):]
    assert bool(ok) and int(cache.lengths[0]) == len(ids)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=2e-3, rtol=1e-3)
    assert int(jnp.argmax(logits[0, -1])) == int(jnp.argmax(ref[0, -1]))
    with pytest.raises(IncompatibleSchemaError, match="tokenizer_hash"):
        start_request(art, FullPrecisionScheme(rope_theta=cfg.rope_theta), 1, 64,
                      expect=model_identity(cfg, "0123456789abcdef"))
