#!/usr/bin/env bash
# FP8 on one GPU (issue 33) in one device call: the casts (one layout a kernel, and both layouts
# with the amax in one pass; vectorised and scalar kernels) and FP8 GEMMs against their
# references and their times, against bf16 (`gemm_bench fp8`; peer `torch_gemm.py --fp8`), the
# GPT 1.3B training step in bf16 and FP8 (`gpt_train_bench`; peer `torch_train.py --fp8`), the
# same step in 4 microbatches with the weights' FP8 casts kept for the step or made in every
# microbatch (`--fp8-no-weight-cache`), and the loss curves of a 350M GPT
# on real text in bf16 and FP8 (`pretrain_gpt`, 1000 steps). Needs, packed under .gpu/
# (bench/pack_gpu.sh): bin/{gemm_bench,gpt_train_bench,pretrain_gpt,bm-launch} and the corpus
# data/realtext_text_document (bench/make_realtext.py, then preprocess_data).
# PART=casts runs the casts' checks and speeds alone (`gemm_bench fp8-casts`) and prints the
# tile kernels' registers (`ptxas -v` on the dumped PTX).
#   PART=gemm|casts|step|profile|cache|curve|curve2|curve3|repeat|recipes|peer|peer2|bwd|curvebook|dp2|dp2prof|diag|profile8b|step8b|step1|hook1|peer1|peer8b|prof1|block1|blockbook|all bash bench/fp8_gpu_check.sh   (or several: PART="gemm cache")
set -u
cd "$(dirname "$0")/.."
for z in .gpu/bin/*.gz .gpu/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
chmod +x .gpu/bin/*
source .gpu/env.sh
B=.gpu/bin
part() { [ "${PART:-all}" = all ] || [[ " ${PART} " == *" $1 "* ]]; }
# The 350M GPT on real text of the loss-curve parts (curve2, curve3, repeat, recipes).
C350="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --num-layers 24 --hidden-size 1024
  --num-attention-heads 16 --seq-length 1024 --micro-batch-size 8 --global-batch-size 16
  --train-iters ${ITERS:-1000} --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 100 --log-interval 25
  --split 98,2,0 --data-path .gpu/data/realtext_text_document --bf16 --no-save
  --collective-checks false"
nvidia-smi --query-gpu=name --format=csv,noheader
if part gemm; then
  timeout 150 $B/gemm_bench fp8 > $OUT/gemm_ours.log 2>&1; echo "rc=$?"
  grep -v "^$" $OUT/gemm_ours.log | grep -v "^note\|backtrace" | head -120
fi
if part step; then
  for f in "" "--fp8-format hybrid --fp8-recipe tensorwise" "--fp8-format hybrid --fp8-recipe delayed"; do
    n=step$(echo "$f" | tr -d ' -' | cut -c1-30)
    timeout 120 $B/gpt_train_bench --preset gpt-1.3b --batch 8 --steps 6 --warmup 2 --dtype bf16 $f > $OUT/$n.log 2>&1
    echo "rc=$?"; grep -hE "RESULT|rror|panick" $OUT/$n.log | cut -c1-700 | head -3
  done
  timeout 150 python3 bench/torch_train.py --preset gpt-1.3b --batch 8 --steps 6 --warmup 2 --mode compile --fp8 > $OUT/torch_fp8.log 2>&1
  grep -E "RESULT|Error" $OUT/torch_fp8.log | tail -2
fi
if part profile; then
  # Where the FP8 step's time goes against bf16's (BM_PROFILE=1: per-kernel GPU time, the
  # 14 largest), GPT 1.3B, batch 8 x 2048.
  for f in "" "--fp8-format hybrid --fp8-recipe tensorwise"; do
    n=prof$(echo "$f" | tr -d ' -' | cut -c1-30)
    BM_PROFILE=1 timeout 150 $B/gpt_train_bench --preset gpt-1.3b --batch 8 --steps 6 --warmup 2 --dtype bf16 --top 24 $f > $OUT/$n.log 2>&1
    echo "=== profile ${f:-bf16}: rc=$?"; grep -vE "^\s*$|^note|backtrace" $OUT/$n.log | head -60 | cut -c1-170
  done
fi
if part casts; then
  # The casts alone: their checks and speeds, and the tile kernels' registers (`ptxas -v` on
  # the PTX our runtime dumps).
  BM_DUMP_KERNELS=$OUT/kernels timeout 90 $B/gemm_bench fp8-casts > $OUT/casts.log 2>&1
  echo "=== casts: rc=$? bytes differing in $(grep -cE ": [1-9][0-9]* of" $OUT/casts.log) checks of $(grep -c " of " $OUT/casts.log)"
  grep -E "us,|rror|panick" $OUT/casts.log | cut -c1-160
  for f in $(ls $OUT/kernels/*.ptx 2>/dev/null | grep -i "quantize_*tiles"); do
    echo "$(basename $f): $(/usr/local/cuda/bin/ptxas -v --gpu-name sm_90a "$f" -o /dev/null 2>&1 | grep -oE "Used [0-9]+ registers")"
  done
fi
if part cache; then
  # The weight casts made once per optimizer step against once per microbatch: 4 microbatches
  # of 2 x 2048 a step (the same tokens a step as above), bf16 for reference.
  for f in "" "--fp8-format hybrid --fp8-recipe tensorwise" "--fp8-format hybrid --fp8-recipe tensorwise --fp8-no-weight-cache"; do
    n=mb4$(echo "$f" | tr -d ' -' | cut -c1-40)
    timeout 120 $B/gpt_train_bench --preset gpt-1.3b --batch 2 --micro-batches 4 --steps 6 --warmup 2 --dtype bf16 $f > $OUT/$n.log 2>&1
    echo "rc=$?"; grep -hE "RESULT|rror|panick" $OUT/$n.log | cut -c1-700 | head -3
  done
fi
if part curve; then
  C="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --num-layers 24 --hidden-size 1024
     --num-attention-heads 16 --seq-length 1024 --micro-batch-size 8 --global-batch-size 16
     --train-iters ${ITERS:-1000} --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 100 --eval-interval 0
     --log-interval 25 --split 98,2,0 --data-path .gpu/data/realtext_text_document --bf16 --no-save
     --collective-checks false"
  for f in "" "--fp8-format hybrid --fp8-recipe tensorwise"; do
    n=curve$(echo "$f" | tr -d ' -' | cut -c1-30)
    timeout ${LIMIT:-170} $B/bm-launch --nproc-per-node 1 -- $B/pretrain_gpt $C $f > $OUT/$n.log 2>&1
    echo "rc=$?"; grep -E "iteration +[0-9]+/|rror|panick" $OUT/$n.log | awk 'NR % 4 == 0' | cut -c1-220
  done
fi
if part curve2; then
  # 2 GPUs: the 350M curves of PART=curve side by side (bf16 on GPU 0, FP8 on GPU 1), with the
  # validation loss on held-out text every 100 iterations (the late gap: memorised or learnt?).
  for z in .gpu/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
  C="$C350 --eval-interval 100 --eval-iters 20"
  # (each run its own rendezvous port: both launchers run at once)
  [ -n "${ONLY_FP8:-}" ] || CUDA_VISIBLE_DEVICES=0 timeout ${LIMIT:-300} $B/bm-launch --nproc-per-node 1 -- $B/pretrain_gpt $C > $OUT/curve2_bf16.log 2>&1 &
  [ -n "${ONLY_BF16:-}" ] || CUDA_VISIBLE_DEVICES=1 timeout ${LIMIT:-300} $B/bm-launch --nproc-per-node 1 --master-port 29511 -- $B/pretrain_gpt $C --fp8-format hybrid --fp8-recipe tensorwise > $OUT/curve2_fp8.log 2>&1 &
  wait
  for n in bf16 fp8; do
    echo "=== curve2 $n"; grep -E "iteration +[0-9]+/|validation|rror|panick" $OUT/curve2_$n.log | awk '/validation/ || NR % 4 == 0' | cut -c1-200
  done
fi
if part curve3; then
  # 1 GPU: curve2's 350M runs at once on the one GPU (each its own rendezvous port): bf16, FP8
  # hybrid tensorwise, and FP8 with the first and last layers in bf16 (--first-last-layers-bf16).
  for z in .gpu/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
  C="$C350 --eval-interval 100 --eval-iters 20"
  F="--fp8-format hybrid --fp8-recipe tensorwise"
  timeout ${LIMIT:-500} $B/bm-launch --nproc-per-node 1 -- $B/pretrain_gpt $C > $OUT/curve3_bf16.log 2>&1 &
  timeout ${LIMIT:-500} $B/bm-launch --nproc-per-node 1 --master-port 29511 -- $B/pretrain_gpt $C $F > $OUT/curve3_fp8.log 2>&1 &
  timeout ${LIMIT:-500} $B/bm-launch --nproc-per-node 1 --master-port 29512 -- $B/pretrain_gpt $C $F --first-last-layers-bf16 > $OUT/curve3_fp8fl.log 2>&1 &
  wait
  for n in bf16 fp8 fp8fl; do
    echo "=== curve3 $n"; grep -E "iteration +[0-9]+/|validation|rror|panick" $OUT/curve3_$n.log | cut -c1-200
  done
fi
if part repeat; then
  # 1 GPU: curve3's model run twice in bf16 and twice in FP8, all at once, for ITERS steps: how
  # far two runs of one build drift apart (run-to-run variation against the FP8 gap).
  for z in .gpu/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
  C="$C350 --eval-interval 0"
  F="--fp8-format hybrid --fp8-recipe tensorwise"
  port=29520
  for n in bf16a bf16b fp8a fp8b; do
    f=""; [[ $n == fp8* ]] && f="$F"
    timeout ${LIMIT:-500} $B/bm-launch --nproc-per-node 1 --master-port $port -- $B/pretrain_gpt $C $f > $OUT/repeat_$n.log 2>&1 &
    port=$((port + 1))
  done
  wait
  for n in bf16a bf16b fp8a fp8b; do
    echo "=== repeat $n"; grep -E "iteration +[0-9]+/|rror|panick" $OUT/repeat_$n.log | cut -c1-110
  done
fi
if part recipes; then
  # 1 GPU: curve3's model in bf16 and in three FP8 settings, all at once, for ITERS steps:
  # E4M3 gradients, delayed scaling, E4M3 with the first and last layers in bf16.
  for z in .gpu/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
  C="$C350 --eval-interval 0"
  port=29530
  for n in bf16 e4m3 delayed e4m3fl; do
    case $n in
      bf16) f="" ;;
      e4m3) f="--fp8-format e4m3" ;;
      delayed) f="--fp8-format hybrid --fp8-recipe delayed" ;;
      e4m3fl) f="--fp8-format e4m3 --first-last-layers-bf16" ;;
    esac
    timeout ${LIMIT:-500} $B/bm-launch --nproc-per-node 1 --master-port $port -- $B/pretrain_gpt $C $f > $OUT/recipes_$n.log 2>&1 &
    port=$((port + 1))
  done
  wait
  for n in bf16 e4m3 delayed e4m3fl; do
    echo "=== recipes $n"; grep -E "iteration +[0-9]+/|rror|panick" $OUT/recipes_$n.log | cut -c1-110
  done
fi
if part peer; then
  # 2 GPUs: curve2's 350M runs next to PyTorch's on the same corpus (bench/torch_curve.py):
  # GPU 0 ours bf16 and PyTorch bf16, GPU 1 ours FP8 hybrid tensorwise and PyTorch float8 (the
  # torchao recipe), all four at once; the lm loss (the mean of the last 25 iterations) and
  # the validation loss every 100. Is FP8's distance from bf16 ours, or FP8's at this size?
  for z in .gpu/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
  C="$C350 --eval-interval 100 --eval-iters 20"
  D=.gpu/data/realtext_text_document
  CUDA_VISIBLE_DEVICES=0 timeout ${LIMIT:-500} $B/bm-launch --nproc-per-node 1 -- $B/pretrain_gpt $C > $OUT/peer_bf16.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout ${LIMIT:-500} $B/bm-launch --nproc-per-node 1 --master-port 29511 -- $B/pretrain_gpt $C --fp8-format hybrid --fp8-recipe tensorwise > $OUT/peer_fp8.log 2>&1 &
  CUDA_VISIBLE_DEVICES=0 timeout ${LIMIT:-500} python3 bench/torch_curve.py --data-prefix $D --train-iters ${ITERS:-1000} > $OUT/peer_torch_bf16.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout ${LIMIT:-500} python3 bench/torch_curve.py --data-prefix $D --train-iters ${ITERS:-1000} --fp8 > $OUT/peer_torch_fp8.log 2>&1 &
  wait
  for n in bf16 fp8 torch_bf16 torch_fp8; do
    echo "=== peer $n"; grep -E "torch_curve:|iteration +[0-9]+/|validation|rror|panick" $OUT/peer_$n.log | sed -E 's/ \| (consumed samples|TFLOP|MFU)[^|]*//g' | cut -c1-150 | tail -45
  done
