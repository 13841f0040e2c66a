#!/usr/bin/env bash
# Every H200 measurement the open issues still wait for, as one device block (issues J, L, M, N, P).
#
#     bash experiments/run_pending_gpu.sh [JOB ...]        # default: all jobs, in the order below
#     LOG=/tmp/pending bash experiments/run_pending_gpu.sh engine gemma_passkey
#     SEQUENTIAL=1 bash experiments/run_pending_gpu.sh engine engine_static ws decode   # timing jobs, one at a time
#
# Jobs (each writes its own results directory; logs go to $LOG/<job>.log; each job runs in the background with
# its own share of GPU memory, XLA_PYTHON_CLIENT_MEM_FRACTION, so that a short job does not wait for a long one):
#   engine         M: continuous batching on the LLaMA-3-8B shape at a 16 GB KV budget, bf16 vs int4 on one
#                  seeded capacity-bound trace (target: int4 >= 1.8x bf16 output tok/s; runs 2-4, 2026-12-02:
#                  1.98-2.04x); ALONE on the GPU; rerun only to repeat it
#   engine_static  M: the static-batch loop on the same trace (run 4, 2026-12-02: once); ALONE
#   engine_kivi2   M: the KIVI-2 and int8 engines on the same trace, one process each (2026-12-02: KIVI-2 met the
#                  allocator limit after int8 in one process; int8 ran once); ALONE
#   engine_smollm2 M: the same kind of trace on SmolLM2 (prompts 512-7168: its context is 8192) at a 1 GiB KV
#                  budget, bf16 / int4 / int8 / KIVI-2, with the static loop; ALONE (all four ran once by
#                  2026-12-04, one process each; KIVI-2 needs > 275 s: its engine compile is 117 s)
#   engine_probe   M: one engine step split into its forwards and host part, bf16 / int8 / int4 / KIVI-2, 64
#                  slots x 1K prompts (the bf16 pool holds them), the engine's 8 x 512 chunking (the int8 engine's
#                  ITL p50 was 3x int4's on 2026-12-02: is its paged decode forward slow?); ALONE (int4 / KIVI-2
#                  ran 2026-12-04 with --trace, summed by experiments/trace_kernels.py; int8 not yet)
#   tv_check       J: the transposed-V caches through the dispatcher and the tuning table (2026-12-02: 20/20)
#   gemma_passkey  L: Gemma-3-270M passkey (every cell measured by 2026-12-02 07:34 UTC; the script resumes the
#                  committed file, so this recomputes nothing unless a policy or the protocol is added)
#   sweeps         P: the GPU-preset sweep not yet committed: passkey (kivi_axes and kvquant_main ran 2026-12-02)
#   intactkv       P: the IntactKV / PrefixQuant ablation at 64 WikiText-2 test segments x 1024 tokens (ran
#                  2026-12-02: docs/results/intactkv/gpu; rerun only to repeat it)
#   paged_check    M: the compiled paged kernel vs the float64 oracle at D 128, 16- and 64-row pages, and the
#                  engine's KIVI groups (all right, 2026-12-02 07:18 UTC; rerun only to repeat it)
#   fixed_order    N: what the fixed-order (mesh- and batch-invariant) numerics cost against the fast path
#   decode_shapes  J: the decode kernels at SmolLM2's shape (B 64, Hq 9, Hkv 3, D 64) and Gemma-3's (B 8, Hq 4,
#                  Hkv 1, D 256) at T = 8K / 32K against cuDNN (SmolLM2's ran 2026-12-04; Gemma-3's --check ran out
#                  of a 130 s limit before its timing: give it >= 300 s); ALONE
#   mosaic_shapes  J: Mosaic v1 / ws against the Triton kernel on bf16 / int8 / int4 at SmolLM2's and Gemma-3's
#                  shapes (8K / 32K, variants at both), for the tuning table of several shapes: then
#                  `check_mgpu_decode.py --tune-from <the D 128 runs>,<these two> --tune pallas_kernels/tuning/decode_<dev>.json`
#                  (not yet run: written 2026-12-06); ALONE
#   fp8_tune       J: FP8 (e4m3) on Mosaic v1 and ws variants at 4K / 32K, three repeats, for a table entry
#                  (fp8_e4m3_vt runs v1 default since 2026-12-06: 1.43x / 1.50x cuDNN on an H100); ALONE
#   kivi_offsets   J: the KIVI kernel's logit offsets computed as one bf16 GEMM over 3D ("offsets bf16x3") or as
#                  sibling reductions ("offsets rows") against the HIGHEST einsum, 4K and 32K, three runs (written
#                  2026-12-06, untimed: the one try got no machine time); ALONE
#   planar         J: the token-planar kernels (per-token INT2 / INT4 / QServe, decode_attention_mgpu_planar and
#                  its s8 twin, mgpu_s8): every parity case, 3 timing repeats at 4K / 32K vs Triton and cuDNN, then the int2_planar /
#                  qserve4_planar caches through the dispatcher, which serves them with the s8 kernel since
#                  2026-12-07 afternoon (H100 2026-12-07, bf16 route: one run each, 16/16 + 20/20 parity; INT2
#                  1.78x / 1.88x, QServe 1.70x / 1.87x cuDNN; s8 route: 14/20 parity rows run, all OK, not timed);
#                  ALONE.  Its counters:
#                  `ncu_decode.py --T 32768 --formats int2,qserve,int4 --impls mgpu_planar,triton`
#   s8             J: the s8 tensor-core planar kernel (decode_attention_mgpu_planar_s8; H100 2026-12-07: parity OK on
#                  the 16-bit limb paths, the 32-bit one localised as wrong and refused; 32K x3: INT2 3.40-3.42x,
#                  QServe 2.58-2.59x, INT4 2.66-2.67x cuDNN): experiments/debug_mgpu_s8.py (each integer step),
#                  its parity cases (it refuses V groups < 64, so cases 0, 1, 3, 5), then 3 timing repeats at
#                  4K / 32K beside the bf16 planar kernel and cuDNN (int2, qserve, int4), variants at the first;
#                  ALONE.  Then `planar` (the dispatcher route).  Its counters:
#                  `ncu_decode.py --T 32768 --formats int2,qserve --impls mgpu_planar,mgpu_planar_s8`
#   s8_knobs       J: the s8 kernel's knobs: the in-kernel profile (INT2 / INT4), GPU parity with the old settings
#                  as variants, three timing calls at 32K against the 1-block step and the default before (ranges),
#                  then the token-planar route's parity (check_transposed_v_gpu.py); ALONE.  The timing and route
#                  parts ran 2026-12-08 (docs/results/decode_mgpu/2026-12-08-s8-int2-steps-h100); the profile and
#                  the variant parity with 2 blocks per step for INT2 (today's default) have not
#   s8_merged      J: `merged_pv` (one PV accumulator for both plane parities; written 2026-12-08, NOT yet run on a
#                  GPU): parity of the merged kernel (its outputs must equal the unmerged ones bit for bit), INT2 at
#                  32K with 1 block per step + late loads (+ twice the splits: room for 3 CTAs / SM if the registers
#                  drop to <= 168), ncu's registers for it, then the INT2 route's parity with 2 blocks per step
#                  (the default since 2026-12-08, checked on GPU only as the kernel's timing error); ALONE
#   kivi_block     J: KIVI-2/4 with the opt-in whole-block update (`kivi_update=block`, one softmax update + one
#                  PV per block) against today's per-group path and cuDNN at 32K (timed twice, 2026-12-03 / 04:
#                  no gain; rerun only to repeat it); ALONE
#   ws             J: the warp-specialized Mosaic kernel vs v1 and cuDNN, parity first, variants at 4K and 32K
#   decode         J: the packed decode kernels against cuDNN at 32K / 128K (the baseline table of issue J)
#   ncu            J: Nsight Compute counters of one launch per decode kernel at T = 32K (v1, ws, the tuned route,
#                  Triton: bf16 / int8 / int4 and the Triton-only int2 / qserve / kivi2; cuDNN bf16):
#                  experiments/ncu_decode.py, ~55-60 s per case (first run 2026-12-04, 9 cases in 541 s:
#                  docs/results/decode_mgpu/2026-12-04-ncu/); ALONE (ncu serializes the kernels and replays them; a job beside it
#                  would disturb the counters, and it the job beside it); not in the default list
# Needs SmolLM2 and Gemma-3 in $KVQ_CACHE_DIR (kvq fetch-model; to the device: experiments/device_carry.py),
# WikiText-2 in $KVQ_DATA_DIR, gguf importable.
# The jobs share the GPU, so their absolute speeds are only comparable within a job (each job measures its own
# baseline in the same run), never across jobs.  Timing jobs (engine, engine_static, fixed_order, decode, ws, ncu) belong in a block of
# their own: on 2026-12-01 the engine ran beside three quality jobs and its table says so
# (docs/results/engine/README.md).  Quality jobs: paged_check gemma_passkey sweeps intactkv.
set -u
LOG=${LOG:-/tmp/pending_gpu}
mkdir -p "$LOG"
JOBS=${*:-engine_kivi2 engine_smollm2 sweeps fixed_order decode ws}
PY=${PY:-python3}

