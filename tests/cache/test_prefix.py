"""Prefix rows on the cache (cache/prefix.py): real positions, capacity accounting, compatibility, body frontiers."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache import ops
from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.interface import init_cache
from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.prefix import (PrefixArtifact, PrefixIdentity, PrefixScheme, model_identity, prefix_policy,
                                      prefix_rows, start_request)
from kvquant_jax.cache.reuse import reuse_prefix
from kvquant_jax.cache.schema import IncompatibleSchemaError
from kvquant_jax.cache.static_int import StaticIntScheme, load_static_scales, per_token_int
from kvquant_jax.calibration.intactkv import extract_prefix
from kvquant_jax.calibration.prefix_model import artifact_rows, init_body_state, prefix_forward
from kvquant_jax.models.llama import forward, forward_nocache
from kvquant_jax.models.testing import random_params, tiny_config

CFG = tiny_config(head_dim=16, sha256="tiny-model-a")
PARAMS = random_params(CFG, seed=3)
TOK = "tok-hash-a"
PREFIX = [1, 7, 11]
P = len(PREFIX)
RT = dict(rope_theta=CFG.rope_theta, rope_pairing=CFG.rope_pairing)
EXPECT = model_identity(CFG, TOK)
FULL = FullPrecisionScheme(**RT)
KIVI = KIVIScheme(k_bits=2, v_bits=2, group_size=4, v_group_size=8, residual=4, **RT)
INT4 = per_token_int(4, **RT)

_fwd = jax.jit(forward, static_argnames=("cfg",))


@pytest.fixture(scope="module")
def art():
    return extract_prefix(PARAMS, CFG, PREFIX, tokenizer_hash=TOK)


def body_tokens(b, t, seed=0):
    return np.random.default_rng(seed).integers(3, CFG.vocab_size, (b, t)).astype(np.int32)


def run_chunks(cache, toks, chunk):
    logits = []
    for j in range(0, toks.shape[1], chunk):
        lg, cache, ok = _fwd(PARAMS, CFG, jnp.asarray(toks[:, j:j + chunk]), cache)
        assert bool(ok)
        logits.append(lg)
    return jnp.concatenate(logits, axis=1), cache


def test_prefix_rows_at_real_positions_match_plain_forward(art):
    """prefix cache + body tokens == one plain full-precision forward over prefix + body (no cache at all)."""
    toks = body_tokens(2, 8)
    ref = forward_nocache(PARAMS, CFG, jnp.asarray(np.concatenate([np.tile(PREFIX, (2, 1)), toks], 1)))[:, P:]
    for chunk in (4, 1):              # chunked prefill, token-by-token decode
        cache = start_request(art, FULL, 2, P + 8, expect=EXPECT)
        assert np.asarray(cache.lengths).tolist() == [P, P]
        logits, cache = run_chunks(cache, toks, chunk)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=2e-4, rtol=2e-4)
        assert np.asarray(cache.lengths).tolist() == [P + 8] * 2
    # the positions really matter: the same rows placed at positions P.. without the prefix rows differ
    plain = forward_nocache(PARAMS, CFG, jnp.asarray(toks))
    assert float(jnp.max(jnp.abs(plain - ref))) > 1e-2


# chunked KIVI: multi-row appends wrap the residual rings, so the served forward must read the pre-append state
@pytest.mark.parametrize("body,chunk", [(KIVI, 4), (INT4, 1)], ids=["kivi2-chunked", "int4-decode"])
def test_calibration_forward_equals_served_cache(art, body, chunk):
    """The differentiable forward used by IntactKV / PrefixQuant equals llama.forward over start_request's cache."""
    toks = body_tokens(2, 12, seed=1)
    cache = start_request(art, body, 2, P + 12, expect=EXPECT)
    logits, _ = run_chunks(cache, toks, chunk)
    pk, pv = artifact_rows(art)
    out = prefix_forward(PARAMS, CFG, jnp.asarray(toks), pk, pv, body=body, chunk=chunk, want=("logits",))
    np.testing.assert_allclose(np.asarray(out["logits"]), np.asarray(logits), atol=2e-4, rtol=2e-4)
    exact = prefix_forward(PARAMS, CFG, jnp.asarray(toks), pk, pv, body=None, chunk=chunk, want=("logits",))
    assert float(jnp.max(jnp.abs(exact["logits"] - logits))) > 1e-3      # the body really is quantized


