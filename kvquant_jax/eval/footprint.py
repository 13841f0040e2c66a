"""Cache bytes of one request: the byte ledger (``kvquant_jax.quant.ledger``) and the measured allocation.

* ``logical``: bytes the representation needs at ``length`` rows (codes of quantized rows, qparams of closed
  groups, live residual rows, the ``lengths`` metadata) -- the basis of bits per element and bytes per token;
* ``physical``: the ledger's bytes of the allocation at capacity ``length``;
* ``measured``: ``nbytes`` of a real cache of capacity ``length`` built by the policy (``ledger.measured_nbytes``).

Layers of the simulated ablation scheme (``cache.axis_ablation``) keep float32 rows, so their measured bytes are not
those of a packed cache: their logical bytes come from :meth:`AxisAblationScheme.logical_bits` and the result is
marked ``simulated``.  Per-layer metadata a scheme stores (KVQuant's row positions) is counted beside the
``lengths`` vector.  Every layer is counted as the cache stores it (``models.cache_layout.layer_schemes``: a
sliding-window layer keeps only its ring's rows).  A family without a ledger formula (``ledger_layer``) falls back
to the measured allocation of a cache holding exactly ``length`` rows (``ledger`` says so in the row).
"""
from __future__ import annotations

from kvquant_jax.eval.policy import as_policy
from kvquant_jax.models.cache_layout import layer_schemes
from kvquant_jax.quant.ledger import CATEGORIES, Ledger, LedgerShape, ledger, measured_nbytes


def cache_footprint(policy, cfg, length: int) -> dict:
    policy = as_policy(policy)
    schemes = policy.schemes * cfg.num_layers if len(policy.schemes) == 1 else policy.schemes
    schemes = layer_schemes(cfg, schemes, capacity=length)       # what each layer keeps (local layers: a ring)
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    one = LedgerShape(num_layers=1, batch=1, num_kv_heads=hkv, head_dim=d, length=length, capacity=length)
    logical = dict.fromkeys(CATEGORIES, 0.0)
    physical = dict.fromkeys(CATEGORIES, 0)
    simulated = False
    measured = measured_nbytes(policy.init(cfg, 1, length))
    no_formula = None
    layer_meta = {"logical": 0, "physical": 0}            # per-layer metadata beyond lengths (KVQuant's pos)
    for s in schemes:
        if hasattr(s, "logical_bits"):
            simulated = True
            elems = 2 * hkv * d * length
            for c, bits in s.logical_bits(length, d).items():
                logical[c] += bits * elems / 8
            continue
        try:
            led = ledger(s, one)
        except ValueError as e:          # a family without a ledger formula yet
            no_formula = str(e)
            break
        for c in CATEGORIES:
            if c != "metadata":
                logical[c] += led.logical[c]
                physical[c] += led.physical[c]
        layer_meta["logical"] += led.logical["metadata"] - 4
        layer_meta["physical"] += led.physical["metadata"] - 4
    meta = 4                                                                   # lengths: int32 [1]
    logical["metadata"] = meta + layer_meta["logical"]
    physical["metadata"] = meta + layer_meta["physical"]
    if no_formula is not None:           # fall back to the allocation of a cache holding exactly `length` rows
        logical, physical, simulated = {c: float(n) for c, n in measured.items()}, dict(measured), False
    total = float(sum(logical.values()))
    elems = 2 * cfg.num_layers * hkv * d * length
    bits = 8 * total / elems
    out = {
        "length": length, "simulated": simulated,
        "bits_per_element": bits,
        "bits_per_element_excl_metadata": 8 * (total - meta) / elems,
        "bytes_per_token": total / length,
        "logical_bytes": total, "logical_by_category": logical,
        "measured_bytes": Ledger.total(measured), "measured_by_category": measured,
        "compression_vs_fp16": 16.0 / bits,
    }
    if no_formula is not None:
        out["ledger"] = f"unavailable ({no_formula}); bytes are the measured allocation at capacity {length}"
    elif not simulated:
        out["physical_bytes"] = Ledger.total(physical)
        out["ledger_matches_measured"] = physical == measured
    return out
