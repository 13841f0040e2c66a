"""One config spec per registered cache family (a new family must add its line: the registry round trip and the
sharding tests cover every family).  Imported by name (the test directory is on sys.path)."""

KIVI = {"name": "kivi2", "group_size": 8, "v_group_size": 8, "residual": 16}
SPECS = {
    "full": "bf16",
    "fp8": "fp8_e4m3:scales=warmup,axis=head",
    "fp8_vt": "fp8_e4m3_vt:scales=warmup,axis=head",
    "per_token": "int4:group_size=8",
    "per_token_vt": "int4_vt",
    # token-planar per-token INT2 with 2-row planes (8-token blocks: capacities and page sizes multiples of 8)
    "token_planar": {"name": "int2_planar", "plane_rows": 2},
    "qserve_planar": {"name": "qserve4_planar", "plane_rows": 4},
    "per_token_any": "int3",
    "static_int": "static_int4",
    "qserve": "qserve4",
    "kivi": KIVI,
    # token-planar KIVI with 2-row planes (8-token blocks: capacities and page sizes must be multiples of 8)
    "kivi_planar": {**KIVI, "name": "kivi2_planar", "plane_rows": 2},
    "kvquant": {"name": "kvquant", "bits": 3, "k_sparse_capacity": 1, "v_outliers": 1, "sink": 1},
    "prefix": {"name": "prefix", "prefix_len": 3, "body": KIVI},
    # a window over a K/V split: FP8 warm-up K (layer-wide scales, stored once in the ring) and KIVI V (rings)
    "window": {"name": "window", "window": 16, "block": 8,
               "body": {"name": "kv", "k": "fp8_e4m3:scales=warmup,axis=head",
                        "v": {"name": "kivi2", "group_size": 8, "v_group_size": 8, "residual": 8}}},
    "axis_ablation": {"name": "kivi_axes", "k_axis": "token", "group_size": 8, "token_group_size": 8,
                      "residual": 16},
    "kv": {"name": "kv", "k": "int4:group_size=8", "v": KIVI},
}