def test_static_body_scales_and_population(art):
    toks = body_tokens(1, 8, seed=2)
    body = StaticIntScheme(bits=4, calibration_id="t", **RT)
    ks = np.linspace(0.05, 0.2, CFG.num_layers).astype(np.float32)
    vs = np.linspace(0.03, 0.1, CFG.num_layers).astype(np.float32)
    cache = load_static_scales(start_request(art, body, 1, P + 8, expect=EXPECT), ks, vs)
    logits, cache = run_chunks(cache, toks, 4)
    with pytest.raises(ValueError, match="body rows"):
        load_static_scales(cache, ks, vs)
    st = init_body_state(body, CFG, 1, 8, k_scales=ks, v_scales=vs)
    pk, pv = artifact_rows(art)
    out = prefix_forward(PARAMS, CFG, jnp.asarray(toks), pk, pv, st, body=body, chunk=4)
    np.testing.assert_allclose(np.asarray(out["logits"]), np.asarray(logits), atol=2e-4, rtol=2e-4)


def test_body_scheme_sees_its_own_rows():
    """KIVI groups / residual frontiers of the body equal a plain KIVI cache holding the same rows."""
    rng = np.random.default_rng(0)
    hkv, d, n = 2, 8, 11
    idn = PrefixIdentity(model_sha256="m", tokenizer_hash="t", prefix_token_ids=(1, 2, 3), compute_dtype="fp32",
                         num_layers=2, num_kv_heads=hkv, head_dim=d, **{k: v for k, v in RT.items()})
    pre = rng.standard_normal((2, hkv, 3, d)).astype(np.float32)
    art = PrefixArtifact(k=pre, v=pre * 2, identity=idn)
    body = KIVIScheme(k_bits=2, v_bits=2, group_size=4, v_group_size=4, residual=4, **RT)
    pc = start_request(art, body, 2, 3 + 16, expect=idn.to_dict())
    plain = init_cache(body, num_layers=2, batch=2, capacity=16, num_kv_heads=hkv, head_dim=d)
    for t in (5, 1, 1, 4):        # prefill then decode steps: frontiers cross group / residual boundaries
        kv = [(rng.standard_normal((2, t, hkv, d)).astype(np.float32),
               rng.standard_normal((2, t, hkv, d)).astype(np.float32)) for _ in range(2)]
        pc, plain = ops.append(pc, kv, t), ops.append(plain, kv, t)
    assert np.asarray(pc.lengths).tolist() == [3 + n] * 2 and prefix_rows(pc) == 3
    for f in dataclasses.fields(plain.groups[0]):
        np.testing.assert_array_equal(np.asarray(getattr(pc.groups[0], f.name)),
                                      np.asarray(getattr(plain.groups[0], f.name)), err_msg=f.name)
    k, v, valid = ops.decode_reference(pc, 1)
    kp, vp, validp = ops.decode_reference(plain, 1)
    np.testing.assert_array_equal(np.asarray(k[:, :, :3]), np.broadcast_to(pre[1], (2, hkv, 3, d)))
    np.testing.assert_array_equal(np.asarray(v[:, :, 3:]), np.asarray(vp))
    assert np.asarray(valid).sum() == 2 * (3 + n) and np.asarray(validp).sum() == 2 * n
    ops.validate(pc)
    # fork / reorder move body rows and share the prefix; truncation into the prefix is refused
    f = ops.fork(pc, [1, 0, 0])
    assert f.groups[0].prefix_k.shape[1] == 1 and np.asarray(f.lengths).tolist() == [14, 14, 14]
    ops.validate(f)
    with pytest.raises(ValueError, match="prefix"):
        ops.truncate(pc, 2)
    assert np.asarray(ops.truncate(pc, 3).lengths).tolist() == [3, 3]


def test_capacity_counts_hidden_prefix_rows(art):
    cache = start_request(art, INT4, 2, P + 5, expect=EXPECT)
    assert cache.capacity == P + 5 and np.asarray(cache.lengths).tolist() == [P, P]
    assert cache.groups[0].k_codes.shape[3] == 5                  # body rows = capacity - prefix rows
    kv = [(np.ones((2, 6, CFG.num_kv_heads, CFG.head_dim), np.float32),) * 2] * CFG.num_layers
    with pytest.raises(ValueError, match="capacity"):
        ops.append(cache, kv, 6)                                  # P + 6 rows do not fit in P + 5
    ok = ops.append(cache, [(k[:, :5], v[:, :5]) for k, v in kv], 5)
    assert np.asarray(ok.lengths).tolist() == [P + 5] * 2
    with pytest.raises(ValueError, match="prefix"):
        start_request(art, INT4, 1, P, expect=EXPECT)
    nb = ops.resize(cache, P + 9)                                 # growing keeps the prefix rows
    assert nb.groups[0].k_codes.shape[3] == 9
    np.testing.assert_array_equal(np.asarray(nb.groups[0].prefix_k), np.asarray(cache.groups[0].prefix_k))


