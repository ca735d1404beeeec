#!/usr/bin/env bash
# Text generation on GPUs against transformers (issue 37), in one device call on 2 GPUs:
#
# 1. Greedy tokens: a random Hugging Face Llama of Llama-3.2-1B's shape in f32
#    (bench/torch_generate.py make), four prompts of 1 to 40 token ids, 32 new tokens each:
#    `generate --hf --device cuda` at TP 1 and TP 2 against transformers' greedy `generate`
#    (each prompt alone, the default cache, f32 without TF32; ours may use TF32 in f32).
#    Per prompt: PASS (equal ids), TIE (a first difference, but on our sequence every pick of
#    ours is transformers' argmax or a near tie of its logits: rounding decided) or FAIL,
#    with the first differing position.
# 2. Decode speed in bf16: batch 1 and 32, prompts of $PROMPT random ids, $NEW new tokens:
#    ours (`generate --benchmark --preset llama-1b`) at TP 1 and TP 2 (its decode step a CUDA
#    graph, and with BM_CUDA_GRAPHS=0 without), transformers' (at TP 2 its own tensor
#    parallelism, tp_plan="auto" under torchrun)
#    `generate` with the static cache, eager and with its torch.compile. A table at the end.
#
#   bash bench/pack_gpu.sh build --release --features cuda -p burn-megatron-examples --example generate
#   # device call, kind nvidia-h200-x2 (or nvidia-h100-x2), carry [".gpu"]:
#   bash bench/generate_gpu_check.sh
#
# $OUT gets summary.txt and logs.tgz (every log, packed again after each step: a device call
# returns at most 8 files, and one cut at its limit still returns what ran). Every step has
# its own time limit, and none starts past $BUDGET seconds (default 520) from the start, so
# the call ends within the device's 600 s.
# Settings: NEW (64), PROMPT (128), REPEATS (3), BUDGET (520), BATCHES ("1,32"), GPUS (2; 1 runs
# on one GPU without the TP 2 runs), GREEDY (1; 0 skips the greedy checks), PROFILE (0; 1 adds a
# profiled batch-1 run without the graph).
set -u
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder the call returns}"
source .gpu/env.sh
for z in .gpu/bin/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done 2>/dev/null
chmod +x .gpu/bin/* 2>/dev/null
GEN=.gpu/bin/generate
NEW=${NEW:-64} PROMPT=${PROMPT:-128} REPEATS=${REPEATS:-3} BUDGET=${BUDGET:-520}
BATCHES=${BATCHES:-1,32}
GPUS=${GPUS:-2}  # 1: one GPU, no TP 2 runs, the compile prewarm on GPU 0
PREWARM_GPU=1; (( GPUS < 2 )) && PREWARM_GPU=0
W=/tmp/bm_generate
LOGS=$W/logs
rm -rf "$LOGS" && mkdir -p "$LOGS"
START=$(date +%s)
SUMMARY=$OUT/summary.txt
say() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME LIMIT COMMAND...: runs COMMAND with its output in $LOGS/NAME.log, cut at LIMIT
# seconds or at what is left of the budget; skipped when the budget is spent.
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 20 )); then say "[$name] skipped: the budget of $BUDGET s is spent"; return 1; fi
  (( limit > left )) && limit=$left
  local s=$(date +%s)
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  say "[$name] rc=$rc in $(( $(date +%s) - s )) s (limit $limit s): $*"
  (( rc == 0 )) || tail -5 "$LOGS/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
  return $rc
}

say "generate_gpu_check $(date -u +%FT%TZ): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"

# --- 1. greedy tokens against transformers (f32) ---
HF=$W/llama1b_f32
step make 150 python3 bench/torch_generate.py make "$HF" --preset llama-1b --dtype f32 --seed 0
grep -h "^made" "$LOGS/make.log" | tee -a "$SUMMARY"
# transformers' torch.compile of bf16 decoding, compiled once ahead on GPU 1 while the greedy
# checks run (their timing does not matter), so that the timed run at the end reuses
# inductor's on-disk cache instead of compiling for minutes.
B="--batch-size $BATCHES --prompt-length $PROMPT --max-new-tokens $NEW"
( CUDA_VISIBLE_DEVICES=$PREWARM_GPU timeout 240 python3 bench/torch_generate.py bench "$HF" --dtype bf16 --compile $B \
    --repeats 0 > "$LOGS/torch_compile_prewarm.log" 2>&1; echo "[torch_compile_prewarm] rc=$?" >> "$SUMMARY" ) &
PREWARM=$!
# Prompts of 1, 5, 17 and 40 ids (any ids of the vocabulary; no bos token).
ids() { local n=$1 seed=$2 out=() i; for ((i = 0; i < n; i++)); do out+=($(( (seed * 1000003 + i * 7919 + 17) % 128256 ))); done; (IFS=,; echo "${out[*]}"); }
PROMPTS=()
for p in "1 1" "5 2" "17 3" "40 4"; do PROMPTS+=(--prompt-ids "$(ids $p)"); done
[ "${GREEDY:-1}" = 1 ] && step ours_greedy 150 env CUDA_VISIBLE_DEVICES=0 $GEN --device cuda --hf "$HF" "${PROMPTS[@]}" --max-new-tokens 32 --ignore-eos
(( GPUS > 1 )) && [ "${GREEDY:-1}" = 1 ] && step ours_greedy_tp2 150 $GEN --device cuda --hf "$HF" --tp 2 "${PROMPTS[@]}" --max-new-tokens 32 --ignore-eos
# transformers' greedy ids (printed), compared with both of ours.
[ "${GREEDY:-1}" = 1 ] && step compare 120 env CUDA_VISIBLE_DEVICES=0 python3 bench/torch_generate.py greedy "$HF" "${PROMPTS[@]}" \
  --max-new-tokens 32 --ours "$LOGS/ours_greedy.log" $( (( GPUS > 1 )) && echo --ours "$LOGS/ours_greedy_tp2.log")
grep -hE "^(PASS|TIE|FAIL|GREEDY)" "$LOGS/compare.log" 2>/dev/null | tee -a "$SUMMARY"

# --- 2. decode speed (bf16) ---
wait $PREWARM
B="$B --repeats $REPEATS"
step ours_tp1 150 env CUDA_VISIBLE_DEVICES=0 $GEN --device cuda --bf16 --preset llama-1b --benchmark $B
# The same without the decode step's CUDA graph (each step's ~500 kernels launched one by one).
step ours_tp1_nograph 150 env BM_CUDA_GRAPHS=0 CUDA_VISIBLE_DEVICES=0 $GEN --device cuda --bf16 --preset llama-1b --benchmark $B
# PROFILE=1: one batch-1 run without the graph, its kernels profiled (BM_PROFILE), for the
# kernel count and GPU time of a step.
[ "${PROFILE:-0}" = 1 ] && step ours_tp1_profile 120 env BM_PROFILE=1 BM_CUDA_GRAPHS=0 CUDA_VISIBLE_DEVICES=0 $GEN --device cuda --bf16 --preset llama-1b --benchmark \
  --batch-size 1 --prompt-length $PROMPT --max-new-tokens $NEW --repeats 1 --profile
step torch_eager 120 env CUDA_VISIBLE_DEVICES=0 python3 bench/torch_generate.py bench "$HF" --dtype bf16 $B
step torch_compile 200 env CUDA_VISIBLE_DEVICES=0 python3 bench/torch_generate.py bench "$HF" --dtype bf16 --compile $B
(( GPUS > 1 )) && step ours_tp2 150 $GEN --device cuda --bf16 --preset llama-1b --tp 2 --benchmark $B
(( GPUS > 1 )) && step ours_tp2_nograph 150 env BM_CUDA_GRAPHS=0 $GEN --device cuda --bf16 --preset llama-1b --tp 2 --benchmark $B
# transformers' own tensor parallelism (tp_plan="auto" under torchrun), eager and compiled.
(( GPUS > 1 )) && step torch_tp2_eager 150 torchrun --nproc-per-node 2 bench/torch_generate.py bench "$HF" --dtype bf16 $B
(( GPUS > 1 )) && step torch_tp2_compile 240 torchrun --nproc-per-node 2 bench/torch_generate.py bench "$HF" --dtype bf16 --compile $B

say ""
say "decode tokens/s (bf16, prompts of $PROMPT ids, $NEW new tokens; decode = the $((NEW - 1)) after the first):"
row() { printf '%-22s %-9s %3s %6s %11s %9s %10s\n' "$@" | tee -a "$SUMMARY"; }
row run compile tp batch prefill_ms ms/step tok/s
for log in ours_tp1 ours_tp1_nograph ours_tp2 ours_tp2_nograph torch_eager torch_compile torch_tp2_eager torch_tp2_compile; do  # whatever ran
  [ -e "$LOGS/$log.log" ] || continue
  grep -h "^RESULT generate" "$LOGS/$log.log" | while read -r line; do
    f() { local v; v=$(echo "$line" | grep -oE "(^| )$1=[^ ]+" | cut -d= -f2); echo "${v:--}"; }
    row "$log" "$(f compile)" "$(f tp)" "$(f batch)" "$(f prefill_ms)" "$(f decode_ms_per_step)" "$(f decode_tok_s)"
  done
done
say "total $(( $(date +%s) - START )) s"
tar czf "$OUT/logs.tgz" -C "$LOGS" .
ls -la "$OUT"