fi
if part peer2; then
  # 2 GPUs: PART=peer twice over, for the spread of each gap: GPU 0 ours bf16 twice and FP8
  # twice, GPU 1 PyTorch bf16 twice and float8 twice, all eight at once (ITERS, default 1000).
  for z in .gpu/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
  C="$C350 --eval-interval 100 --eval-iters 20"
  D=.gpu/data/realtext_text_document
  port=29540
  for n in bf16a bf16b fp8a fp8b; do
    f=""; [[ $n == fp8* ]] && f="--fp8-format hybrid --fp8-recipe tensorwise"
    CUDA_VISIBLE_DEVICES=0 timeout ${LIMIT:-540} $B/bm-launch --nproc-per-node 1 --master-port $port -- $B/pretrain_gpt $C $f > $OUT/peer2_$n.log 2>&1 &
    port=$((port + 1))
    f=""; [[ $n == fp8* ]] && f="--fp8"
    CUDA_VISIBLE_DEVICES=1 timeout ${LIMIT:-540} python3 bench/torch_curve.py --data-prefix $D --train-iters ${ITERS:-1000} $f > $OUT/peer2_torch_$n.log 2>&1 &
  done
  wait
  for n in bf16a bf16b fp8a fp8b torch_bf16a torch_bf16b torch_fp8a torch_fp8b; do
    echo "=== peer2 $n"; grep -E "iteration +[0-9]+00/|validation|rror|panick" $OUT/peer2_$n.log | sed -E 's/ \| (consumed samples|TFLOP|MFU|memory|grad norm)[^|]*//g' | cut -c1-110 | tail -22
  done
