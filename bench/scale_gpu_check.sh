#!/usr/bin/env bash
# Model parallelism at 7-8B on 4 GPUs (issue 31) in one device call (kind nvidia-h100-x4 or
# nvidia-h200-x4): pretrain_gpt's layouts of the Llama-3 8B and GPT-3 6.7B presets
# (examples/configs) and the PyTorch FSDP2 peer (bench/torch_fsdp.py) on the same GPUs, plus the
# memory planner's table; logs go to $OUT. Needs, packed under .gpu/ (bench/pack_gpu.sh):
#   bin/{pretrain_gpt,bm-launch}   bench/pack_gpu.sh build --release --features cuda
#       -p burn-megatron-examples --example pretrain_gpt, and -p burn-megatron-dist --bin bm-launch
#   PART=plan|llama|gpt|layouts|interleaved|overlap|pp4|uneven|uneven2|startup|fp8|best|bestgpt|dp4|best2|dpgpt|dp4gpt|fusedab|fusedgpt|fused2|edge2|final4|fp8best|tp4|prof2|all ITERS=8 bash bench/scale_gpu_check.sh   (all: more than one call's 10 minutes)
# NPROC=2 runs ours and the peer on 2 GPUs (the parts fused2, edge2 and prof2 are for 2 GPUs).
# OLD=path runs the part fusedab's "before" runs with another pretrain_gpt (gunzipped if .gz).
set -u
cd "$(dirname "$0")/.."
source .gpu/env.sh
for z in .gpu/bin/*.gz ${OLD:+$OLD.gz}; do [ -e "$z" ] && gunzip -f "$z"; done 2>/dev/null
chmod +x .gpu/bin/* ${OLD:+$OLD} 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpus.txt
B=.gpu/bin
ITERS=${ITERS:-8}
part() { [ "${PART:-all}" = all ] || [ "${PART:-all}" = "$1" ]; }
COMMON="--bf16 --no-save --eval-interval 0 --log-interval 1 --collective-checks false --lr-warmup-iters 2"
# Each line of a run's log with the seconds since its launch ("[+12.3s]"): the first
# iteration's line tells how long a user waits for it.
stamp() { local t0=${EPOCHREALTIME/./} line; while IFS= read -r line; do printf '%s [+%d.%ds]\n' "$line" $(( (${EPOCHREALTIME/./} - t0) / 1000000 )) $(( (${EPOCHREALTIME/./} - t0) / 100000 % 10 )); done; }
ours() { # name, preset, flags...
  local name=$1 preset=$2; shift 2
  echo "=== ours $name: $preset $*" | tee -a $OUT/scale.log
  local s=$(date +%s)
  # The peak memory of the GPUs, sampled every 0.5 s (nvidia-smi: the CUDA context and NCCL's
  # buffers included), for the planner's predicted peak.
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > $OUT/$name.smi 2>/dev/null &
  local smi=$!
  timeout ${LIMIT:-240} $B/bm-launch --nproc-per-node ${NPROC:-4} -- ${BIN:-$B/pretrain_gpt} --config examples/configs/$preset.toml $COMMON --train-iters $ITERS "$@" 2>&1 | stamp > $OUT/$name.log
  echo "rc=${PIPESTATUS[0]} seconds=$(( $(date +%s) - s ))" | tee -a $OUT/scale.log
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  echo "peak MiB per GPU (nvidia-smi): $(awk -F', ' '{if ($2 > m[$1]) m[$1] = $2} END {for (g in m) printf "%s:%s ", g, m[g]}' $OUT/$name.smi)" | tee -a $OUT/scale.log
  if [ -n "${PLAN:-}" ]; then
    $B/pretrain_gpt --config examples/configs/$preset.toml $COMMON "$@" --plan --gpu-memory-gib 140 2>&1 | grep -iE "peak|fits|predicted|^ *TP|layout|^ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ " | head -16 | tee -a $OUT/scale.log
  fi
  grep -E "start-up|training a GPT|iteration +[0-9]+/|Error|error|panicked" $OUT/$name.log | tail -$((ITERS + 3)) | cut -c1-400 | tee -a $OUT/scale.log
}
torch() { # name, flags...
  local name=$1; shift
  echo "=== torch $name: $*" | tee -a $OUT/scale.log
  timeout ${LIMIT:-240} torchrun --nproc-per-node ${NPROC:-4} bench/torch_fsdp.py "$@" > $OUT/torch_$name.log 2>&1
  echo "rc=$?" | tee -a $OUT/scale.log
  grep -E "RESULT|step:|Error|error" $OUT/torch_$name.log | tail -4 | cut -c1-400 | tee -a $OUT/scale.log
}
if part plan; then
  for preset in llama3_8b gpt3_6.7b; do
    $B/pretrain_gpt --config examples/configs/$preset.toml --bf16 --plan \
      --gpu-memory-gib $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print int($1/1024)}') \
      --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 4 \
      --use-distributed-optimizer | tee -a $OUT/plan.log
  done
fi
if part llama; then
  ours llama_tp2pp2 llama3_8b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
  torch llama_fsdp --preset llama3-8b --batch 1 --steps $ITERS
  ours llama_tp4 llama3_8b --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel
fi
if part gpt; then
  ours gpt_tp2pp2 gpt3_6.7b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
  torch gpt_fsdp --preset gpt3-6.7b --batch 2 --steps $ITERS
  ours gpt_tp4 gpt3_6.7b --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel
fi
if part layouts; then
  # The planner's first choice, micro-batch 2 at TP 2 x PP 2, and a learning rate that a
  # run of a few steps trains at (the preset's 3e-4 wants its 100 warm-up steps).
  ours llama_tp2dp2 llama3_8b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --data-parallel-size 2 --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce
  ours llama_tp2pp2_mb2 llama3_8b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --micro-batch-size 2
  ours llama_tp2pp2_lr3e-5 llama3_8b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --lr 3e-5 --min-lr 3e-6
fi
if part interleaved; then
  # 1F1B against the interleaved schedule (2 and 4 chunks a rank) at TP 2 x PP 2, and the peer.
  L="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel"
  ours llama_tp2pp2_1f1b llama3_8b $L
  ours llama_tp2pp2_vp2 llama3_8b $L --num-layers-per-virtual-pipeline-stage 8
  torch llama_fsdp --preset llama3-8b --batch 1 --steps $ITERS
  ours llama_tp2pp2_vp4 llama3_8b $L --num-layers-per-virtual-pipeline-stage 4
fi
if part fp8; then
  # FP8 (issue 33): Llama-3 8B at TP 2 x PP 2 interleaved (4 chunks a rank, global batch 32),
  # bf16 against FP8 (hybrid, tensorwise), and the FSDP2 peer in bf16 and float8.
  L="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --num-layers-per-virtual-pipeline-stage 4 --global-batch-size 32"
  ours llama_vp4_gb32_bf16 llama3_8b $L
  ours llama_vp4_gb32_fp8 llama3_8b $L --fp8-format hybrid --fp8-recipe tensorwise
  torch llama_fsdp_bf16 --preset llama3-8b --batch 1 --steps $ITERS
  torch llama_fsdp_fp8 --preset llama3-8b --batch 1 --steps $ITERS --fp8
fi
if part overlap; then
  # --tp-comm-overlap (issue 31): Llama-3 8B at TP 4 + SP and at the best layout (TP 2 x PP 2
  # interleaved, 4 chunks a rank, global batch 32), each without and with it, and the peer.
  T4="--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel"
  L="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --num-layers-per-virtual-pipeline-stage 4 --global-batch-size 32"
  ours llama_tp4 llama3_8b $T4
  ours llama_tp4_overlap llama3_8b $T4 --tp-comm-overlap
  ours llama_vp4_gb32 llama3_8b $L
  ours llama_vp4_gb32_overlap llama3_8b $L --tp-comm-overlap
  torch llama_fsdp --preset llama3-8b --batch 1 --steps $ITERS
fi
if part pp4; then
  # The planner's first choice for Llama-3 8B on 4 GPUs: no tensor parallelism, PP 4
  # interleaved (4 chunks of 2 layers a rank), global batch 32.
  ours llama_pp4_vp4_gb32 llama3_8b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2 --global-batch-size 32
fi
if part uneven; then
  # Uneven stages (issue 31): Llama-3 8B at PP 4 interleaved (4 chunks a rank, global batch
  # 32), the even split (8 layers a rank: the last rank also runs the 128k-vocabulary output
  # layer) against 9, 9, 9 and 5 layers, and the FSDP2 peer at 1 sample a GPU.
  P4="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --global-batch-size 32"
  ours llama_pp4_vp4_even llama3_8b $P4 --num-layers-per-virtual-pipeline-stage 2
  ours llama_pp4_vp4_last5 llama3_8b $P4 --num-virtual-stages-per-pipeline-rank 4 --decoder-last-pipeline-num-layers 5
  torch llama_fsdp_b1 --preset llama3-8b --batch 1 --steps $ITERS
fi
if part uneven2; then
  # The same at TP 2 x PP 2 (17 and 15 layers), 1F1B at PP 4 with 9, 9, 9, 5, and the peer at
  # 2 samples a GPU (its best configuration may not be 1).
  ours llama_tp2pp2_vp4_last15 llama3_8b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --global-batch-size 32 --num-virtual-stages-per-pipeline-rank 4 --decoder-last-pipeline-num-layers 15
  torch llama_fsdp_b2 --preset llama3-8b --batch 2 --steps $ITERS
  ours llama_pp4_last5 llama3_8b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --global-batch-size 32 --decoder-last-pipeline-num-layers 5
fi
if part startup; then
  # Start-up with the initial values drawn on the GPU (issue 31: the first iteration within
  # 30 s of launch on every layout): DP 4 with the distributed optimizer (each rank holds the
  # whole 8B model), TP 2 x PP 2 and PP 4 with 9, 9, 9, 5 layers; 3 iterations each.
  ours llama_dp4_zero llama3_8b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 4 --use-distributed-optimizer --overlap-grad-reduce --global-batch-size 16
  ours llama_tp2pp2_start llama3_8b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
  ours llama_pp4_last5_start llama3_8b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 5
fi
if part best; then
  # Issue 31's 1.15x: Llama-3 8B at micro-batch 2 with fewer pipeline stages, the bubble cut by
  # a global batch of 128 (32 microbatches a pipeline at PP 2 x DP 2), against the peer at its
  # best configuration (2 samples a GPU).
  torch llama_fsdp_b2 --preset llama3-8b --batch 2 --steps $ITERS
  ours llama_pp2dp2_last15_gb128 llama3_8b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 2 --global-batch-size 128 --decoder-last-pipeline-num-layers 15
  [ -n "${PP4:-}" ] && ours llama_pp4_last5_gb128 llama3_8b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --micro-batch-size 2 --global-batch-size 128 --decoder-last-pipeline-num-layers 5
fi
if part bestgpt; then
  # The same for the GPT-3 6.7B shape (seq 2048, 4 samples a microbatch: 8192 tokens, as
  # Llama's 2 x 4096), and the peer at 2 and 4 samples a GPU.
  [ -n "${GPT_B2:-}" ] && torch gpt_fsdp_b2 --preset gpt3-6.7b --batch 2 --steps $ITERS
  torch gpt_fsdp_b4 --preset gpt3-6.7b --batch 4 --steps $ITERS
  ours gpt_pp2dp2_gb256 gpt3_6.7b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 4 --global-batch-size 256 ${GPT_LAST:+--decoder-last-pipeline-num-layers $GPT_LAST}
fi
if part dp4; then
  # DP 4 with the distributed optimizer at 8B (each rank the whole model): the memory it
  # needs, micro-batch 1.
  ours llama_dp4_zero_mb1 llama3_8b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 4 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 1 --global-batch-size 64
fi
if part best2; then
  # After the fused gradient accumulation: Llama-3 8B at PP 2 x DP 2 (17 + 15 layers) with
  # global batches of 128 and 256, GPT-3 6.7B at PP 2 x DP 2, each peer at its best
  # configuration, and a profile of the Llama run (ranks 0 and 2, one iteration).
  L="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 2 --decoder-last-pipeline-num-layers 15"
  torch llama_fsdp_b2 --preset llama3-8b --batch 2 --steps $ITERS
  ITERS=4 ours llama_pp2dp2_gb128 llama3_8b $L --global-batch-size 128
  ITERS=4 ours llama_pp2dp2_gb256 llama3_8b $L --global-batch-size 256
  torch gpt_fsdp_b4 --preset gpt3-6.7b --batch 4 --steps $ITERS
  ITERS=4 ours gpt_pp2dp2_gb256 gpt3_6.7b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 4 --global-batch-size 256
  BM_PROFILE=1 ITERS=3 ours llama_pp2dp2_profile llama3_8b $L --global-batch-size 64 --profile --profile-step-start 2 --profile-step-end 3 --profile-ranks 0 2
fi
if part dpgpt; then
  # GPT-3 6.7B without a pipeline (the planner's first choice: DP 4 with the distributed
  # optimizer, each rank the whole model, micro-batch 4), and PP 2 x DP 2 at global batch 512
  # (64 microbatches a pipeline: the bubble 1/65), against the peer at 4 samples a GPU.
  torch gpt_fsdp_b4 --preset gpt3-6.7b --batch 4 --steps $ITERS
  ITERS=4 ours gpt_dp4_mb4_gb256 gpt3_6.7b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 4 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 4 --global-batch-size 256
  ITERS=3 ours gpt_pp2dp2_gb512 gpt3_6.7b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 4 --global-batch-size 512
fi
if part dp4gpt; then
  # GPT-3 6.7B at DP 4 only (after the memory pools' change), and the peer.
  torch gpt_fsdp_b4 --preset gpt3-6.7b --batch 4 --steps $ITERS
  ITERS=4 ours gpt_dp4_mb4_gb256 gpt3_6.7b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 4 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 4 --global-batch-size 256
fi
if part fusedab; then
  # The gradient-accumulation fusion (issue 31) against the build before it (OLD=...), same
  # machine, layouts that fit 80 GB: Llama-3 8B at PP 2 x DP 2 (17 + 15 layers), micro-batch
  # 1, global batch 128; GPT-3 6.7B at PP 2 x DP 2, micro-batch 4, global batch 256; each
  # peer at its best configuration.
  L="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --decoder-last-pipeline-num-layers 15 --micro-batch-size 1 --global-batch-size 128"
  G="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 4 --global-batch-size 256"
  ours llama_pp2dp2_mb1_fused llama3_8b $L
  [ -n "${OLD:-}" ] && BIN=$OLD ours llama_pp2dp2_mb1_before llama3_8b $L
  torch llama_fsdp_b2 --preset llama3-8b --batch 2 --steps $ITERS
  ours gpt_pp2dp2_fused gpt3_6.7b $G
  [ -n "${OLD:-}" ] && BIN=$OLD ours gpt_pp2dp2_before gpt3_6.7b $G
  torch gpt_fsdp_b4 --preset gpt3-6.7b --batch 4 --steps $ITERS
fi
if part fused2; then
  # 2 GPUs of 80 GB: the gradient-accumulation fusion on and off in the same binary, GPT-3
  # 6.7B's shape with 16 layers (3.4B), DP 2 with the distributed optimizer, micro-batch 2,
  # global batch 64 (16 microbatches a rank), and the FSDP2 peer for the same shape.
  G="--num-layers 16 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 2 --global-batch-size 64"
  ours gpt16_dp2_fused gpt3_6.7b $G
  ours gpt16_dp2_unfused gpt3_6.7b $G --no-gradient-accumulation-fusion
  torch gpt16_fsdp_b2 --preset gpt3-6.7b --layers 16 --batch 2 --steps $ITERS
fi
if part edge2; then
  # 2 GPUs of 80 GB: GPT-3 6.7B at PP 2, micro-batch 1, whose predicted peak (64.0 GiB) is past
  # the planner's allowance: where runs stalled before the communicators opened at start-up.
  ours gpt_pp2_edge gpt3_6.7b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --data-parallel-size 1 --micro-batch-size 1 --global-batch-size 32
fi
if part fusedgpt; then
  # The fusion's A/B on 80 GB GPUs where the part fusedab's layouts do not fit (H100s): GPT-3
  # 6.7B at PP 2 x DP 2, micro-batch 2, global batch 128 (32 microbatches a pipeline).
  G="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 2 --global-batch-size 128"
  ours gpt_pp2dp2_mb2_fused gpt3_6.7b $G
  [ -n "${OLD:-}" ] && BIN=$OLD ours gpt_pp2dp2_mb2_before gpt3_6.7b $G
fi
if part final4; then
  # Issue 31's targets after the fused gradient accumulation (4 GPUs): each model's best layout
  # so far against the peer at its best configuration, TP 4 + SP at a micro-batch that fills
  # the GEMMs, the planner's peak beside each run, and a profile of GPT's DP 4 step.
  L="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 2 --decoder-last-pipeline-num-layers 15"
  G="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 4 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 4"
  T4="--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel"
  torch llama_fsdp_b2 --preset llama3-8b --batch 2 --steps $ITERS
  PLAN=1 ITERS=4 ours llama_pp2dp2_gb256 llama3_8b $L --global-batch-size 256
  torch gpt_fsdp_b4 --preset gpt3-6.7b --batch 4 --steps $ITERS
  PLAN=1 ITERS=4 ours gpt_dp4_gb256 gpt3_6.7b $G --global-batch-size 256
  PLAN=1 ITERS=5 ours llama_tp4_mb2 llama3_8b $T4 --micro-batch-size 2 --global-batch-size 32
  PLAN=1 ITERS=5 ours gpt_tp4_mb4 gpt3_6.7b $T4 --micro-batch-size 4 --global-batch-size 64
  [ -n "${PROFILE:-}" ] && BM_PROFILE=1 ITERS=3 ours gpt_dp4_profile gpt3_6.7b $G --global-batch-size 64 --profile --profile-step-start 2 --profile-step-end 3 --profile-ranks 0
fi
if part fp8best; then
  # FP8 (issue 33) at Llama-3 8B's best 4-GPU layout (PP 2 x DP 2, 17 + 15 layers,
  # micro-batch 2), global batch 128: bf16 against FP8 tensorwise.
  L="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 2 --decoder-last-pipeline-num-layers 15 --global-batch-size 128"
  ITERS=4 ours llama_pp2dp2_gb128_bf16 llama3_8b $L
  ITERS=4 ours llama_pp2dp2_gb128_fp8 llama3_8b $L --fp8-format hybrid --fp8-recipe tensorwise
fi
if part prof2; then
  # 2 GPUs of 140 GB: GPT-3 6.7B's shape with 16 layers at DP 2 (each rank's work per layer as
  # at DP 4 with 32), micro-batch 4, against the peer at 4 samples a GPU, and one step of ours
  # profiled on rank 0; then FP8 (issue 33) at Llama-3 8B's shape, PP 2 (17 + 15 layers),
  # micro-batch 1, bf16 against FP8 tensorwise, and the peer in bf16 and float8.
  G="--num-layers 16 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 4"
  P="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 32 --decoder-last-pipeline-num-layers 15"
  torch gpt16_fsdp_b4 --preset gpt3-6.7b --layers 16 --batch 4 --steps $ITERS
  ITERS=5 ours gpt16_dp2_mb4 gpt3_6.7b $G --global-batch-size 64
  BM_PROFILE=1 ITERS=3 ours gpt16_dp2_profile gpt3_6.7b $G --global-batch-size 32 --profile --profile-step-start 2 --profile-step-end 3 --profile-ranks 0
  ITERS=5 ours llama_pp2_bf16 llama3_8b $P
  ITERS=5 ours llama_pp2_fp8 llama3_8b $P --fp8-format hybrid --fp8-recipe tensorwise
  torch llama_fsdp2_bf16 --preset llama3-8b --batch 1 --steps $ITERS
  torch llama_fsdp2_fp8 --preset llama3-8b --batch 1 --steps $ITERS --fp8
fi
if part tp2; then
  # For 2 GPUs (NPROC=2): the chunked forward reduce-scatter of --tp-comm-overlap measured at
  # TP 2 + SP (Llama-3 8B, micro-batch 2), without and with it.
  T2="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel"
  ITERS=4 ours llama_tp2_mb2 llama3_8b $T2 --micro-batch-size 2 --global-batch-size 16
  ITERS=4 ours llama_tp2_mb2_overlap llama3_8b $T2 --micro-batch-size 2 --global-batch-size 16 --tp-comm-overlap
fi
if part parts2; then
  # For 2 GPUs (NPROC=2): the dense parameters' flat buffers past 32-bit indices, cut into
  # parts (2026-11-28): Llama-3 8B at DP 2 with the distributed optimizer (every rank's bf16
  # and gradient buffers hold all 8.03 B parameters: two parts), micro-batch 1, full
  # recomputation; refused at start-up before the parts.
  ITERS=4 PLAN=1 ours llama_dp2_parts llama3_8b --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 \
    --data-parallel-size 2 --use-distributed-optimizer --micro-batch-size 1 --global-batch-size 8 --recompute-granularity full
fi
if part tp4short; then
  # Issue 31's TP 4 + SP >= 45 % in little device time: Llama-3 8B at micro-batch 2, without
  # and with --tp-comm-overlap (the chunked forward reduce-scatter), 4 iterations each.
  T4="--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel"
  ITERS=4 ours llama_tp4_mb2 llama3_8b $T4 --micro-batch-size 2 --global-batch-size 32
  ITERS=4 ours llama_tp4_mb2_overlap llama3_8b $T4 --micro-batch-size 2 --global-batch-size 32 --tp-comm-overlap
fi
if part tp4big; then
  # Issue 31's TP 4 + SP >= 45 % at larger micro-batches, 6 iterations each, with the
  # planner's prediction (PLAN=1): GPT-3 6.7B at micro-batch 16, Llama-3 8B at 4.
  T4="--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel"
  ITERS=6 ours gpt_tp4_mb16 gpt3_6.7b $T4 --micro-batch-size 16 --global-batch-size 64
  ITERS=6 ours llama_tp4_mb4 llama3_8b $T4 --micro-batch-size 4 --global-batch-size 32
fi
if part tp4; then
  # Issue 31's TP 4 + SP >= 45 %: Llama-3 8B at micro-batches 2 and 4, each without and with
  # --tp-comm-overlap (the chunked forward reduce-scatter), and GPT-3 6.7B at micro-batch 8.
  T4="--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel"
  ITERS=5 ours llama_tp4_mb2 llama3_8b $T4 --micro-batch-size 2 --global-batch-size 32
  ITERS=5 ours llama_tp4_mb2_overlap llama3_8b $T4 --micro-batch-size 2 --global-batch-size 32 --tp-comm-overlap
  ITERS=5 ours llama_tp4_mb4 llama3_8b $T4 --micro-batch-size 4 --global-batch-size 32
  ITERS=5 ours llama_tp4_mb4_overlap llama3_8b $T4 --micro-batch-size 4 --global-batch-size 32 --tp-comm-overlap
  ITERS=5 ours gpt_tp4_mb8 gpt3_6.7b $T4 --micro-batch-size 8 --global-batch-size 64
  # Where the 8B TP 4 step goes (rank 0, one step): the exposed communication at this size.
  BM_PROFILE=1 ITERS=3 ours llama_tp4_mb2_profile llama3_8b $T4 --micro-batch-size 2 --global-batch-size 16 --tp-comm-overlap --profile --profile-step-start 2 --profile-step-end 3 --profile-ranks 0
fi
