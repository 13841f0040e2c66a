"""Byte ledger: the schema-derived ledger agrees exactly with the measured bytes; the design notes' example."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvquant_jax.cache import mixed, ops
from kvquant_jax.cache.fp8 import FP8Scheme
from kvquant_jax.cache.interface import init_cache
from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.registry import NAMES, ledger_from_config, make_scheme
from kvquant_jax.quant.ledger import (CATEGORIES, LedgerShape, cumulative_read, ledger, ledger_table,
                                      measured_nbytes)

from cache_helpers import B, C, CASES, D, H, L, new_cache, rows

MIB = 2 ** 20


@pytest.mark.parametrize("case", sorted(CASES))
def test_physical_ledger_equals_measured_bytes(case):
    policy = CASES[case]
    cache = ops.append(new_cache(policy), rows(np.random.default_rng(0), 5), np.array([5, 2, 0]))
    measured = measured_nbytes(cache)
    led = ledger(policy, LedgerShape(L, B, H, D, 3, C))
    assert measured == led.physical
    assert set(measured) == set(CATEGORIES)
    assert sum(measured.values()) == sum(int(a.nbytes) for a in __import__("jax").tree.leaves(cache))


@pytest.mark.parametrize("name", sorted(NAMES))
@pytest.mark.parametrize("capacity", [64, 100])
def test_physical_ledger_equals_allocation_of_every_registry_scheme(name, capacity):
    """Registry defaults (G=32, R=128 for KIVI) at a capacity that is not a multiple of G, shape-only (no data);
    a token-planar KIVI cache at the next multiple of its block (it refuses any other capacity)."""
    import jax

    scheme = make_scheme(name)
    bt = getattr(scheme, "block_t", 1)
    capacity = -(-capacity // bt) * bt
    policy = mixed.with_full_precision(scheme, 3, first=1)
    cache = jax.eval_shape(lambda: init_cache(policy, num_layers=3, batch=2, capacity=capacity, num_kv_heads=2,
                                              head_dim=64))

    class Shaped:                                   # measured_nbytes needs .nbytes
        def __init__(self, c):
            self.schemes, self.lengths = c.schemes, np.zeros(2, np.int32)
            self.groups = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), c.groups)

    assert measured_nbytes(Shaped(cache)) == ledger(policy, LedgerShape(3, 2, 2, 64, capacity // 2, capacity)).physical


@pytest.mark.parametrize("case", ["fp32", "bf16", "fp8_e4m3_unit", "int8", "int4_g4", "qserve4",
                                  "fp8_e4m3_calibrated_skip0"])
def test_logical_ledger_equals_a_tight_allocation(case):
    """Without residual rings, a cache allocated for exactly T rows holds exactly the logical bytes at T."""
    policy = CASES[case]
    t = 7
    cache = init_cache(policy, num_layers=L, batch=B, capacity=t, num_kv_heads=H, head_dim=D)
    assert measured_nbytes(cache) == ledger(policy, LedgerShape(L, B, H, D, t, 40)).logical


def test_design_notes_worked_example_0x04B():
    """L=32, Hkv=8, d=128, T=4096, INT2, G_t=G_d=32, fp16 scale + fp16 zero, synchronized 128-token fp16 tail."""
    scheme = KIVIScheme(k_bits=2, v_bits=2, group_size=32, v_group_size=32, residual=128,
                        residual_rule="synchronized", qparam_dtype="fp16", residual_dtype="fp16")
    led = ledger(scheme, LedgerShape(num_layers=32, batch=1, num_kv_heads=8, head_dim=128, length=4096,
                                     capacity=4096))
    t = led.by_tensor
    assert led.logical["codes"] == 62 * MIB
    assert t["logical.qparams.k"] == 15.5 * MIB
    assert t["logical.qparams.v"] == 15.5 * MIB
    assert led.logical["residual"] == 16 * MIB
    subtotal = led.logical["codes"] + led.logical["qparams"] + led.logical["residual"]
    assert subtotal == 109 * MIB
    assert led.logical["metadata"] == 4                                        # plus bookkeeping
    assert "109.000" in ledger_table(scheme, led.shape)


def test_official_kivi_counts_k_and_v_frontiers_separately():
    scheme = KIVIScheme(k_bits=2, v_bits=2, group_size=32, v_group_size=32, residual=128)
    led = ledger(scheme, LedgerShape(32, 1, 8, 128, 4096 + 5, 4224))
    t = led.by_tensor
    per_row = 32 * 8 * 128 * 2 // 8                                            # 2-bit codes of one row, all layers
    assert t["logical.codes.k"] == 4096 * per_row                              # K closes whole 128-row chunks
    assert t["logical.codes.v"] == (4101 - 128) * per_row                      # V rolls one row at a time
    assert t["logical.residual.k"] == 5 * 32 * 8 * 128 * 2
    assert t["logical.residual.v"] == 128 * 32 * 8 * 128 * 2


def test_mixed_policy_sums_real_per_layer_segments():
    fp8 = FP8Scheme("e4m3", scale_axis="head")
    policy = mixed.with_full_precision(fp8, 4, first=1, dtype="bf16")
    led = ledger(policy, LedgerShape(4, 2, 8, 128, 100, 128))
    assert led.logical["residual"] == 1 * 2 * 2 * 8 * 100 * 128 * 2           # one bf16 layer, K and V
    assert led.logical["codes"] == 3 * 2 * 2 * 8 * 100 * 128                  # three fp8 layers
    assert led.logical["qparams"] == 3 * 2 * 8 * 4                            # per-head float32 scales
    with pytest.raises(ValueError, match="policy lists 4 layers"):
        ledger(policy, LedgerShape(5, 2, 8, 128, 100, 128))


def test_decode_read_bytes_grow_with_length_and_sum_over_steps():
    s = make_scheme("int8")
    shape = LedgerShape(2, 1, 2, 64, 10, 64)
    one = sum(ledger(s, shape).read_per_step.values())
    nxt = sum(ledger(s, LedgerShape(2, 1, 2, 64, 11, 64)).read_per_step.values())
    assert nxt > one
    assert cumulative_read(s, shape, 2) == one + nxt


def test_ledger_from_config_and_errors(tmp_path):
    out = ledger_from_config("kivi2")
    assert "physical@C" in out and "effective bits" in out
    cfg = tmp_path / "l.yaml"
    cfg.write_text("cache: {name: int4, group_size: 32, full_precision_last: 2}\nnum_layers: 4\nlength: 64\n"
                   "capacity: 128\nhead_dim: 64\nnum_kv_heads: 2\n")
    assert "T=64 capacity=128" in ledger_from_config(str(cfg))
    with pytest.raises(ValueError, match="unknown keys"):
        ledger_from_config({"cache": "int8", "layers": 3})
    with pytest.raises(ValueError, match="exceeds capacity"):
        LedgerShape(1, 1, 1, 8, 10, 5)


def test_families_outside_the_ledger_plug_in_through_ledger_layer():
    class Custom:
        def ledger_layer(self, b, h, d, rows, *, logical, capacity):
            return {("codes", "k"): b * h * rows * d, ("sink_prefix", "v"): 7 if logical else 9}

    led = ledger([Custom(), make_scheme("fp32")], LedgerShape(2, 1, 2, 4, 3, 5))
    assert led.physical["codes"] == 2 * 5 * 4 and led.logical["codes"] == 2 * 3 * 4
    assert (led.logical["sink_prefix"], led.physical["sink_prefix"]) == (7, 9)
    assert led.logical["residual"] == 2 * 2 * 3 * 4 * 4
    with pytest.raises(ValueError, match="ledger_layer"):
        ledger(type("S", (), {"schema": dataclasses.replace(make_scheme("fp32").schema, scheme="mystery")})(),
               LedgerShape(1, 1, 1, 4, 1, 1))