SEQUENTIAL=${SEQUENTIAL:-0}      # 1: the jobs run one after another (timing jobs: each alone on the GPU)
KNOWN="v1_barriers s8_knobs s8_merged paged_check engine engine_static engine_kivi2 engine_smollm2 engine_probe tv_check decode_shapes mosaic_shapes fp8_tune kivi_offsets planar s8 kivi_block gemma_passkey sweeps intactkv fixed_order decode ws ncu"
for job in $JOBS; do                # every name checked before anything starts
  case " $KNOWN " in *" $job "*) ;; *) echo "unknown job $job ($KNOWN)" >&2; exit 2 ;; esac
done

start_job() {   # name, memory fraction, command...
  local name=$1 frac=$2
  shift 2
  echo "[pending] $(date +%T) start $name (mem fraction $frac): $*" | tee -a "$LOG/jobs.txt"
  if [ "$SEQUENTIAL" = 1 ]; then
    XLA_PYTHON_CLIENT_MEM_FRACTION=$frac "$@" > "$LOG/$name.log" 2>&1
    echo "[pending] $(date +%T) $name rc $?" >> "$LOG/jobs.txt"
    return
  fi
  ( XLA_PYTHON_CLIENT_MEM_FRACTION=$frac setsid nohup "$@" > "$LOG/$name.log" 2>&1; \
    echo "[pending] $(date +%T) $name rc $?" >> "$LOG/jobs.txt" ) &
}

