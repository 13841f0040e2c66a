"""Serving through the Pallas decode-attention kernel (interpreted on CPU) matches the float32 reference path.

Regression: the interpreted kernel used ``precision="bf16x2"`` (hi + lo bf16 operands, ~16 mantissa bits), a
~1e-5 relative error per attention layer on SmolLM2-135M.  INT4 re-quantization of each new token's K/V amplifies
such differences step by step (a code flip is a 1/15 change), so greedy decodes diverged after a few dozen tokens.
Interpreted runs now default to float32 operands.
"""
import pytest

from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.serving.generate import generate


@pytest.mark.slow
@pytest.mark.model
def test_kernel_greedy_tokens_match_reference_int4(smollm):
    m = smollm
    prompt = m.tokenizer.encode_chat("Write a short story about a robot who learns to paint.")
    scheme = make_scheme("int4", rope_theta=m.cfg.rope_theta, rope_pairing=m.cfg.rope_pairing)
    out = {impl: generate(m.params, m.cfg, [prompt], max_new_tokens=64, scheme=scheme, eos_id=-1,
                          attention_impl=impl).tokens[0]
           for impl in ("reference", "kernel")}
    assert len(out["reference"]) == 64
    assert out["kernel"] == out["reference"]