fi
if part curvebook; then
  # 2 GPUs: the 350M curve on a corpus it does not repeat (bench/make_booktext.py: 32 M byte
  # tokens of the Rust toolchain's books and API docs, manual pages and crates' Markdown; 1 000
  # steps read 16.4 M), with validation every 100 steps: GPU 0 ours bf16 and FP8 (hybrid,
  # tensorwise) and PyTorch bf16, GPU 1 ours bf16 and FP8 again and PyTorch float8, all six
  # at once (ITERS, default 1000).
  for z in .gpu/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
  D=.gpu/data/booktext_text_document
  C="${C350/realtext_text_document/booktext_text_document} --eval-interval 100 --eval-iters 20"
  port=29560
  for gpu in 0 1; do
    for n in bf16 fp8; do
      f=""; [ $n = fp8 ] && f="--fp8-format hybrid --fp8-recipe tensorwise"
      CUDA_VISIBLE_DEVICES=$gpu timeout ${LIMIT:-540} $B/bm-launch --nproc-per-node 1 --master-port $port -- $B/pretrain_gpt $C $f > $OUT/book_${n}_$gpu.log 2>&1 &
      port=$((port + 1))
    done
  done
  CUDA_VISIBLE_DEVICES=0 timeout ${LIMIT:-540} python3 bench/torch_curve.py --data-prefix $D --train-iters ${ITERS:-1000} > $OUT/book_torch_bf16.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout ${LIMIT:-540} python3 bench/torch_curve.py --data-prefix $D --train-iters ${ITERS:-1000} --fp8 > $OUT/book_torch_fp8.log 2>&1 &
  wait
  for n in bf16_0 fp8_0 bf16_1 fp8_1 torch_bf16 torch_fp8; do
    echo "=== book $n"; grep -E "torch_curve:|iteration +[0-9]+00/|validation|rror|panick" $OUT/book_$n.log | sed -E 's/ \| (consumed samples|TFLOP|MFU|memory|grad norm|learning rate|lr)[^|]*//g' | cut -c1-110 | tail -22
  done