run_jobs() {
for job in $JOBS; do
  case $job in
    engine)
      # alone on the GPU (a timing job); 192 requests in ~24 s: capacity-bound, both caches finish within 300 s
      # (docs/results/engine/README.md, "Changes since run 1"); run it three times for the ratio's range
      start_job engine 0.90 $PY experiments/bench_engine.py --model llama3-8b-shaped --cache bf16 int4 \
        --requests 192 --rate 8 --prompt-len 512 8192 --output-len 64 1024 --hbm-gb 16 --slots 128 \
        --page-size 64 --chunk 512 --prefill-slots 8 --admission reserve --view-buckets 2 --max-seconds 300 \
        --no-static --compile-cache /tmp/kvq-jax-cache --out docs/results/engine ;;
    engine_static)
      # the static-batch loop on the same trace after each engine config (its warm-up pass, 1.5x the window, first)
      start_job engine_static 0.90 $PY experiments/bench_engine.py --model llama3-8b-shaped \
        --cache bf16 int4 --requests 192 --rate 8 --prompt-len 512 8192 --output-len 64 1024 --hbm-gb 16 \
        --slots 128 --page-size 64 --chunk 512 --prefill-slots 8 --admission reserve --view-buckets 2 \
        --max-seconds 150 --static-max-seconds 60 --compile-cache /tmp/kvq-jax-cache --out docs/results/engine ;;
    engine_kivi2)
      start_job engine_kivi2 0.90 bash -c "for c in kivi2 int8; do $PY experiments/bench_engine.py \
        --model llama3-8b-shaped --cache \$c --requests 192 --rate 8 --prompt-len 512 8192 --output-len 64 1024 \
        --hbm-gb 16 --slots 128 --page-size 64 --chunk 512 --prefill-slots 8 --admission reserve \
        --view-buckets 2 --max-seconds 150 --no-static --compile-cache /tmp/kvq-jax-cache --out docs/results/engine; done" ;;
    engine_smollm2)
      start_job engine_smollm2 0.90 $PY experiments/bench_engine.py --model smollm2 --cache bf16 int4 int8 kivi2 \
        --requests 192 --rate 8 --prompt-len 512 7168 --output-len 64 1024 --hbm-gb 1 --slots 128 \
        --page-size 64 --chunk 512 --prefill-slots 8 --admission reserve --view-buckets 2 --max-seconds 60 \
        --static-max-seconds 30 --compile-cache /tmp/kvq-jax-cache --out docs/results/engine/smollm2 ;;
    engine_probe)
      start_job engine_probe 0.90 $PY experiments/probe_engine_step.py --cache bf16 int8 int4 kivi2 --impl auto \
        --slots 64 --prompt 1024 --decode-steps 8 --chunk 512 --prefill-slots 8 \
        --out docs/results/engine/probe_engine_step_formats.json ;;
    tv_check)
      start_job tv_check 0.30 $PY experiments/check_transposed_v_gpu.py \
        --parity-schemes int8_vt int4_vt fp8_e4m3_vt fp8_e5m2_vt --schemes int4_vt int4 int8_vt int8 fp8_e4m3_vt \
        fp8_e4m3 --out docs/results/decode_mgpu/pending-tv ;;
    gemma_passkey)
      start_job gemma_passkey 0.20 $PY experiments/gemma3_passkey.py --dtype bf16 --trials 20 --batch 10 \
        --policies kivi2 "local kivi2 + global bf16" "fp8_e4m3 (warm-up per-head scales)" \
        --out docs/results/gemma3/gpu ;;
    sweeps)
      # passkey alone (kivi_axes ran 2026-12-02 07:18 UTC); its 8K prefill is the one that ran out of memory twice
      start_job sweeps 0.25 bash experiments/run_gpu_sweeps.sh docs/results/gpu passkey ;;
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
    decode_shapes)
      start_job decode_shapes 0.20 bash -c "$PY experiments/bench_decode_attention.py --check --B 64 --hq 9 \
        --hkv 3 --d 64 --check-d 64 --T 8192,32768 --out docs/results/decode_attention/pending-smollm2-shape; \
        $PY experiments/bench_decode_attention.py --check --B 8 --hq 4 --hkv 1 --d 256 --check-d 256 \
        --T 8192,32768 --out docs/results/decode_attention/pending-gemma3-shape" ;;
    mosaic_shapes)
      V="--impls mgpu,triton --ws --ws-groups ws --quick --variants --variants-at 8192,32768"
      start_job mosaic_shapes 0.20 bash -c "$PY experiments/check_mgpu_decode.py --B 64 --hq 9 --hkv 3 --d 64 \
        --T 8192,32768 --formats bf16,int8,int4 $V --variant-names 'bt 64,bt 128,splits x2,ws late-v' \
        --out docs/results/decode_mgpu/pending-smollm2-shape; \
        $PY experiments/check_mgpu_decode.py --B 8 --hq 4 --hkv 1 --d 256 --T 8192,32768 --formats bf16,int8,int4 \
        $V --variant-names 'bt 64,splits x2,ws late-v' --out docs/results/decode_mgpu/pending-gemma3-shape" ;;
    s8_knobs)
      start_job s8_knobs 0.20 bash -c "$PY experiments/profile_mgpu_s8.py --T 32768 --formats int2,int4 \
        --variants 'default,step blocks 1,unpacked + late loads + masked full' \
        --out docs/results/decode_mgpu/pending-s8-knobs/prof; $PY experiments/check_mgpu_planar.py --check-only \
        --impls mgpu_s8 --variants 'step blocks 1,unpacked,unpacked + late loads + masked full' --variants-only \
        --out docs/results/decode_mgpu/pending-s8-knobs/parity; for i in 1 2 3; do $PY experiments/check_mgpu_planar.py \
        --skip-check --T 32768 --repeat 1 --impls mgpu_s8 --variants 'step blocks 1,step blocks 2,step blocks 2 + late loads,unpacked + late loads + masked full' \
        --out docs/results/decode_mgpu/pending-s8-knobs/time\$i; done; $PY experiments/check_transposed_v_gpu.py \
        --parity-schemes int2_planar qserve4_planar int4_planar --schemes --T 32768 \
        --out docs/results/decode_mgpu/pending-s8-knobs/route" ;;
    s8_merged)
      start_job s8_merged 0.20 bash -c "$PY experiments/check_mgpu_planar.py --check-only --cases 0,1,3,5 \
        --impls mgpu_s8 --variants 'step blocks 1,merged pv,step blocks 1 + merged pv + late loads' --variants-only \
        --out docs/results/decode_mgpu/pending-s8-merged/parity; for i in 1 2 3; do $PY experiments/check_mgpu_planar.py \
        --skip-check --T 32768 --repeat 1 --formats int2,int4 --impls mgpu_s8 --variants 'step blocks 1,merged pv,step blocks 1 + merged pv,step blocks 1 + merged pv + late loads,step blocks 1 + merged pv + late loads + splits x2,step blocks 1 + merged pv + splits x2' \
        --out docs/results/decode_mgpu/pending-s8-merged/time\$i; done; $PY experiments/ncu_decode.py --T 32768 \
        --formats int2 --impls mgpu_planar_s8 --configs 'mgpu_planar_s8={\"step_blocks\": 1, \"merged_pv\": true, \"qparams_early\": false, \"v_early\": false}' \
        --configs 'mgpu_planar_s8={\"step_blocks\": 1, \"qparams_early\": false, \"v_early\": false}' \
        --out docs/results/decode_mgpu/pending-s8-merged/ncu; $PY experiments/check_transposed_v_gpu.py \
        --parity-schemes int2_planar --schemes --T 32768 --out docs/results/decode_mgpu/pending-s8-merged/route" ;;
    v1_barriers)
      start_job v1_barriers 0.10 $PY experiments/check_mgpu_decode.py --no-check --T 32768,4096 --impls mgpu \
        --formats int8,e4m3,int4,bf16 --variants --variants-at 32768,4096 --variant-names 'barriers explicit' \
        --repeat 3 --repeat-variants --out docs/results/decode_mgpu/pending-v1-barriers ;;
    fp8_tune)
      start_job fp8_tune 0.10 $PY experiments/check_mgpu_decode.py --ws --quick --T 4096,32768 --formats e4m3 \
        --impls mgpu --reps 8 --variants --variants-at 4096,32768 --repeat 3 --repeat-variants \
        --out docs/results/decode_mgpu/pending-fp8-tune ;;
    kivi_offsets)
      start_job kivi_offsets 0.10 bash -c "for i in 1 2 3; do $PY experiments/check_mgpu_kivi.py --skip-check \
        --T 4096,32768 --impls mgpu --variants 'offsets bf16x3,offsets rows' \
        --out docs/results/decode_mgpu/pending-kivi-offsets/run\$i; done" ;;
    planar)
      start_job planar 0.20 bash -c "$PY experiments/check_mgpu_planar.py --T 4096,32768 --repeat 3 \
        --out docs/results/decode_mgpu/pending-planar; $PY experiments/check_transposed_v_gpu.py \
        --parity-schemes int2_planar int4_planar qserve4_planar --schemes int2_planar int2 qserve4_planar qserve4 \
        --T 4096 32768 --out docs/results/decode_mgpu/pending-planar-route" ;;
    s8)
      start_job s8 0.20 bash -c "$PY experiments/debug_mgpu_s8.py --out docs/results/decode_mgpu/pending-s8-debug; \
        $PY experiments/check_mgpu_planar.py --check-only --cases 0,1,3,5 --impls mgpu_s8 \
        --out docs/results/decode_mgpu/pending-s8-parity && $PY experiments/check_mgpu_planar.py --skip-check \
        --T 32768,4096 --repeat 3 --impls mgpu,mgpu_s8 --variants 'limbs bf16,stages 3,splits x2,splits /2' \
        --out docs/results/decode_mgpu/pending-s8; $PY experiments/profile_mgpu_s8.py --T 32768,4096 \
        --formats int2,int4,qserve --variants 'default,barriers auto,pv limbs 2' \
        --out docs/results/decode_mgpu/pending-s8-profile" ;;
    kivi_block)
      start_job kivi_block 0.10 $PY experiments/bench_decode_attention.py --T 32768 --baselines cudnn --reps 8 \
        --formats kivi2,kivi2:kivi_update=block,kivi2:kivi_update=block:block_t=128,kivi4,kivi4:kivi_update=block,kivi4:kivi_update=block:block_t=128 \
        --out docs/results/decode_attention/pending-kivi-block ;;
    ws)
      # variants at 4K too (the 4K target: int8_vt read 0.87x cuDNN there on 2026-12-02), defaults re-timed 3x at
      # every T (the table compares a variant only when timed as often as v1; 32K alone ran 2026-12-04, 245 s);
      # then `check_mgpu_decode.py --tune-from <its json> --tune pallas_kernels/tuning/decode_h200.json` here
      start_job ws 0.10 $PY experiments/check_mgpu_decode.py --ws --quick --T 4096,32768 --formats bf16,int8,int4 \
        --impls mgpu --reps 8 --ws-probe-timeout 90 --variants --variants-at 4096,32768 --repeat 3 \
        --out docs/results/decode_mgpu/pending-ws ;;
    ncu)
      # alone on the GPU; the children inherit the small memory fraction (one input set: <= 1.1 GB at T = 32K);
      # NCU=/path/to/ncu if ncu is not on PATH
      start_job ncu 0.10 $PY experiments/ncu_decode.py --T 32768 --formats bf16,int8,int4 \
        --impls v1,ws,tuned,triton,cudnn --case-timeout 300 --ncu "${NCU:-ncu}" --out docs/results/decode_mgpu/pending-ncu ;;
  esac
done
}

if [ "$SEQUENTIAL" = 1 ]; then      # one background chain: returns at once, the jobs run in turn
  ( run_jobs ) > /dev/null 2>&1 < /dev/null &
  disown
else
  run_jobs
fi
echo "[pending] started: $JOBS (sequential=$SEQUENTIAL); poll $LOG/jobs.txt"
