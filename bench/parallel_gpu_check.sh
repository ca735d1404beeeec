#!/usr/bin/env bash
# Data and tensor parallelism on two GPUs (issue 14), with the kernels the TP path uses, in
# one device call (kind nvidia-h100-x2 or nvidia-h200-x2); logs go to $OUT. Needs, packed
# under .gpu/ (bench/pack_gpu.sh), gzipped is fine:
#   bin/{gpt_train_bench,kernel_bench,bm-launch}  bench/pack_gpu.sh build --release --features cuda
#       -p burn-megatron-examples --example gpt_train_bench --example kernel_bench, and
#       -p burn-megatron-dist --bin bm-launch
#   bin/nccl                                       bench/pack_gpu.sh test --release --features cuda
#       -p burn-megatron-tests --test nccl
#   bin/gpu                                        ... --test gpu (the one-GPU kernel tests)
#   PART=tests|kernels|norms|gputests|dp|tp|profiles|dp4 bash bench/parallel_gpu_check.sh   (default: all
#   but dp4, which needs four GPUs)
set -u
cd "$(dirname "$0")/.."
source .gpu/env.sh
# Unpack once (two parts may run at once, one a GPU: unpack before starting them).
for z in .gpu/bin/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done 2>/dev/null
chmod +x .gpu/bin/* 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpus.txt
nvidia-smi topo -m | tee -a $OUT/gpus.txt
B=.gpu/bin
part() { { [ "${PART:-all}" = all ] && [ "$1" != dp4 ]; } || [ "${PART:-all}" = "$1" ]; }
ours() { # name, ranks, flags...  (E="VAR=value ..." adds to the environment)
  local name=$1 n=$2; shift 2
  echo "=== ours $name ${E:-}" | tee -a $OUT/bench.log
  if [ "$n" = 1 ]; then
    env ${E:-} timeout 200 $B/gpt_train_bench "$@" > $OUT/$name.log 2>&1
  else
    env ${E:-} timeout 200 $B/bm-launch --nproc-per-node $n -- $B/gpt_train_bench "$@" > $OUT/$name.log 2>&1
  fi
  echo "rc=$?" | tee -a $OUT/bench.log
  grep -E "RESULT|step|tokens/s|Error|panicked" $OUT/$name.log | tail -4 | tee -a $OUT/bench.log
}
torch() { # name, ranks, flags...
  local name=$1 n=$2; shift 2
  echo "=== torch $name" | tee -a $OUT/bench.log
  if [ "$n" = 1 ]; then
    timeout 300 python3 bench/torch_train.py "$@" > $OUT/torch_$name.log 2>&1
  else
    timeout 300 torchrun --nproc-per-node $n bench/torch_train.py "$@" > $OUT/torch_$name.log 2>&1
  fi
  echo "rc=$?" | tee -a $OUT/bench.log
  tail -3 $OUT/torch_$name.log | tee -a $OUT/bench.log
}

if part tests; then
  # TP 2 + SP over NCCL equals one GPU (GPT and Llama), and the collective suite (all-gather
  # and reduce-scatter along every dimension, even and uneven).
  timeout 400 $B/nccl --test-threads=1 tensor_parallel_gpt_over_nccl suite_over_nccl 2>&1 |
    tee $OUT/nccl_tests.log | grep -E "^test |test result|relative difference|loss TP"
fi
if part kernels; then
  # RoPE in place against the copy path; the softmax with rows in registers against the
  # streamed kernels; torch.compile's peers in the same call.
  # And the norms' backward (LayerNorm's two row sums now behind one set of barriers).
  # And the element-wise kernels' layouts (bias-GeLU, SwiGLU), each checked against the flat
  # kernels' bits.
  timeout 400 $B/kernel_bench dropout_rope_and_padded_softmax causal_softmax norm_gelu_and_bias_gradient \
    elementwise_layouts bias_swiglu 2>&1 |
    tee $OUT/kernels.log | grep -iE "rope|softmax|copy|norm|gelu|swiglu"
  timeout 300 python3 bench/torch_kernels.py dropout_rope_and_padded_softmax causal_softmax norm_gelu_and_bias_gradient \
    bias_swiglu 2>&1 |
    tee $OUT/torch_kernels.log | grep -iE "rope|softmax|norm|gelu|swiglu"
fi
if part norms; then
  # The LayerNorm kernels' layouts (forward: elements a thread, threads a cube, parameters
  # loaded with the row; backward: where the scale and column sums are kept), each kernel's
  # registers (BM_KERNEL_INFO), and Nsight Compute's view of the bf16 kernels at 16k x 4096.
  BM_KERNEL_INFO=1 timeout 300 $B/kernel_bench norm_forward_layouts norm_backward_layouts 2>&1 |
    tee $OUT/norm_layouts.log | grep -E "BEST|copy|^layout|KERNEL"
  timeout 200 /usr/local/cuda/bin/ncu --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis -k regex:"forward|backward" -c 12 \
    $B/kernel_bench norm_profile > $OUT/ncu_norm.txt 2>&1
  grep -E "^  [a-z_]+.*\(|Registers Per|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|DRAM Throughput|Duration|Block Limit|Stall|Warp Cycles Per Issued" \
    $OUT/ncu_norm.txt | head -150
fi
if part gputests; then
  # The kernels against burn-cuda and the compositions on one GPU (needs bin/gpu:
  # bench/pack_gpu.sh test --release --features cuda -p burn-megatron-tests --test gpu).
  # (gpt_step_on_three_backends alone takes over 150 s.)
  timeout 300 $B/gpu --test-threads=1 fused_causal_softmax fused_dropout_rope transformer_autodiff_matches_burn_cuda \
    fused_norm fused_bias_gelu a_training_step_never 2>&1 | tee $OUT/gpu_tests.log | grep -E "^test |test result"
  timeout 280 $B/gpu --test-threads=1 gpt_step_on_three_backends 2>&1 |
    tee $OUT/gpu_tests_step.log | grep -E "^test |test result"
fi
if part dp; then
  M="--preset gpt2-350m --batch 8 --dtype bf16"
  ours 350m_1gpu 1 $M
  ours 350m_dp2_allreduce_overlap 2 $M --data-parallel 2 --overlap-grad-reduce
  # NCCL on fewer SMs leaves more of them to the backward pass it overlaps.
  E="NCCL_MAX_NCHANNELS=8" ours 350m_dp2_allreduce_overlap_8ch 2 $M --data-parallel 2 --overlap-grad-reduce
  ours 350m_dp2_allreduce_overlap_b10m 2 $M --data-parallel 2 --overlap-grad-reduce --bucket-numel 10000000
  ours 350m_dp2_zero_overlap 2 $M --data-parallel 2 --use-distributed-optimizer --overlap-grad-reduce
  torch 350m_1gpu 1 --preset gpt2-350m --batch 8 --mode compile
  torch 350m_ddp2 2 --preset gpt2-350m --batch 8 --mode compile
fi
if part tp; then
  M="--preset gpt2-350m --batch 8 --dtype bf16"
  ours 350m_1gpu_again 1 $M
  ours 350m_tp2_sp 2 $M --tensor-parallel 2 --sequence-parallel
  L="--preset llama-1b --batch 4 --dtype bf16 --steps 6 --warmup 2"
  ours llama1b_1gpu 1 $L
  ours llama1b_tp2_sp 2 $L --tensor-parallel 2 --sequence-parallel
  [ -n "${SKIP_TORCH:-}" ] || torch llama1b_1gpu 1 --preset llama-1b --batch 4 --mode compile --steps 6 --warmup 2
fi
if part profiles; then
  # Where each layout's step goes (BM_PROFILE=1: per-kernel GPU time, NCCL's side lane, the
  # compute stream's coverage): one GPU, TP 2 + SP, and DP 2 overlapped with and without ZeRO.
  M="--preset gpt2-350m --batch 8 --dtype bf16"
  E="BM_PROFILE=1" ours 350m_1gpu_profile 1 $M --top 12
  E="BM_PROFILE=1" ours 350m_tp2_sp_profile 2 $M --tensor-parallel 2 --sequence-parallel --top 16
  E="BM_PROFILE=1" ours 350m_dp2_allreduce_profile 2 $M --data-parallel 2 --overlap-grad-reduce --top 8
  E="BM_PROFILE=1" ours 350m_dp2_zero_profile 2 $M --data-parallel 2 --use-distributed-optimizer --overlap-grad-reduce --top 8
  for f in 350m_1gpu_profile 350m_tp2_sp_profile 350m_dp2_allreduce_profile 350m_dp2_zero_profile; do
    echo "=== $f"; grep -E "step:|host ms|total:|phase|nccl|share|Kernel|Foreign" $OUT/$f.log | head -24
  done | tee -a $OUT/bench.log
fi
if part dp4; then
  # DP 4 (kind nvidia-h100-x4 or nvidia-h200-x4), against one GPU in the same call.
  M="--preset gpt2-350m --batch 8 --dtype bf16"
  ours 350m_1gpu 1 $M
  ours 350m_dp4_allreduce_overlap 4 $M --data-parallel 4 --overlap-grad-reduce
  ours 350m_dp4_zero_overlap 4 $M --data-parallel 4 --use-distributed-optimizer --overlap-grad-reduce
  torch 350m_1gpu 1 --preset gpt2-350m --batch 8 --mode compile
  torch 350m_ddp4 4 --preset gpt2-350m --batch 8 --mode compile
fi