fi
if part bwd; then
  # 2 GPUs: which backward GEMM is the 1000-step FP8 run's late gap from? curve2's model,
  # GPU 0 bf16, FP8 (hybrid, tensorwise) and FP8 with both backward GEMMs in bf16
  # (--fp8-backward-bf16 both: FP8 in the forward pass only); GPU 1 FP8 with only the weight
  # gradient's, then only the input gradient's GEMM in bf16, and PyTorch's bf16 and float8
  # (bench/torch_curve.py), all six at once.
  for z in .gpu/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
  C="$C350 --eval-interval 100 --eval-iters 20"
  D=.gpu/data/realtext_text_document
  F="--fp8-format hybrid --fp8-recipe tensorwise"
  port=29560
  for run in "0 bf16" "0 fp8 $F" "0 both $F --fp8-backward-bf16 both" "1 wgrad $F --fp8-backward-bf16 wgrad" "1 dgrad $F --fp8-backward-bf16 dgrad"; do
    set -- $run; gpu=$1; n=$2; shift 2
    CUDA_VISIBLE_DEVICES=$gpu timeout ${LIMIT:-540} $B/bm-launch --nproc-per-node 1 --master-port $port -- $B/pretrain_gpt $C "$@" > $OUT/bwd_$n.log 2>&1 &
    port=$((port + 1))
  done
  CUDA_VISIBLE_DEVICES=1 timeout ${LIMIT:-540} python3 bench/torch_curve.py --data-prefix $D --train-iters ${ITERS:-1000} > $OUT/bwd_torch_bf16.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout ${LIMIT:-540} python3 bench/torch_curve.py --data-prefix $D --train-iters ${ITERS:-1000} --fp8 > $OUT/bwd_torch_fp8.log 2>&1 &
  wait
  for n in bf16 fp8 both wgrad dgrad torch_bf16 torch_fp8; do
    echo "=== bwd $n"; grep -E "torch_curve:|iteration +[0-9]+00/|validation|rror|panick" $OUT/bwd_$n.log | sed -E 's/ \| (consumed samples|TFLOP|MFU|memory|grad norm|learning rate|lr)[^|]*//g' | cut -c1-110 | tail -22
  done
