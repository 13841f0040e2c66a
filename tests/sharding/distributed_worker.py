"""One process of the 2-process CPU test (tests/sharding/test_distributed.py): 4 host devices per process,
``jax.distributed`` from KVQ_COORDINATOR / KVQ_NUM_PROCESSES / KVQ_PROCESS_ID, a sharded greedy decode on the
global data=2 x model=4 mesh; process 0 prints the tokens as one JSON line.  Argument: a timeout in seconds."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main():
    from kvquant_jax import sharding as S

    try:
        S.initialize_distributed(timeout_s=int(sys.argv[1]) if len(sys.argv) > 1 else 60)
    except TimeoutError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 3
    import jax

    from kvquant_jax.cache.registry import make_scheme
    from kvquant_jax.serving.generate import generate

    from test_distributed import CFG, PROMPTS, STEPS, SPEC, params

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = S.make_mesh("data=2,model=4")
    with S.mesh_context(mesh):
        res = generate(S.place_params(params(), CFG, mesh), CFG, PROMPTS, max_new_tokens=STEPS,
                       scheme=make_scheme(SPEC, rope_theta=CFG.rope_theta), eos_id=-1)
    if jax.process_index() == 0:
        print(json.dumps({"tokens": res.tokens}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
