#!/usr/bin/env bash
# Several GPU checks in one device call, each cut at its own time limit, their logs packed into
# one file (a device call returns at most 8 files), packed again after each step. Every check writes under /tmp/gpu_batch/STEP;
# at the end $OUT holds logs.tgz (all of them) and each check's summary file.
#
#   bash bench/gpu_batch.sh overlap fault          # 4 GPUs
#   bash bench/gpu_batch.sh cp moe                 # 4 GPUs
#   bash bench/gpu_batch.sh fp8 ckpt               # 1 GPU
#
# Steps (the scripts they run say what each measures):
#   overlap  PART=overlap bench/scale_gpu_check.sh: Llama-3 8B with and without --tp-comm-overlap
#   pp4      PART=pp4 bench/scale_gpu_check.sh: Llama-3 8B at PP 4 interleaved
#   best, bestgpt, dp4, best2, dpgpt, dp4gpt   the same script's parts: issue 31's best layouts against the peer
#   final4   PART=final4 of bench/scale_gpu_check.sh: issue 31's targets after the fusion, TP 4 at larger micro-batches, GPT's profile
#   fp8best  PART=fp8best (4 GPUs): Llama-3 8B's best layout, bf16 against FP8
#   tp4      PART=tp4 (4 GPUs): TP 4 + SP at larger micro-batches, with and without --tp-comm-overlap
#   tp4big   PART=tp4big (4 GPUs): TP 4 + SP, GPT-3 6.7B micro-batch 16 and Llama-3 8B 4, the planner beside
#   tp4short PART=tp4short (4 GPUs): TP 4 + SP, Llama-3 8B micro-batch 2, with and without --tp-comm-overlap
#   tp2      PART=tp2 (2 GPUs): TP 2 + SP, Llama-3 8B micro-batch 2, with and without --tp-comm-overlap
#   prof2    PART=prof2 (2 GPUs): GPT 6.7B's shape at DP 2 profiled, FP8 at Llama-3 8B's shape at PP 2, the peers
#   fused2, edge2  the parts of bench/scale_gpu_check.sh for 2 GPUs (NPROC=2): the fusion on and off, a layout at the edge of 80 GB
#   fusedab, fusedgpt  the parts of bench/scale_gpu_check.sh (OLD=.gpu/old/pretrain_gpt: the build before, for A/B): the gradient-accumulation fusion
#   uneven   PART=uneven, then uneven2, of bench/scale_gpu_check.sh: uneven pipeline stages
#   startup  PART=startup bench/scale_gpu_check.sh: start-up of DP 4, TP 2 x PP 2 and PP 4
#   fault    bench/fault_gpu_check.sh: kill -9 of a rank, the restart and resume
#   tpprof   gpt_train_bench Llama 1B at TP 4 + SP, without and with --tp-comm-overlap, profiled
#   cp       bench/context_parallel_gpu_check.sh (PART=CP_PART, default key; NPROC=CP_NPROC, default 4;
#            BUDGET=CP_BUDGET, default 300 s)
#   moe      bench/moe_gpu_check.sh (PART=MOE_PART, default all; BUDGET=MOE_BUDGET, default 240 s)
#   fp8      PART=gemm and PART=step of bench/fp8_gpu_check.sh
#   fp8prof  PART=profile of bench/fp8_gpu_check.sh: the bf16 and FP8 steps profiled
#   fp8step  PART=step of bench/fp8_gpu_check.sh: the GPT 1.3B step, bf16 and FP8, and the peer
#   fp8curve2, fp8prof8b, fp8step8b  PART=curve2, profile8b, step8b of bench/fp8_gpu_check.sh (2 GPUs)
#   fp8curve3 PART=curve3 (1 GPU): the 350M curves, bf16, FP8 and FP8 with the first and last layers in bf16
#   fp8repeat PART=repeat (1 GPU): curve3's model twice in bf16 and twice in FP8 at once (run-to-run drift)
#   fp8recipes PART=recipes (1 GPU): curve3's model in bf16, FP8 e4m3, delayed, e4m3 with first/last layers in bf16
#   fp8peer PART=peer (2 GPUs): curve2's model, ours and PyTorch's (bench/torch_curve.py), bf16 and FP8, all at once
#   fp8peer2 PART=peer2 (2 GPUs): fp8peer's four runs twice each, all eight at once
#   fp8bwd PART=bwd (2 GPUs): that model in bf16, FP8, FP8 with backward GEMMs in bf16 (both, wgrad, dgrad), and the PyTorch pair
#   fp8dp2 PART=dp2 (2 GPUs): that model at DP 2 for 60 steps in bf16, FP8 tensorwise and FP8 delayed (histories reduced over DP)
#   fp8book PART=curvebook (2 GPUs): the 350M curve on the non-repeating book corpus, ours bf16 and FP8 twice, PyTorch bf16 and float8
#   fp8block1 PART=block1 (1 GPU): 14 of Llama-3 8B's layers in bf16, FP8 tensorwise and FP8 blockwise
#   fp8blockbook PART=blockbook (2 GPUs): the 350M curve on the book corpus, bf16, FP8 blockwise and tensorwise
#   fp8dp2prof PART=dp2prof (2 GPUs): that model at DP 2, FP8 delayed profiled, without the DP reduction, and tensorwise
#   fp8diag PART=diag (2 GPUs): that model in bf16 and FP8 with the kernels, the casts or the scales as the Burn compositions
#   fp8step1 PART=step1 (1 GPU): the casts' checks and speeds, 14 of Llama-3 8B's layers in bf16 and FP8
#   fp8hook1 PART=hook1 (1 GPU): step1's model with the distributed optimizer and the overlap hook, bf16 and FP8
#   fp8peer1 PART=peer1 (1 GPU): that model in PyTorch, bf16 and float8 (the peer)
#   fp8peer8b PART=peer8b (2 GPUs): Llama-3 8B in PyTorch, bf16 and float8 (fp8step8b's peers)
#   fp8prof1 PART=prof1 (1 GPU): one step of that model profiled, bf16 and FP8
#   fp8casts PART=casts of bench/fp8_gpu_check.sh: the casts' checks, speeds and registers
#   gradnorm bench/gradnorm_gpu_check.sh: the first gradient norm at 1 and 4 microbatches, with and without recomputation (1 GPU)
#   gputest  the GPU test binary (pack test ... --test gpu), filtered by GPUTEST_FILTER
#   ckpt     checkpoint_bench and bench/torch_checkpoint.py, GPT 1B in bf16 on the GPU
#   single   ckpt on GPU 0 and fp8's PART=step on GPU 1 at the same time
#   generate bench/generate_gpu_check.sh: greedy ids against transformers', decode tokens/s
#            (2 GPUs; BUDGET=GEN_BUDGET, default 520 s)
# Settings: STEP_LIMIT (seconds a step may take, default 560).
set -u
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder the call returns}"
ROOT=/tmp/gpu_batch
mkdir -p "$ROOT"
for z in .gpu/bin/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done 2>/dev/null
chmod +x .gpu/bin/* 2>/dev/null
step() { # name, then the command (run with OUT=$ROOT/name)
  local name=$1; shift
  mkdir -p "$ROOT/$name"
  echo "##### $name $(date -u +%H:%M:%S): $*"
  local s=$(date +%s)
  OUT="$ROOT/$name" timeout "${STEP_LIMIT:-560}" "$@" 2>&1 | tee "$ROOT/$name/stdout.log" | tail -${TAIL:-60}
  echo "##### $name rc=${PIPESTATUS[0]} seconds=$(( $(date +%s) - s ))"
  pack
}
# The logs so far into $OUT (after every step: a call cut at its limit still returns them).
pack() {
  tar czf "$OUT/logs.tgz" -C "$ROOT" . 2>/dev/null
  for f in tp4big/scale.log tp4short/scale.log tp2/scale.log tp4/scale.log fp8best/scale.log prof2/scale.log final4/scale.log fused2/scale.log edge2/scale.log fusedgpt/scale.log fusedab/scale.log best2/scale.log best/scale.log bestgpt/scale.log dp4/scale.log dpgpt/scale.log dp4gpt/scale.log overlap/scale.log pp4/scale.log uneven/scale.log uneven2/scale.log startup/scale.log fault/fault.log cp/summary.tsv moe/summary.tsv generate/summary.txt; do
    [ -e "$ROOT/$f" ] && cp "$ROOT/$f" "$OUT/${f//\//_}"
  done
}
# The checkpoint benchmark, ours then PyTorch's.
CKPT='source .gpu/env.sh
  timeout 200 .gpu/bin/checkpoint_bench --preset gpt-1b --device cuda --dtype bf16 --repeats 3 --dir /tmp/bm_ckpt
  echo "rc=$?"
  timeout 150 python3 bench/torch_checkpoint.py --preset gpt-1b --device cuda --dtype bf16 --repeats 3 --dir /tmp/torch_ckpt
  echo "rc=$?"'
for s in "$@"; do
  case "$s" in
    overlap) step overlap env PART=overlap ITERS=8 LIMIT=150 PLAN=1 bash bench/scale_gpu_check.sh ;;
    pp4) step pp4 env PART=pp4 ITERS=8 LIMIT=150 PLAN=1 bash bench/scale_gpu_check.sh ;;
    best) step best env PART=best ITERS=${ITERS:-5} LIMIT=150 PLAN=1 bash bench/scale_gpu_check.sh ;;
    bestgpt) step bestgpt env PART=bestgpt ITERS=${ITERS:-5} LIMIT=150 PLAN=1 bash bench/scale_gpu_check.sh ;;
    best2) step best2 env PART=best2 ITERS=${ITERS:-5} LIMIT=170 bash bench/scale_gpu_check.sh ;;
    dp4gpt) step dp4gpt env PART=dp4gpt ITERS=${ITERS:-5} LIMIT=150 bash bench/scale_gpu_check.sh ;;
    fusedab) step fusedab env PART=fusedab ITERS=${ITERS:-3} LIMIT=150 OLD="${OLD:-}" bash bench/scale_gpu_check.sh ;;
    final4) step final4 env PART=final4 ITERS=${ITERS:-8} LIMIT=${LIMIT:-170} bash bench/scale_gpu_check.sh ;;
    fp8best) step fp8best env PART=fp8best ITERS=4 LIMIT=${LIMIT:-120} bash bench/scale_gpu_check.sh ;;
    tp4) step tp4 env PART=tp4 ITERS=5 LIMIT=${LIMIT:-90} bash bench/scale_gpu_check.sh ;;
    tp4big) step tp4big env PART=tp4big LIMIT=${LIMIT:-80} PLAN=1 bash bench/scale_gpu_check.sh ;;
    tp4short) step tp4short env PART=tp4short ITERS=4 LIMIT=${LIMIT:-110} bash bench/scale_gpu_check.sh ;;
    tp2) step tp2 env PART=tp2 NPROC=2 ITERS=4 LIMIT=${LIMIT:-120} bash bench/scale_gpu_check.sh ;;
    parts2) step parts2 env PART=parts2 NPROC=2 LIMIT=${LIMIT:-150} bash bench/scale_gpu_check.sh ;;
    prof2) step prof2 env PART=prof2 NPROC=2 ITERS=${ITERS:-8} LIMIT=${LIMIT:-150} bash bench/scale_gpu_check.sh ;;
    fused2) step fused2 env PART=fused2 NPROC=2 ITERS=${ITERS:-10} LIMIT=${LIMIT:-150} bash bench/scale_gpu_check.sh ;;
    edge2) step edge2 env PART=edge2 NPROC=2 ITERS=${ITERS:-4} LIMIT=${LIMIT:-150} bash bench/scale_gpu_check.sh ;;
    gradnorm) step gradnorm bash bench/gradnorm_gpu_check.sh ;;
    gputest) step gputest bash -c 'source .gpu/env.sh; timeout 200 .gpu/bin/gpu --test-threads=1 ${GPUTEST_FILTER:-} 2>&1 | tail -40' ;;
    fusedgpt) step fusedgpt env PART=fusedgpt ITERS=${ITERS:-3} LIMIT=90 OLD="${OLD:-}" bash bench/scale_gpu_check.sh ;;
    dpgpt) step dpgpt env PART=dpgpt ITERS=${ITERS:-5} LIMIT=150 bash bench/scale_gpu_check.sh ;;
    dp4) step dp4 env PART=dp4 ITERS=3 LIMIT=120 bash bench/scale_gpu_check.sh ;;
    uneven) step uneven env PART=uneven ITERS=8 LIMIT=150 PLAN=1 bash bench/scale_gpu_check.sh ;;
    startup) step startup env PART=startup ITERS=3 LIMIT=150 bash bench/scale_gpu_check.sh ;;
    uneven2) step uneven2 env PART=uneven2 ITERS=8 LIMIT=150 PLAN=1 bash bench/scale_gpu_check.sh ;;
    # Two uninterrupted GPU runs of one binary differ in the 4th decimal within 10 steps (the
    # kernels' autotuning picks by timing) and the difference grows with the learning rate:
    # the resumed run is compared with the uninterrupted one to 0.02.
    fault) step fault env TOL="${FAULT_TOL:-0.02}" bash bench/fault_gpu_check.sh ;;
    tpprof)
      # Where a TP 4 + SP step goes without and with --tp-comm-overlap (BM_PROFILE=1: per-kernel
      # GPU time, NCCL's lane, the compute stream's coverage), Llama 1B, 4 GPUs.
      step tpprof bash -c 'source .gpu/env.sh
        L="--preset llama-1b --batch 4 --dtype bf16 --steps 6 --warmup 2 --tensor-parallel 4 --sequence-parallel --top 14"
        for f in "" --tp-comm-overlap; do
          log=$OUT/tp4$f.log
          BM_PROFILE=1 timeout 150 .gpu/bin/bm-launch --nproc-per-node 4 -- .gpu/bin/gpt_train_bench $L $f > $log 2>&1
          echo "=== TP 4 + SP $f: rc=$?"; grep -vE "^\s*$|^note|backtrace" $log | head -45 | cut -c1-160
        done'
      ;;
    cp) step cp env PART="${CP_PART:-key}" NPROC="${CP_NPROC:-4}" BUDGET="${CP_BUDGET:-300}" bash bench/context_parallel_gpu_check.sh ;;
    moe) step moe env PART="${MOE_PART:-all}" NPROC="${MOE_NPROC:-4}" BUDGET="${MOE_BUDGET:-240}" bash bench/moe_gpu_check.sh ;;
    fp8)
      step fp8_gemm env PART=gemm bash bench/fp8_gpu_check.sh
      step fp8_step env PART=step bash bench/fp8_gpu_check.sh
      ;;
    fp8prof) step fp8prof env PART=profile bash bench/fp8_gpu_check.sh ;;
    fp8curve2) step fp8curve2 env PART=curve2 bash bench/fp8_gpu_check.sh ;;
    fp8curve3) step fp8curve3 env PART=curve3 bash bench/fp8_gpu_check.sh ;;
    fp8repeat) step fp8repeat env PART=repeat bash bench/fp8_gpu_check.sh ;;
    fp8recipes) step fp8recipes env PART=recipes bash bench/fp8_gpu_check.sh ;;
    fp8peer) step fp8peer env PART=peer bash bench/fp8_gpu_check.sh ;;
    fp8diag) step fp8diag env PART=diag bash bench/fp8_gpu_check.sh ;;
    fp8peer2) step fp8peer2 env PART=peer2 bash bench/fp8_gpu_check.sh ;;
    fp8bwd) step fp8bwd env PART=bwd bash bench/fp8_gpu_check.sh ;;
    fp8dp2) step fp8dp2 env PART=dp2 bash bench/fp8_gpu_check.sh ;;
    fp8dp2prof) step fp8dp2prof env PART=dp2prof bash bench/fp8_gpu_check.sh ;;
    fp8block1) step fp8block1 env PART=block1 SKIP_CASTS=1 bash bench/fp8_gpu_check.sh ;;
    fp8blockbook) step fp8blockbook env PART=blockbook bash bench/fp8_gpu_check.sh ;;
    fp8book) step fp8book env PART=curvebook bash bench/fp8_gpu_check.sh ;;
    fp8prof8b) step fp8prof8b env PART=profile8b bash bench/fp8_gpu_check.sh ;;
    fp8step8b) step fp8step8b env PART=step8b bash bench/fp8_gpu_check.sh ;;
    fp8step1) step fp8step1 env PART=step1 bash bench/fp8_gpu_check.sh ;;
    fp8hook1) step fp8hook1 env PART=hook1 bash bench/fp8_gpu_check.sh ;;
    fp8peer1) step fp8peer1 env PART=peer1 bash bench/fp8_gpu_check.sh ;;
    fp8peer8b) step fp8peer8b env PART=peer8b bash bench/fp8_gpu_check.sh ;;
    fp8prof1) step fp8prof1 env PART=prof1 bash bench/fp8_gpu_check.sh ;;
    fp8casts) step fp8casts env PART=casts bash bench/fp8_gpu_check.sh ;;
    fp8step) step fp8step env PART=step bash bench/fp8_gpu_check.sh ;;
    ckpt) step ckpt bash -c "$CKPT" ;;
    generate) step generate env BUDGET="${GEN_BUDGET:-520}" bash bench/generate_gpu_check.sh ;;
    # The one-GPU checks side by side on a machine of several GPUs: the checkpoint benchmark on
    # GPU 0, FP8's step on GPU 1 (separate GPUs: neither disturbs the other's timings much).
    single)
      mkdir -p "$ROOT/ckpt" "$ROOT/fp8_step"
      ( CUDA_VISIBLE_DEVICES=0 timeout 300 bash -c "$CKPT" > "$ROOT/ckpt/stdout.log" 2>&1 ) &
      ( CUDA_VISIBLE_DEVICES=1 OUT="$ROOT/fp8_step" timeout 400 env PART=step bash bench/fp8_gpu_check.sh > "$ROOT/fp8_step/stdout.log" 2>&1 ) &
      wait
      cat "$ROOT/ckpt/stdout.log" "$ROOT/fp8_step/stdout.log" | grep -vE "^\s*$" | tail -40
      pack
      ;;
    *) echo "unknown step $s" ;;
  esac
done
ls -la "$OUT"