fi
if part dp2; then
  # 2 GPUs: curve2's model at DP 2 (a micro-batch of 8 on each rank a step) for 60 steps, one
  # run after another: bf16, FP8 tensorwise, FP8 delayed (whose amax histories are reduced
  # over DP once a step, GptModel::reduce_fp8_histories). Does the reduction run over NCCL,
  # and what does it cost?
  for z in .gpu/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
  C="${C350/--train-iters ${ITERS:-1000}/--train-iters 60}"
  C="${C/--lr-warmup-iters 100/--lr-warmup-iters 10}"
  C="${C/--log-interval 25/--log-interval 10} --eval-interval 0 --data-parallel-size 2"
  for n in bf16 tensorwise delayed; do
    f=""; [ $n != bf16 ] && f="--fp8-format hybrid --fp8-recipe $n"
    timeout ${LIMIT:-120} $B/bm-launch --nproc-per-node 2 -- $B/pretrain_gpt $C $f > $OUT/dp2_$n.log 2>&1
    echo "=== dp2 $n: rc=$?"; grep -E "iteration +[0-9]+/|rror|panick" $OUT/dp2_$n.log | sed -E 's/ \| (consumed samples|MFU|memory)[^|]*//g' | cut -c1-150
  done
fi
if part dp2prof; then
  # 2 GPUs: where delayed scaling's time goes at DP 2 (dp2's model, 30 steps a run): FP8
  # delayed with the reduction over DP, step 25 profiled on rank 0; the same without the
  # reduction (--tp-only-amax-red), and tensorwise. On the generated corpus (vocabulary
  # 257): the cost, not the losses.
  C="${C350/--train-iters ${ITERS:-1000}/--train-iters 30}"
  C="${C/--data-path .gpu\/data\/realtext_text_document/}"
  C="${C/--lr-warmup-iters 100/--lr-warmup-iters 10}"
  C="${C/--log-interval 25/--log-interval 5} --eval-interval 0 --data-parallel-size 2"
  for n in delayed_profile delayed_tp_only delayed tensorwise; do
    f="--fp8-format hybrid --fp8-recipe ${n%%_*}"
    case $n in
      *profile) f="$f --profile --profile-step-start 25 --profile-step-end 26 --profile-ranks 0" ;;
      *tp_only) f="$f --tp-only-amax-red" ;;
    esac
    p=0; case $n in *profile) p=1 ;; esac
    BM_PROFILE=$p timeout ${LIMIT:-100} $B/bm-launch --nproc-per-node 2 -- $B/pretrain_gpt $C $f > $OUT/dp2prof_$n.log 2>&1
    echo "=== dp2prof $n: rc=$?"; grep -E "iteration +[0-9]+/|rror|panick" $OUT/dp2prof_$n.log | sed -E 's/ \| (consumed samples|MFU|memory|learning rate|grad norm)[^|]*//g' | cut -c1-130 | tail -4
    [ $p = 1 ] && grep -E "rank 0 \|" $OUT/dp2prof_$n.log | head -45 | cut -c1-170
  done
