"""Helpers shared by the evaluation tests (imported by name: the test directory is on sys.path)."""

TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
            vocab_size=320)


def tiny_yaml(**blocks) -> str:
    """A YAML config on the random model and the built-in corpus with tiny task sizes."""
    import yaml

    cfg = {
        "name": "tiny",
        "model": {"name": "random", "random": {k: v for k, v in TINY.items()}},
        "data": {"corpus": "builtin"},
        "tasks": {"ppl": {"seq_len": 48, "max_segments": 2, "chunk": 16},
                  "serving_ppl": {"prefill": 16, "decode": 12},
                  "kv_error": {"seq_len": 40, "prefill": 16, "probes": 3, "position_bins": 4},
                  "agreement": {"prompt_tokens": 12, "new_tokens": 8},
                  "passkey": {"enabled": False, "lengths": [320], "depths": [0.0, 1.0], "max_new_tokens": 3,
                              "batch_size": 2},
                  "bytes": {"length": 64}},
    }
    for k, v in blocks.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            for kk, vv in v.items():
                if isinstance(vv, dict) and isinstance(cfg[k].get(kk), dict):
                    cfg[k][kk] = {**cfg[k][kk], **vv}
                else:
                    cfg[k][kk] = vv
        else:
            cfg[k] = v
    return yaml.safe_dump(cfg, sort_keys=False)
