#!/usr/bin/env bash
# Every H200 measurement the open issues still wait for, as one device block (issues J, L, M, N, P).
#
#     bash experiments/run_pending_gpu.sh [JOB ...]        # default: all jobs, in the order below
#     LOG=/tmp/pending bash experiments/run_pending_gpu.sh engine gemma_passkey
#
# Jobs (each writes its own results directory; logs go to $LOG/<job>.log; each job runs in the background with
# its own share of GPU memory, XLA_PYTHON_CLIENT_MEM_FRACTION, so that a short job does not wait for a long one):
#   engine         M: continuous batching on the LLaMA-3-8B shape at a 16 GB KV budget, bf16 / int8 / int4 /
#                  KIVI-2 against the static batch on one seeded trace (target: int4 >= 1.8x bf16 output tok/s)
#   gemma_passkey  L: Gemma-3-270M passkey, the two rows still short of 32K (KIVI-2, local KIVI-2 + global bf16;
#                  the script resumes the committed file at the first missing length), then FP8 E4M3 whole
#                  (~8 min per whole policy when the GPU is shared)
#   sweeps         P: the GPU-preset sweeps not yet committed (KIVI axes, passkey; kvquant_main ran 2026-12-02)
#   intactkv       P: the IntactKV / PrefixQuant ablation at 64 WikiText-2 test segments x 1024 tokens (ran
#                  2026-12-02: docs/results/intactkv/gpu; rerun only to repeat it)
#   paged_check    M: the compiled paged kernel vs the float64 oracle at D 128, 16- and 64-row pages
#   fixed_order    N: what the fixed-order (mesh- and batch-invariant) numerics cost against the fast path
#   ws             J: the warp-specialized Mosaic kernel (C = 4 register fix) vs v1 and cuDNN, parity first
#   decode         J: the packed decode kernels against cuDNN at 32K / 128K (the baseline table of issue J)
# Needs SmolLM2 and Gemma-3 in $KVQ_CACHE_DIR (kvq fetch-model), WikiText-2 in $KVQ_DATA_DIR, gguf importable.
# The jobs share the GPU, so their absolute speeds are only comparable within a job (each job measures its own
# baseline in the same run), never across jobs.  Timing jobs (engine, fixed_order, decode, ws) belong in a block of
# their own: on 2026-12-01 the engine ran beside three quality jobs and its table says so
# (docs/results/engine/README.md).  Quality jobs: paged_check gemma_passkey sweeps intactkv.
set -u
LOG=${LOG:-/tmp/pending_gpu}
mkdir -p "$LOG"
JOBS=${*:-paged_check engine gemma_passkey sweeps fixed_order decode ws}
PY=${PY:-python3}

start_job() {   # name, memory fraction, command...
  local name=$1 frac=$2
  shift 2
  echo "[pending] $(date +%T) start $name (mem fraction $frac): $*" | tee -a "$LOG/jobs.txt"
  ( XLA_PYTHON_CLIENT_MEM_FRACTION=$frac setsid nohup "$@" > "$LOG/$name.log" 2>&1; \
    echo "[pending] $(date +%T) $name rc $?" >> "$LOG/jobs.txt" ) &
}

for job in $JOBS; do
  case $job in
    engine)
      start_job engine 0.30 $PY experiments/bench_engine.py --model llama3-8b-shaped \
        --cache bf16 int8 int4 kivi2 --requests 96 --rate 8 --prompt-len 512 8192 --output-len 64 1024 \
        --hbm-gb 16 --slots 128 --page-size 64 --chunk 256 --max-seconds 90 --view-buckets 2 \
        --compile-cache /tmp/kvq-jax-cache --out docs/results/engine ;;
    gemma_passkey)
      start_job gemma_passkey 0.20 $PY experiments/gemma3_passkey.py --dtype bf16 --trials 20 --batch 10 \
        --policies kivi2 "local kivi2 + global bf16" "fp8_e4m3 (warm-up per-head scales)" \
        --out docs/results/gemma3/gpu ;;
    sweeps)
      # passkey last: one process runs the sweeps in order, and its 8K prefill is the one that ran out of memory
      start_job sweeps 0.25 bash experiments/run_gpu_sweeps.sh docs/results/gpu kivi_axes passkey ;;
    intactkv)
      start_job intactkv 0.12 $PY experiments/intactkv_ablation.py --segments 64 --seq-len 1024 \
        --out docs/results/intactkv/gpu ;;
    paged_check)
      # the engine's group sizes first (KIVI G 32: never compiled yet), then the CI test's formats at D 128
      start_job paged_check 0.05 bash -c "$PY experiments/check_paged_gpu.py --page 64 --formats engine \
        --out docs/results/engine/check_paged_gpu_engine.json; $PY experiments/check_paged_gpu.py \
        --out docs/results/engine/check_paged_gpu_d128.json" ;;
    fixed_order)
      start_job fixed_order 0.10 $PY experiments/bench_serving.py --model llama3-8b-shaped --cache bf16 int4 \
        --batch 8 --T 32768 --reduction fast fixed_order --reps 5 --out docs/results/sharding/gpu ;;
    decode)
      start_job decode 0.10 $PY experiments/bench_decode_attention.py --check --T 32768,131072 \
        --out docs/results/decode_attention/pending ;;
    ws)
      start_job ws 0.10 $PY experiments/check_mgpu_decode.py --ws --quick --T 4096,32768 --formats bf16,int8,int4 \
        --impls mgpu --reps 8 --ws-probe-timeout 90 --out docs/results/decode_mgpu/pending-ws ;;
    *) echo "unknown job $job (paged_check engine gemma_passkey sweeps intactkv fixed_order decode ws)" >&2; exit 2 ;;
  esac
done
echo "[pending] started: $JOBS; poll $LOG/jobs.txt"