def test_reuse_refused_for_other_model_tokenizer_schema_accepted_for_exact(art):
    # artifact vs serving model
    for field, expect in (("model_sha256", model_identity(dataclasses.replace(CFG, sha256="tiny-model-b"), TOK)),
                          ("tokenizer_hash", model_identity(CFG, "tok-hash-b")),
                          ("rope_theta", model_identity(dataclasses.replace(CFG, rope_theta=500.0), TOK)),
                          ("compute_dtype", model_identity(CFG, TOK, compute_dtype="bf16"))):
        with pytest.raises(IncompatibleSchemaError, match=field) as e:
            start_request(art, INT4, 1, 16, expect=expect)
        assert [d[0] for d in e.value.compatibility.differences] == [field]
    with pytest.raises(IncompatibleSchemaError, match="prefix_token_ids"):
        start_request(art, INT4, 1, 16, expect={**EXPECT, "prefix_token_ids": [1]})
    # body scheme vs prefix rows
    with pytest.raises(IncompatibleSchemaError, match="rope_pairing"):
        start_request(art, per_token_int(4, rope_theta=CFG.rope_theta, rope_pairing="interleaved"), 1, 16,
                      expect=EXPECT)
    with pytest.raises(IncompatibleSchemaError, match="key_stage"):
        start_request(art, per_token_int(4, key_stage="pre_rope", **RT), 1, 16, expect=EXPECT)
    with pytest.raises(IncompatibleSchemaError, match="model_id"):
        start_request(art, per_token_int(4, model_id="other", **RT), 1, 16, expect=EXPECT)
    # a started prefix cache reused by another request: the full per-layer schema decides
    template = start_request(art, INT4, 1, P + 8, expect=EXPECT)
    cfg_b = dataclasses.replace(CFG, sha256="tiny-model-b")
    art_b = extract_prefix(PARAMS, cfg_b, PREFIX, tokenizer_hash=TOK)
    with pytest.raises(IncompatibleSchemaError, match="model_id") as e:
        reuse_prefix(template, prefix_policy(art_b, INT4), batch=2)
    assert any(f.endswith("model_id") for f, _, _ in e.value.compatibility.differences)
    art_t = extract_prefix(PARAMS, CFG, PREFIX, tokenizer_hash="tok-hash-b")
    with pytest.raises(IncompatibleSchemaError, match="tokenizer_hash"):
        reuse_prefix(template, prefix_policy(art_t, INT4), batch=2)
    with pytest.raises(IncompatibleSchemaError, match="payload"):
        reuse_prefix(template, prefix_policy(art, KIVI), batch=2)
    with pytest.raises(IncompatibleSchemaError, match="prefix_dtype"):
        reuse_prefix(template, prefix_policy(art, INT4, prefix_dtype="bf16"), batch=2)
    req = reuse_prefix(template, prefix_policy(art, INT4), batch=3)
    assert req.batch == 3 and np.asarray(req.lengths).tolist() == [P] * 3
    assert req.groups[0].prefix_k.shape[1] == 1                             # shared (batch axis 1), not copied
    assert isinstance(req.per_layer_schemes[0], PrefixScheme) and req.schemas[0].sink == P


def test_artifact_validation_errors(art):
    with pytest.raises(ValueError, match="shape"):
        PrefixArtifact(k=art.k[:, :, :2], v=art.v, identity=art.identity)
    with pytest.raises(ValueError, match="non-finite"):
        bad = np.array(art.k)
        bad[0, 0, 0, 0] = np.nan
        PrefixArtifact(k=bad, v=art.v, identity=art.identity)
    with pytest.raises(ValueError, match="tokenizer_hash"):
        dataclasses.replace(art.identity, tokenizer_hash="")
    with pytest.raises(ValueError):   # immutable tensors
        art.k[0, 0, 0, 0] = 1.0