fi
if part diag; then
  # 2 GPUs: is the FP8 run's distance from bf16 a kernel's? curve2's model for ITERS (default
  # 700) steps: GPU 0 bf16 and FP8 with the casts and GEMMs as the Burn compositions (the
  # CPU's emulation, BM_FP8_COMPOSITIONS=casts); GPU 1 FP8 on the kernels and FP8 with the
  # amaxes and scales composed (BM_FP8_COMPOSITIONS=scales), all at once.
  for z in .gpu/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
  C="${C350/--train-iters ${ITERS:-1000}/--train-iters ${ITERS:-700}} --eval-interval 100 --eval-iters 20"
  F="--fp8-format hybrid --fp8-recipe tensorwise"
  CUDA_VISIBLE_DEVICES=0 timeout ${LIMIT:-500} $B/bm-launch --nproc-per-node 1 -- $B/pretrain_gpt $C > $OUT/diag_bf16.log 2>&1 &
  CUDA_VISIBLE_DEVICES=0 BM_FP8_COMPOSITIONS=casts timeout ${LIMIT:-500} $B/bm-launch --nproc-per-node 1 --master-port 29511 -- $B/pretrain_gpt $C $F > $OUT/diag_casts.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout ${LIMIT:-500} $B/bm-launch --nproc-per-node 1 --master-port 29512 -- $B/pretrain_gpt $C $F > $OUT/diag_fp8.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 BM_FP8_COMPOSITIONS=scales timeout ${LIMIT:-500} $B/bm-launch --nproc-per-node 1 --master-port 29513 -- $B/pretrain_gpt $C $F > $OUT/diag_scales.log 2>&1 &
  wait
  for n in bf16 fp8 scales casts; do
    echo "=== diag $n"; grep -E "iteration +[0-9]+/|validation|rror|panick" $OUT/diag_$n.log | sed -E 's/ \| (consumed samples|TFLOP|MFU|memory)[^|]*//g' | cut -c1-130 | tail -40
  done
fi
if part profile8b; then
  # 2 GPUs: Llama-3 8B at PP 2 (17 + 15 layers), micro-batch 1, global batch 16, one step
  # profiled on rank 0 (17 layers, the embedding), bf16 and FP8 tensorwise.
  P="--config examples/configs/llama3_8b.toml --bf16 --no-save --eval-interval 0 --log-interval 1 --collective-checks false --lr-warmup-iters 2 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16 --decoder-last-pipeline-num-layers 15 --train-iters 3 --profile --profile-step-start 2 --profile-step-end 3 --profile-ranks 0"
  for f in "" "--fp8-format hybrid --fp8-recipe tensorwise"; do
    n=prof8b$(echo "$f" | tr -d ' -' | cut -c1-30)
    BM_PROFILE=1 timeout 120 $B/bm-launch --nproc-per-node 2 -- $B/pretrain_gpt $P $f > $OUT/$n.log 2>&1
    echo "=== $n rc=$?"; grep -E "iteration +[0-9]+/|rank 0 \||rror|panick" $OUT/$n.log | cut -c1-170 | head -40
  done
