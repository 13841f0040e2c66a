"""The continuous-batching engine (serving/engine.py) on a tiny random model.

Engine outputs on a seeded trace equal ``serving.generate`` run one request at a time (same prefill chunk)
token for token -- full precision with a pool small enough to force preemption (recompute) and prefix-cache
hits, and quantized caches (INT8 per token, KIVI-2) -- plus streaming, per-request sampling and the bad-input
errors of the issue.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvquant_jax.cache import paged
from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.per_token import PerTokenScheme
from kvquant_jax.cache.schema import IncompatibleSchemaError
from kvquant_jax.models.testing import random_params, tiny_config
from kvquant_jax.serving.engine import (Engine, EngineConfig, Request, read_trace, summarize, synthetic_trace,
                                        write_trace)
from kvquant_jax.serving.generate import generate
from kvquant_jax.serving.sampling import SamplingParams

CFG = tiny_config(max_position=128)
PARAMS = dict(random_params(CFG, seed=0))
PARAMS["embed"] = PARAMS["embed"] * 0.2          # small embeddings: diverse greedy continuations, not one token
CHUNK = PAGE = 8


def _trace(n=7, seed=1, shared=16):
    return synthetic_trace(n, rate=0, prompt_range=(3, 40), output_range=(4, 14), vocab_size=CFG.vocab_size,
                           seed=seed, shared_prefix=shared)


def _one_at_a_time(reqs, scheme=None):
    return {r.id: generate(PARAMS, CFG, [list(r.prompt)], max_new_tokens=r.max_new_tokens, scheme=scheme,
                           prefill_chunk=CHUNK).tokens[0] for r in reqs}


@pytest.fixture(scope="module")
def fp32_reference():
    reqs = _trace()
    return reqs, _one_at_a_time(reqs)


def test_full_precision_equals_one_at_a_time_with_preemption_and_prefix_hits(fp32_reference):
    reqs, want = fp32_reference
    distinct = {t for toks in want.values() for t in toks}
    assert len(distinct) >= 10, "degenerate reference outputs would make the comparison weak"
    eng = Engine(PARAMS, CFG, None, EngineConfig(num_slots=3, page_size=PAGE, num_pages=12, max_pages=8,
                                                 chunk=CHUNK, admission="optimistic"))
    res = eng.run(reqs)
    for r in reqs:
        assert res[r.id].tokens == want[r.id], f"request {r.id}"
    stats = summarize(res, 1.0, eng.peak_running)
    assert stats["preemptions"] > 0, "the pool must run out (preemption path untested otherwise)"
    assert stats["prefix_hit_tokens"] > 0 and eng.peak_running == 3
    paged.validate(eng.cache, eng.pool, eng.prefixes.references())      # no leak: pool == table + prefix refs
    # paged-direct: decode rows [3, 1], prefill rows [3, CHUNK]; views on the 4-rung ladder, windows bucketed
    assert {(t, r) for t, r, _, _ in eng.step_shapes} == {(1, 3), (CHUNK, 3)}
    assert len(eng.step_shapes) <= 2 * len(eng.ladder) * 2, eng.step_shapes
    assert eng.paths["full/append/decode"] == "window" and eng.paths["full/append/prefill"] == "window"
    assert not (np.asarray(eng.cache.page_table) >= 0).any(), "finished requests must release their pages"


def test_comparison_has_teeth(fp32_reference):
    """Changing one early token of a prompt changes the continuation: outputs depend on the whole history."""
    reqs, want = fp32_reference
    r = reqs[2]
    mutated = dataclasses.replace(r, prompt=(r.prompt[0] % 90 + 5,) + r.prompt[1:])
    assert _one_at_a_time([mutated])[r.id] != want[r.id]


@pytest.mark.parametrize("scheme", [PerTokenScheme(bits=8, rope_theta=CFG.rope_theta),
                                    KIVIScheme(k_bits=2, v_bits=2, group_size=4, v_group_size=4, residual=8,
                                               rope_theta=CFG.rope_theta)], ids=["int8", "kivi2"])
def test_quantized_equals_one_at_a_time(scheme):
    reqs = _trace(n=5, seed=2)
    want = _one_at_a_time(reqs, scheme)
    eng = Engine(PARAMS, CFG, scheme, EngineConfig(view_buckets=1, num_slots=3, page_size=PAGE, num_pages=40, max_pages=8,
                                                   chunk=CHUNK))
    res = eng.run(reqs)
    for r in reqs:
        assert res[r.id].tokens == want[r.id], f"request {r.id}"
    assert sum(x.prefix_hit_tokens for x in res.values()) > 0


def test_streaming_and_per_request_sampling():
    base = _trace(n=3, seed=3, shared=0)
    reqs = [base[0], dataclasses.replace(base[1], sampling=SamplingParams(temperature=0.8, top_k=5, top_p=0.9)),
            dataclasses.replace(base[2], sampling=SamplingParams(temperature=1.0, top_k=1), stop=(999,))]
    eng = Engine(PARAMS, CFG, None, EngineConfig(view_buckets=1, num_slots=2, page_size=PAGE, num_pages=20, max_pages=8,
                                                 chunk=CHUNK, prefix_cache=False))
    events = list(eng.stream(reqs))
    streamed = {r.id: [e.token for e in events if e.request_id == r.id and e.token is not None] for r in reqs}
    assert streamed == {k: v.tokens for k, v in eng.results.items()}
    assert all(sum(e.finished for e in events if e.request_id == r.id) == 1 for r in reqs)
    greedy = _one_at_a_time([reqs[0], reqs[2]])
    assert eng.results[reqs[0].id].tokens == greedy[reqs[0].id]
    assert eng.results[reqs[2].id].tokens == greedy[reqs[2].id][: len(eng.results[reqs[2].id].tokens)]  # top-k 1
    # the sampled request's stream depends only on its own key: alone in another engine it is the same
    alone = Engine(PARAMS, CFG, None, EngineConfig(view_buckets=1, num_slots=2, page_size=PAGE, num_pages=20, max_pages=8,
                                                   chunk=CHUNK, prefix_cache=False)).run([reqs[1]])
    assert alone[reqs[1].id].tokens == eng.results[reqs[1].id].tokens
    assert all(0 <= t < CFG.vocab_size for t in eng.results[reqs[1].id].tokens)


def test_trace_round_trip(tmp_path):
    reqs = _trace(n=4, seed=5)
    p = tmp_path / "trace.jsonl"
    write_trace(reqs, str(p))
    assert read_trace(str(p)) == reqs
    p.write_text('{"id": 1, "prompt": [1, 2]}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1: bad trace line"):
        read_trace(str(p))


def test_bad_input_errors():
    eng = Engine(PARAMS, CFG, None, EngineConfig(view_buckets=1, num_slots=2, page_size=PAGE, num_pages=4, max_pages=8,
                                                 chunk=CHUNK))
    with pytest.raises(ValueError, match="exceeds the context of 64 tokens"):
        eng.submit(Request(0, tuple(range(3, 60)), 10))
    with pytest.raises(ValueError, match="needs 5 pages of 8 rows but the pool has 4: it cannot fit even alone"):
        eng.submit(Request(1, tuple(range(3, 33)), 8))
    with pytest.raises(ValueError, match="empty prompt"):
        eng.submit(Request(2, (), 4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit(Request(3, (5, 500), 4))
    big = Engine(PARAMS, tiny_config(max_position=40), None, EngineConfig(view_buckets=1, num_slots=1, page_size=PAGE,
                                                                            num_pages=8, max_pages=8))
    with pytest.raises(ValueError, match="model max_position 40"):
        big.submit(Request(4, tuple(range(3, 40)), 8))


def test_prefix_from_another_schema_is_refused_naming_fields():
    reqs = _trace(n=1, seed=6)
    q = Engine(PARAMS, CFG, PerTokenScheme(bits=8, rope_theta=CFG.rope_theta),
               EngineConfig(view_buckets=1, num_slots=1, page_size=PAGE, num_pages=12, max_pages=8, chunk=CHUNK))
    q.run(reqs)
    assert q.prefixes.entries
    f = Engine(PARAMS, CFG, None, EngineConfig(view_buckets=1, num_slots=1, page_size=PAGE, num_pages=12, max_pages=8, chunk=CHUNK))
    f.prefixes = q.prefixes                       # e.g. a prefix store shared between engines
    f.submit(dataclasses.replace(reqs[0], id=99))
    with pytest.raises(IncompatibleSchemaError, match=r"layer0\.key\.payload: 'int8' != 'fp32'"):
        f.step()


def test_kvq_serve_bench_cli(capsys):
    import json

    from kvquant_jax.cli import main

    rc = main(["serve-bench", "--model", "tiny", "--cache", "int4", "--synthetic", "6", "--rate", "50",
               "--prompt-len", "8", "40", "--output-len", "4", "12", "--shared-prefix", "16", "--slots", "3",
               "--page-size", "8", "--num-pages", "40", "--chunk", "16"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["requests"] == 6 and out["output_tokens"] > 0 and out["prefix_hit_tokens"] > 0
    assert out["peak_concurrent"] >= 2 and out["ttft_p50_s"] > 0
    rc = main(["serve-bench", "--model", "tiny", "--synthetic", "2", "--page-size", "8", "--num-pages", "2",
               "--prompt-len", "30", "30"])
    assert rc == 2 and "cannot fit even alone" in capsys.readouterr().err


def test_kivi_engine_through_the_paged_kernel_equals_one_at_a_time():
    """attention_impl="kernel": decode reads the pages through the (interpreted) paged kernel, KIVI's tail from
    the view ladder. A 1-page decode view once gave wrong tokens here; the reference path cannot catch that."""
    scheme = KIVIScheme(k_bits=2, v_bits=2, group_size=4, v_group_size=4, residual=8, rope_theta=CFG.rope_theta)
    reqs = _trace(n=2, seed=4, shared=0)
    reqs = [dataclasses.replace(r, max_new_tokens=6) for r in reqs]
    want = _one_at_a_time(reqs, scheme)
    eng = Engine(PARAMS, CFG, scheme, EngineConfig(view_buckets=2, num_slots=2, page_size=PAGE, num_pages=16,
                                                   max_pages=8, chunk=CHUNK, prefix_cache=False,
                                                   attention_impl="kernel"))
    res = eng.run(reqs)
    for r in reqs:
        assert res[r.id].tokens == want[r.id], f"request {r.id}"
    assert any("kernel" in str(v) for k, v in eng.paths.items() if "decode" in k), eng.paths


def test_reserve_admission_never_preempts_where_optimistic_preempts(fp32_reference):
    """The trace and pool of the optimistic test above (it preempts there): admission="reserve" admits a request
    only while the free pages cover every running request's prompt + max_new_tokens, so none is preempted; the
    tokens are still the one-at-a-time ones and requests still run concurrently."""
    reqs, want = fp32_reference
    eng = Engine(PARAMS, CFG, None, EngineConfig(num_slots=3, page_size=PAGE, num_pages=12, max_pages=8,
                                                 chunk=CHUNK, admission="reserve"))
    res = eng.run(reqs)
    for r in reqs:
        assert res[r.id].tokens == want[r.id], f"request {r.id}"
    assert sum(r.preemptions for r in res.values()) == 0
    assert eng.peak_running >= 2, "reserve admission must still batch requests"
    paged.validate(eng.cache, eng.pool, eng.prefixes.references())


def test_bad_engine_config_raises():
    with pytest.raises(ValueError, match=r"admission must be one of \('optimistic', 'reserve'\), got 'greedy'"):
        EngineConfig(admission="greedy")
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        EngineConfig(chunk=0)


def test_step_dispatches_both_forwards_then_waits_once(fp32_reference, monkeypatch):
    """Every step dispatches its forwards (decode [S, 1], prefill [prefill_slots, chunk]) before it waits, and
    waits once (one ``jax.device_get`` of the packed outputs); the engine's host page table / lengths stay
    consistent with the pool after every step (``paged.validate`` on :attr:`Engine.cache`); tokens equal the
    one-at-a-time ones."""
    import jax

    from kvquant_jax.serving import engine as engine_mod

    reqs, want = fp32_reference
    eng = Engine(PARAMS, CFG, None, EngineConfig(num_slots=3, page_size=PAGE, num_pages=40, max_pages=8,
                                                 chunk=CHUNK, admission="reserve"))
    log = []
    real_step, real_get = eng._jit_step, jax.device_get

    def logged_step(fn, *args, **kw):
        log.append("dispatch")
        return real_step(fn, *args, **kw)

    def logged_get(x):
        log.append("wait")
        return real_get(x)

    eng._jit_step = logged_step
    monkeypatch.setattr(engine_mod.jax, "device_get", logged_get)
    for r in reqs:
        eng.submit(r)
    patterns = []
    while not eng.done():
        log.clear()
        eng.step()
        monkeypatch.setattr(engine_mod.jax, "device_get", real_get)      # validate reads the device itself
        paged.validate(eng.cache, eng.pool, eng.prefixes.references())
        monkeypatch.setattr(engine_mod.jax, "device_get", logged_get)
        patterns.append(tuple(log[log.index("dispatch"):]))     # before it: admission (a prefix attach reads)
    assert set(patterns) <= {("dispatch", "wait"), ("dispatch", "dispatch", "wait")}, set(patterns)
    assert ("dispatch", "dispatch", "wait") in patterns, "no step ran a decode and a prefill forward"
    for r in reqs:
        assert eng.results[r.id].tokens == want[r.id], f"request {r.id}"