fi
if part step1; then
  # One GPU: the casts' checks against the host and their speeds (gemm_bench fp8-casts), then
  # Llama-3 8B's layer shapes at 14 layers (4.1B parameters: 16 would pass the 32-bit optimizer
  # shard), micro-batch 1, global batch 16, in bf16, FP8 tensorwise and FP8 delayed.
  [ -n "${SKIP_CASTS:-}" ] || {
    timeout 90 $B/gemm_bench fp8-casts > $OUT/casts.log 2>&1
    echo "=== casts: rc=$? checks differing: $(grep -E " differ" $OUT/casts.log | grep -cvE ": 0 of") of $(grep -c " differ" $OUT/casts.log)"
    grep -E "MISMATCH|NaN|us," $OUT/casts.log | cut -c1-160
  }
  P="--config examples/configs/llama3_8b.toml --num-layers 14 --bf16 --no-save --eval-interval 0 --log-interval 1 --collective-checks false --lr-warmup-iters 2 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --micro-batch-size 1 --global-batch-size 16 --train-iters ${STEP1_ITERS:-5}"
  for f in "" "--fp8-format hybrid --fp8-recipe tensorwise" "--fp8-format hybrid --fp8-recipe delayed"; do
    n=step1$(echo "$f" | tr -d ' -' | cut -c1-40)
    timeout 150 $B/bm-launch --nproc-per-node 1 -- $B/pretrain_gpt $P $f > $OUT/$n.log 2>&1
    echo "=== $n rc=$?"; grep -E "iteration +[0-9]+/|rror|panick" $OUT/$n.log | cut -c1-150
  done
fi
if part block1; then
  # One GPU: PART=step1's model (14 of Llama-3 8B's layers, micro-batch 1, global batch 16) in
  # bf16, FP8 tensorwise and FP8 blockwise (1 x 128 / 128 x 128 block scales; cuBLASLt's
  # VEC128_32F / BLK128x128_32F GEMMs), STEP1_ITERS (default 5) iterations each.
  P="--config examples/configs/llama3_8b.toml --num-layers 14 --bf16 --no-save --eval-interval 0 --log-interval 1 --collective-checks false --lr-warmup-iters 2 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --micro-batch-size 1 --global-batch-size 16 --train-iters ${STEP1_ITERS:-5}"
  for f in "" "--fp8-format hybrid --fp8-recipe tensorwise" "--fp8-format hybrid --fp8-recipe blockwise"; do
    n=block1$(echo "$f" | tr -d ' -' | cut -c1-40)
    timeout 150 $B/bm-launch --nproc-per-node 1 -- $B/pretrain_gpt $P $f > $OUT/$n.log 2>&1
    echo "=== $n rc=$?"; grep -E "iteration +[0-9]+/|rror|panick" $OUT/$n.log | cut -c1-150
  done
fi
if part blockbook; then
  # 2 GPUs: PART=curvebook's 350M curve on the non-repeating book corpus with blockwise
  # scaling: GPU 0 ours bf16, FP8 blockwise and FP8 tensorwise, GPU 1 bf16 and blockwise again,
  # all five at once (ITERS, default 1000; RUNS picks some of them, as NAME_GPU; PORT the first
  # rendezvous port, for two such parts at once).
  for z in .gpu/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
  C="${C350/realtext_text_document/booktext_text_document} --eval-interval 100 --eval-iters 20"
  port=${PORT:-29570}
  RUNS=${RUNS:-bf16_0 blockwise_0 tensorwise_0 bf16_1 blockwise_1}
  for run in $RUNS; do
    n=${run%_*}; gpu=${run#*_}
    f=""; [ $n != bf16 ] && f="--fp8-format hybrid --fp8-recipe $n"
    CUDA_VISIBLE_DEVICES=$gpu timeout ${LIMIT:-540} $B/bm-launch --nproc-per-node 1 --master-port $port -- $B/pretrain_gpt $C $f > $OUT/bbook_$run.log 2>&1 &
    port=$((port + 1))
  done
  wait
  for run in $RUNS; do
    echo "=== bbook $run"; grep -E "iteration +[0-9]+00/|validation|rror|panick" $OUT/bbook_$run.log | sed -E 's/ \| (consumed samples|TFLOP|MFU|memory|grad norm|learning rate|lr)[^|]*//g' | cut -c1-110 | tail -22
  done
fi
if part hook1; then
  # One GPU: PART=step1's model with the distributed optimizer and the overlap hook
  # (--use-distributed-optimizer --overlap-grad-reduce: the weight gradients of every layer,
  # FP8 ones included, accumulate over the 16 micro-batches in the hook's f32 buffer), bf16
  # and FP8 tensorwise; then FP8 tensorwise without them, as step1 runs it.
  P="--config examples/configs/llama3_8b.toml --num-layers 14 --bf16 --no-save --eval-interval 0 --log-interval 1 --collective-checks false --lr-warmup-iters 2 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --micro-batch-size 1 --global-batch-size 16 --train-iters ${STEP1_ITERS:-5}"
  for f in "--use-distributed-optimizer --overlap-grad-reduce" "--use-distributed-optimizer --overlap-grad-reduce --fp8-format hybrid --fp8-recipe tensorwise" "--fp8-format hybrid --fp8-recipe tensorwise"; do
    n=hook1$(echo "$f" | sed 's/--use-distributed-optimizer --overlap-grad-reduce/hook/' | tr -d ' -' | cut -c1-40)
    timeout 150 $B/bm-launch --nproc-per-node 1 -- $B/pretrain_gpt $P $f > $OUT/$n.log 2>&1
    echo "=== $n rc=$?"; grep -E "iteration +[0-9]+/|rror|panick" $OUT/$n.log | cut -c1-150
  done
fi
if part peer1; then
  # One GPU, BENCHMARK PEER: PART=step1's model (14 of Llama-3 8B's layers) in PyTorch (FSDP2 on
  # one rank, per-block torch.compile), bf16 and torchao's float8, 1 sample of 4096 a step.
  for f in "" "--fp8"; do
    n=peer1$(echo "$f" | tr -d ' -')
    timeout 240 torchrun --nproc-per-node 1 --master-port 29533 bench/torch_fsdp.py --preset llama3-8b --layers 14 --batch 1 --steps 8 $f > $OUT/$n.log 2>&1
    echo "=== $n rc=$?"; grep -E "RESULT|rror" $OUT/$n.log | tail -3 | cut -c1-300
  done
fi
if part peer8b; then
  # 2 GPUs, BENCHMARK PEER: Llama-3 8B in PyTorch (FSDP2 + per-block torch.compile), bf16 and
  # torchao's float8, 1 sample a GPU a step: the peers of PART=step8b.
  for f in "" "--fp8"; do
    n=peer8b$(echo "$f" | tr -d ' -')
    timeout 240 torchrun --nproc-per-node 2 --master-port 29534 bench/torch_fsdp.py --preset llama3-8b --batch 1 --steps 8 $f > $OUT/$n.log 2>&1
    echo "=== $n rc=$?"; grep -E "RESULT|rror" $OUT/$n.log | tail -3 | cut -c1-300
  done
fi
if part prof1; then
  # One GPU: PART=step1's model (14 of Llama-3 8B's layers), global batch 8, one step
  # profiled, bf16 and FP8 tensorwise and delayed (PROF1_RECIPES: some of bf16 tensorwise delayed
  # blockwise).
  P="--config examples/configs/llama3_8b.toml --num-layers 14 --bf16 --no-save --eval-interval 0 --log-interval 1 --collective-checks false --lr-warmup-iters 2 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --micro-batch-size 1 --global-batch-size 8 --train-iters 3 --profile --profile-step-start 2 --profile-step-end 3 --profile-ranks 0"
  for r in ${PROF1_RECIPES:-bf16 tensorwise delayed}; do
    f=""; [ $r != bf16 ] && f="--fp8-format hybrid --fp8-recipe $r"
    n=prof1$(echo "$f" | tr -d ' -' | cut -c1-30)
    BM_PROFILE=1 timeout 120 $B/bm-launch --nproc-per-node 1 -- $B/pretrain_gpt $P $f > $OUT/$n.log 2>&1
    echo "=== $n rc=$?"; grep -E "iteration +[0-9]+/|rank 0 \||rror|panick" $OUT/$n.log | cut -c1-170 | head -45
  done
fi
if part step8b; then
  # 2 GPUs: Llama-3 8B at PP 2 (17 + 15 layers), micro-batch 1, global batch 32, 5 iterations:
  # bf16, FP8 tensorwise and FP8 delayed (the median of iterations 2-5 is the figure).
  P="--config examples/configs/llama3_8b.toml --bf16 --no-save --eval-interval 0 --log-interval 1 --collective-checks false --lr-warmup-iters 2 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 32 --decoder-last-pipeline-num-layers 15 --train-iters 5"
  for f in "" "--fp8-format hybrid --fp8-recipe tensorwise" "--fp8-format hybrid --fp8-recipe delayed"; do
    n=step8b$(echo "$f" | tr -d ' -' | cut -c1-40)
    timeout 120 $B/bm-launch --nproc-per-node 2 -- $B/pretrain_gpt $P $f > $OUT/$n.log 2>&1
    echo "=== $n rc=$?"; grep -E "iteration +[0-9]+/|rror|panick" $OUT/$n.log | cut -c1-150
  done
fi
