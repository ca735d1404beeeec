#!/usr/bin/env bash
# Mixture of experts with expert parallelism (issue 34) on 4 GPUs in one device call (kind
# nvidia-h100-x4 or nvidia-h200-x4, <= 9 minutes): pretrain_gpt --num-experts in bf16 on
#   mixtral   examples/configs/mixtral_1b_moe.toml: 8 SwiGLU experts of 5632, top-2 softmax,
#             16 layers, hidden 2048, GQA 16/4, RMSNorm, rope; ~1.41 B active, 4.7 B in all
#   deepseek  examples/configs/deepseek_moe_1b.toml: 64 experts of 1408, top-6 sigmoid with
#             normalised weights and the expert bias, a shared expert of 2816; ~1.42 B active
# at EP 4 (mixtral, deepseek) and EP 2 x expert-DP 2 (mixtral), DP 4 for the dense parameters,
# the distributed optimizer, sequences of 2048, micro-batch 1, global batch 8 (8 / NPROC
# micro-batches a rank, the peer's --grad-accum too); and the PyTorch peer (bench/torch_moe.py: torch._grouped_mm,
# all_to_all_single over the EP group, DDP, torch.compile on attention) at the same settings.
# Logs go to $OUT. Needs, packed under .gpu/ (bench/pack_gpu.sh): bin/{pretrain_gpt,bm-launch}
# (bench/pack_gpu.sh build --release --features cuda -p burn-megatron-examples --example
# pretrain_gpt, and -p burn-megatron-dist --bin bm-launch), and torch with torchrun.
#
#   bash bench/moe_gpu_check.sh                 # all runs, in this order, within BUDGET
#   PART=ours bash bench/moe_gpu_check.sh       # ours only (PART=gemm,ours,torch is all)
#   PART=gemm bash bench/moe_gpu_check.sh       # the experts' grouped GEMM only (one GPU is enough)
#   NPROC=2 PART=gemm,two bash bench/moe_gpu_check.sh  # 2 GPUs: both presets at EP 2, the peers, a profile
#   NPROC=2 PART=late bash bench/moe_gpu_check.sh  # 2 GPUs: Mixtral-like EP 2 for 20 iterations, a late step profiled, the peer
#   PART=late4 bash bench/moe_gpu_check.sh          # 4 GPUs: the same at EP 4
#   NPROC=4 PART=steady4a bash bench/moe_gpu_check.sh  # 4 GPUs: both presets at EP 4 with the hook, 20 iterations, each next to its peer
#   NPROC=4 PART=steady4b bash bench/moe_gpu_check.sh  # 4 GPUs: the same at EP 2 x expert-DP 2
#   NPROC=2 PART=deeplate2 bash bench/moe_gpu_check.sh  # 2 GPUs: DeepSeek-like EP 2 for 20 iterations, a late step profiled, the peer
#   NPROC=2 PART=steady2 bash bench/moe_gpu_check.sh  # 2 GPUs: both presets at EP 2 for 20 iterations, each peer
#   NPROC=2 PART=global2 bash bench/moe_gpu_check.sh  # 2 GPUs: Mixtral-like at EP 2 with aux_loss, then global_aux_loss, then the peer
#   NPROC=2 PART=jitter2 bash bench/moe_gpu_check.sh  # 2 GPUs: Mixtral-like at EP 2 with aux_loss, then a list of losses and input jitter, then the peer
#   NPROC=2 PART=jitterprof2 bash bench/moe_gpu_check.sh  # 2 GPUs: jitter2's runs, one step of each profiled
#   NPROC=2 PART=gemm,grouped2 bash bench/moe_gpu_check.sh  # 2 GPUs: the experts' products as one grouped GEMM against one GEMM an expert
#   NPROC=1 PART=gemm,engines1 bash bench/moe_gpu_check.sh  # 1 GPU: the experts' products by each engine, 8 layers of both presets, the peer
#   NPROC=1 PART=gemm,rule1 bash bench/moe_gpu_check.sh  # 1 GPU: the engines' rule, 8 layers of both presets, a profile, the peer
#   NPROC=1 PART=hook1 bash bench/moe_gpu_check.sh  # 1 GPU: the experts' gradients through the overlap hook against the container, both presets, a profile, the peer
#   NPROC=1 PART=hook1b bash bench/moe_gpu_check.sh  # 1 GPU: both presets with the overlap hook, each next to its peer
#   NPROC=2 OLD=.gpu/old/pretrain_gpt PART=adamw2 bash bench/moe_gpu_check.sh  # 2 GPUs: DeepSeek-like, the build before and this one, profiled
#   NPROC=2 PART=nan2 bash bench/moe_gpu_check.sh     # 2 GPUs: Mixtral-like at EP 1 (for EP 2's losses), DeepSeek-like with 8 layers
#   NPROC=2 PART=nan2b|nan2c|nan2d bash bench/moe_gpu_check.sh  # 2 GPUs: the NaN's other checks (each part says what it runs)
#   NPROC=2 PART=parts2 bash bench/moe_gpu_check.sh   # 2 GPUs: the presets past 2^32 expert elements a rank (experts in parts)
#   NPROC=2 PART=gather2 bash bench/moe_gpu_check.sh  # 2 GPUs: Mixtral-like at EP 2 with each token dispatcher
#   NPROC=2 OLD=.gpu/old/pretrain_gpt PART=gatherpad2 bash bench/moe_gpu_check.sh  # 2 GPUs: DeepSeek-like at EP 2, even load, each dispatcher padding in its own gathers, and the all-gather one of the build before
#   NPROC=2 PART=gathersteady2 bash bench/moe_gpu_check.sh  # 2 GPUs: hook2's runs with the all-gather dispatcher, each next to its peer
#   NPROC=4 PART=gathersteady4 bash bench/moe_gpu_check.sh  # 4 GPUs: steady4a's runs with the all-gather dispatcher, then the peers
#   NPROC=2 PART=hook2 bash bench/moe_gpu_check.sh    # 2 GPUs: both presets at EP 2 with the overlap hook, each next to its peer
#   NPROC=2 PART=etp2 bash bench/moe_gpu_check.sh     # 2 GPUs: TP 2 with the experts split (ETP 2) and whole (ETP 1); the router in fp32 and fp64
#   NPROC=1 PART=router1 bash bench/moe_gpu_check.sh  # 1 GPU: the router in the model's dtype, fp32 and fp64
#   NPROC=1 PART=sinkhorn1 bash bench/moe_gpu_check.sh  # 1 GPU: Sinkhorn balancing against the auxiliary loss
#   FORCE_BALANCE=1 ... # any part with an even expert load on both sides: ours with
#                       # --moe-router-force-load-balancing, the peer with --force-balance
#   NPROC=1 PART=balanced1 bash bench/moe_gpu_check.sh  # 1 GPU: both presets (8 layers, EP 1, the hook) with and without an even load, each next to its peer
#   NPROC=1 PART=padprof1 bash bench/moe_gpu_check.sh  # 1 GPU: the padded DeepSeek-like step at an even load, profiled
#   NPROC=1 OLD=.gpu/old/pretrain_gpt PART=fold1 bash bench/moe_gpu_check.sh  # 1 GPU: DeepSeek-like, the padding in the dispatcher against the build before, even load, next to the peer (foldr1: as routed)
#   NPROC=2 OLD=.gpu/old/pretrain_gpt PART=fold2 bash bench/moe_gpu_check.sh  # 2 GPUs: DeepSeek-like at EP 2, the build before and this one, next to the peer
#   NPROC=1 OLD=.gpu/old/pretrain_gpt PART=direct1 bash bench/moe_gpu_check.sh  # 1 GPU: Mixtral-like at EP 1 (no exchange, no receive gather) against the build before, next to the peer
#   NPROC=1 PART=padded1 bash bench/moe_gpu_check.sh  # 1 GPU: DeepSeek-like, the experts' blocks padded (default) and not (BM_EXPERT_PADDING=off), even load and as routed, next to the peer
#   (Since 2026-11-28 the 16-layer presets at EP 2, and the Mixtral-like one at EP 1, stop at start-up: their
#   experts' flat buffer is past 32-bit indices, the cause of the NaN and the panic these parts chased.)
#
# PART gemm runs first: `gemm_bench grouped` (bin/gemm_bench: bench/pack_gpu.sh build --release
# --features cuda -p burn-megatron-examples --example gemm_bench) checks the cuBLAS grouped GEMM
# against per-expert cuBLASLt GEMMs (forward, dX, dW, experts with zero rows, and through
# grouped_linear's autodiff node; a GEMM line with MISMATCH and rc 1 on a mismatch) and prints
# its TFLOP/s on Mixtral-like shapes next to the per-expert GEMMs and a dense GEMM of the same
# FLOPs; then its peer `bench/torch_gemm.py --grouped` (torch._grouped_mm). Logs
# $OUT/gemm_grouped.log and $OUT/torch_gemm_grouped.log; limit LIMIT_GEMM=120 s each.
#
# Runs: ours mixtral_ep4, torch mixtral_ep4, ours deepseek_ep4, torch deepseek_ep4, ours
# mixtral_ep2, torch mixtral_ep2; each started only while MIN_START of the BUDGET seconds is
# left, and cut at its limit or at what is left.
# Each run prints its iteration lines and one RUN line (median tokens/s, TFLOP/s per GPU and
# MFU over the iterations after the first, the log's memory of the largest rank, nvidia-smi's
# peak memory of any GPU, rc, status); every RUN line also goes to $OUT/summary.tsv, printed
# again at the end. MFU, ours and torch's alike, counts active FLOPs as Megatron does for MoE
# (burn-megatron/src/transformer/flops.rs): per token 6 x (attention's QKV, output and
# QK^T/PV GEMMs + the router's h x E + top-k experts' 3 h f_e + the shared expert's 3 h f_s)
# a layer, plus the output layer; routing, permutation and the all-to-all are not counted,
# nor recomputation. The denominator is the H100/H200 dense bf16 peak (989 TFLOP/s).
#
# Settings: ITERS=5 (ours; iteration 1 compiles and tunes the kernels and is left out of the
# medians), TORCH_STEPS=3 after 2 warm-up steps, BUDGET=520 s, LIMIT_OURS=150 and
# LIMIT_TORCH=150 s a run, MIN_START=40 s, TORCH_FALLBACK=1 (a torch run that fails with
# torch.compile, for another reason than memory, is rerun with --no-compile, and later torch
# runs skip compile). CPU_CHECK=1 runs every pretrain_gpt command line of the script on CPU
# thread ranks with a tiny model (target/debug binaries, fp32, seq 128) to check that
# pretrain_gpt accepts them, and prints the torch command lines without running them (run
# `torchrun --nproc-per-node 2 bench/torch_moe.py --device cpu --tiny --ep 2` for the peer).
set -u
cd "$(dirname "$0")/.."
CPU_CHECK=${CPU_CHECK:-0}
NPROC=${NPROC:-4}
ITERS=${ITERS:-5}
TORCH_STEPS=${TORCH_STEPS:-3}
BUDGET=${BUDGET:-520}
MIN_START=${MIN_START:-40}
LIMIT_OURS=${LIMIT_OURS:-150}
LIMIT_TORCH=${LIMIT_TORCH:-150}
TORCH_FALLBACK=${TORCH_FALLBACK:-1}
PART=${PART:-all}
SEQ=2048
if [ "$CPU_CHECK" = 1 ]; then
  OUT=${OUT:-/tmp/moe_cpu_check}
  LAUNCH=target/debug/bm-launch
  PRETRAIN=target/debug/examples/pretrain_gpt
  PRECISION=()
  SEQ=128
  TINY=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2
        --ffn-hidden-size 128 --vocab-size 512)
  TINY_DEEPSEEK=(--moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 64)
else
  source .gpu/env.sh
  for z in .gpu/bin/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done 2>/dev/null
  chmod +x .gpu/bin/* 2>/dev/null
  LAUNCH=.gpu/bin/bm-launch
  PRETRAIN=.gpu/bin/pretrain_gpt
  PRECISION=(--bf16)
  TINY=()
  TINY_DEEPSEEK=()
fi
: "${OUT:?OUT must name the folder for the logs}"
mkdir -p "$OUT"
LOG=$OUT/moe.log
SUMMARY=$OUT/summary.tsv
T0=$(date +%s)
PORT=${PORT_BASE:-29710}
TORCH_NO_COMPILE=0
SMI_PID=
say() { echo "$*" | tee -a "$LOG"; }
part() { [ "$PART" = all ] && return 0; case ",${PART// /,}," in *",$1,"*) return 0 ;; esac; return 1; }
run_limit() { # the run's own limit, or what is left of the budget; fails when too little is
  local left=$(( BUDGET - ($(date +%s) - T0) )) lim=$1
  (( left < lim )) && lim=$left
  (( lim < MIN_START )) && return 1
  echo "$lim"
}
smi_start() { # name: sample every GPU's memory in use until smi_stop
  [ "$CPU_CHECK" = 1 ] && return
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/$1.smi" 2>/dev/null &
  SMI_PID=$!
}
smi_stop() {
  [ -n "$SMI_PID" ] && { kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null; }
  SMI_PID=
}
gpus_idle() { # wait (20 s at most) until no GPU holds more than 2 GiB: a run's ranks are gone
  [ "$CPU_CHECK" = 1 ] && return
  local used=0
  for _ in $(seq 1 20); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -1)
    [ "${used:-0}" -lt 2048 ] && return
    sleep 1
  done
  say "warning: a GPU still holds ${used} MiB 20 s after the run ended"
}
# One RUN line from a log: kind (ours|torch), name, rc, seconds, what.
summarise() {
  python3 - "$@" "$OUT" <<'EOF' | tee -a "$LOG"
import re, statistics, sys
kind, name, rc, secs, what, out = sys.argv[1:7]
rc = int(rc)
log = f"{out}/{name}.log" if kind == "ours" else f"{out}/torch_{name}.log"
try:
    text = open(log, errors="replace").read()
except OSError:
    text = ""
fields = {}
if kind == "ours":
    its = re.findall(r"iteration\s+(\d+)/\s*\d+.*?\|\s*([\d.]+) tokens/s \|\s*([\d.]+) TFLOP/s per device"
                     r" \| MFU ([\d.]+)%(?:.*?memory ([\d.]+) GiB)?", text)
    rows = [(int(i), float(t), float(f), float(m), float(g) if g else None) for i, t, f, m, g in its]
    timed = [r for r in rows if r[0] >= 2] or rows
    if timed:
        fields["iters"] = f"{len(rows)}"
        fields["tok_s"] = f"{statistics.median(r[1] for r in timed):.0f}"
        fields["tflops"] = f"{statistics.median(r[2] for r in timed):.1f}"
        fields["mfu"] = f"{statistics.median(r[3] for r in timed):.1f}%"
        mem = [r[4] for r in rows if r[4] is not None]
        if mem:
            fields["mem_gib"] = f"{max(mem):.1f}"
else:
    m = re.findall(r"^RESULT (.*)$", text, re.M)
    if m:
        kv = dict(p.split("=", 1) for p in m[-1].split())
        fields["tok_s"] = kv.get("tok_s", "?")
        fields["tflops"] = kv.get("tflops", "?")
        fields["mfu"] = f"{100 * float(kv['mfu']):.1f}%" if "mfu" in kv else "?"
        fields["mem_gib"] = f"{kv.get('mem_alloc_gib', '?')} alloc/{kv.get('mem_reserved_gib', '?')} resv"
        fields["impl"] = kv.get("impl", "?")
try:
    peaks = {}
    for line in open(f"{out}/{name if kind == 'ours' else 'torch_' + name}.smi"):
        gpu, used = [x.strip() for x in line.split(",")]
        peaks[gpu] = max(peaks.get(gpu, 0), int(used))
    if peaks:
        fields["smi_peak_gib"] = f"{max(peaks.values()) / 1024:.1f}"
except (OSError, ValueError):
    pass
oom = re.search(r"(?i)out of memory|OutOfMemory|OUT_OF_MEMORY|BufferTooBig", text)
if rc == 0 and ("tok_s" in fields):
    status = "ok"
elif oom:
    status = "OOM"
elif rc in (124, 137):
    status = "TIMEOUT"
else:
    status = "FAILED"
if status != "ok":
    # The root cause: ours, the first panic or error line; torch, its own message or the
    # first exception line of a traceback (not torchrun's ChildFailedError summary).
    patterns = ([r"^.*panicked.*$", r"^.*(?:Error|error|OUT OF MEMORY).*$"] if kind == "ours" else
                [r"^.*torch_moe: (?:ERROR|OUT OF MEMORY).*$",
                 r"^(?:\[rank\d+\]: )?[\w.]*(?:Error|Exception|Unsupported)\b(?!.*ChildFailedError).*$",
                 r"^.*(?:Error|error).*$"])
    for pattern in patterns:
        err = re.search(pattern, text, re.M)
        if err:
            fields["error"] = err.group(0).strip()[:300]
            break
line = f"RUN {kind} {name} | {status} rc={rc} {secs} s | " + " | ".join(f"{k} {v}" for k, v in fields.items())
print(line)
with open(f"{out}/summary.tsv", "a") as f:
    f.write("\t".join([kind, name, status, str(rc), secs, what] +
                      [f"{k}={v}" for k, v in fields.items()]) + "\n")
EOF
}


ours() { # name preset ep [pretrain_gpt flags...]
  local name=$1 preset=$2 ep=$3; shift 3
  local iters=$ITERS lim tiny=(${TINY[@]+"${TINY[@]}"}) tp=${TP:-1}
  if [ "$CPU_CHECK" = 1 ]; then
    # The tiny model's --num-layers stands: drop a part's own (clap refuses an option twice).
    local kept=() skip=0 a
    for a in "$@"; do
      if [ $skip = 1 ]; then skip=0; continue; fi
      if [ "$a" = --num-layers ]; then skip=1; continue; fi
      kept+=("$a")
    done
    set -- ${kept[@]+"${kept[@]}"}
  fi
  [ "$preset" = deepseek_moe_1b ] && tiny+=(${TINY_DEEPSEEK[@]+"${TINY_DEEPSEEK[@]}"})
  if ! lim=$(run_limit "$LIMIT_OURS"); then say "=== skip ours $name: less than ${MIN_START} s of the ${BUDGET} s budget left"; return; fi
  local args=(--config examples/configs/$preset.toml ${tiny[@]+"${tiny[@]}"} ${PRECISION[@]+"${PRECISION[@]}"}
    --no-save --eval-interval 0 --log-interval 1 --train-iters "$iters" --lr-warmup-iters 2
    --collective-checks false --use-distributed-optimizer
    --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size 1 --data-parallel-size $(( NPROC / tp ))
    --expert-model-parallel-size "$ep" --micro-batch-size 1 --global-batch-size 8 --seq-length "$SEQ" "$@")
  [ "${FORCE_BALANCE:-0}" = 1 ] && args+=(--moe-router-force-load-balancing)
  PORT=$(( PORT + 1 ))
  say "=== ours $name: $preset, TP $tp, EP $ep x expert-DP $(( NPROC / tp / ep )), seq $SEQ, $iters iterations (limit $lim s)"
  echo "$PRETRAIN ${args[*]}" >> "$LOG"
  local s=$(date +%s)
  smi_start "$name"
  timeout -k 20 "$lim" $LAUNCH --nproc-per-node $NPROC --master-port $PORT -- $PRETRAIN "${args[@]}" > "$OUT/$name.log" 2>&1
  local rc=$?
  smi_stop
  grep -E "start-up|training a GPT|iteration +[0-9]+/|panicked|Error|error" "$OUT/$name.log" | grep -v "^start-up: building" | tail -$(( iters + 3 )) | cut -c1-500 | tee -a "$LOG"
  summarise ours "$name" $rc $(( $(date +%s) - s )) "preset=$preset ep=$ep seq=$SEQ"
  gpus_idle
}

torch() { # name [torch_moe.py flags...]
  local name=$1; shift
  # Global batch 8, as ours: 8 / NPROC micro-batches a rank between optimizer steps.
  local lim flags=("$@" --seq "$SEQ" --micro-batch 1 --grad-accum $(( 8 / NPROC )) --warmup 2 --steps "$TORCH_STEPS")
  [ "${FORCE_BALANCE:-0}" = 1 ] && flags+=(--force-balance)
  [ "$TORCH_NO_COMPILE" = 1 ] && [[ " $* " != *" --no-compile "* ]] && { flags+=(--no-compile); name=${name}_eager; }
  if [ "$CPU_CHECK" = 1 ]; then
    say "=== torch $name (not run on CPU): torchrun --nproc-per-node $NPROC bench/torch_moe.py ${flags[*]}"
    return
  fi
  if ! lim=$(run_limit "$LIMIT_TORCH"); then say "=== skip torch $name: less than ${MIN_START} s of the ${BUDGET} s budget left"; return; fi
  PORT=$(( PORT + 1 ))
  say "=== torch $name: ${flags[*]} (limit $lim s)"
  local s=$(date +%s)
  smi_start "torch_$name"
  timeout -k 30 "$lim" torchrun --nproc-per-node $NPROC --master-port $PORT bench/torch_moe.py "${flags[@]}" > "$OUT/torch_$name.log" 2>&1
  local rc=$?
  smi_stop
  grep -E "torch_moe|RESULT|Error|error" "$OUT/torch_$name.log" | grep -v "^\[rank[1-9]" | tail -10 | cut -c1-400 | tee -a "$LOG"
  summarise torch "$name" $rc $(( $(date +%s) - s )) "${flags[*]}"
  gpus_idle
  if [ $rc -ne 0 ] && [ "$TORCH_FALLBACK" = 1 ] && [[ " ${flags[*]} " != *" --no-compile "* ]] \
      && ! grep -qE "OUT OF MEMORY|OutOfMemoryError|out of memory" "$OUT/torch_$name.log" && [ $rc -ne 124 ] && [ $rc -ne 137 ]; then
    say "torch $name failed with torch.compile (rc $rc): again without it, and later torch runs without it"
    TORCH_NO_COMPILE=1
    torch "$name" "$@"
  fi
}

grouped_gemm() { # the experts' grouped GEMM: checked, then timed, and torch._grouped_mm's times
  if [ "$CPU_CHECK" = 1 ]; then
    say "=== gemm (not run on CPU): .gpu/bin/gemm_bench grouped; python3 bench/torch_gemm.py --grouped"
    return
  fi
  local lim
  if ! lim=$(run_limit "${LIMIT_GEMM:-120}"); then say "=== skip gemm: less than ${MIN_START} s of the ${BUDGET} s budget left"; return; fi
  say "=== gemm: gemm_bench grouped (limit $lim s)"
  timeout -k 10 "$lim" .gpu/bin/gemm_bench grouped > "$OUT/gemm_grouped.log" 2>&1
  local rc=$?
  grep -vE "^$|^note|backtrace" "$OUT/gemm_grouped.log" | cut -c1-300 | head -200 | tee -a "$LOG"
  say "RUN ours gemm_grouped | rc=$rc$( [ $rc -eq 0 ] || echo ' (1: a mismatch; else a failure)' )"
  if ! lim=$(run_limit "${LIMIT_GEMM:-120}"); then return; fi
  say "=== gemm: torch_gemm.py --grouped (limit $lim s)"
  timeout -k 10 "$lim" python3 bench/torch_gemm.py --grouped > "$OUT/torch_gemm_grouped.log" 2>&1
  rc=$?
  grep -vE "^$" "$OUT/torch_gemm_grouped.log" | cut -c1-300 | tail -40 | tee -a "$LOG"
  say "RUN torch gemm_grouped | rc=$rc"
}

# Preflight: the binary knows MoE; the GPUs; torch and its grouped GEMM.
if { part ours || part torch; } && ! $PRETRAIN --help 2>/dev/null | grep -q -- "--num-experts"; then
  say "ERROR: $PRETRAIN has no --num-experts: repack it (bench/pack_gpu.sh) from a tree with issue 34"
  exit 1
fi
if [ "$CPU_CHECK" != 1 ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
  python3 -c "import torch; print('torch', torch.__version__, 'grouped_mm' if hasattr(torch, '_grouped_mm') else 'WITHOUT torch._grouped_mm (the peer loops over experts)')" 2>&1 | tail -1 | tee -a "$LOG"
fi
say "moe_gpu_check: PART=$PART ITERS=$ITERS BUDGET=${BUDGET}s $(date -u +%H:%M:%S)"

part gemm && grouped_gemm
if [ "$PART" != all ] && part two; then
  # For 2 GPUs (NPROC=2): both presets at EP 2, each peer, and a profile of ours (Mixtral).
  ours mixtral_ep2 mixtral_1b_moe 2
  torch mixtral_ep2 --preset mixtral --ep 2
  ours deepseek_ep2 deepseek_moe_1b 2
  torch deepseek_ep2 --preset deepseek --ep 2
  BM_PROFILE=1 ITERS=3 ours mixtral_ep2_profile mixtral_1b_moe 2 --profile --profile-step-start 2 --profile-step-end 3 --profile-ranks 0
fi
if [ "$PART" != all ] && part late; then
  # For 2 GPUs (NPROC=2): is the step steady once warm? Mixtral-like at EP 2 for 20
  # iterations, its steps 15-16 profiled on rank 0, then the peer.
  BM_PROFILE=1 ITERS=20 ours mixtral_ep2_late mixtral_1b_moe 2 --profile --profile-step-start 15 --profile-step-end 16 --profile-ranks 0
  torch mixtral_ep2 --preset mixtral --ep 2
fi
if [ "$PART" != all ] && part deeplate2; then
  # For 2 GPUs (NPROC=2): the DeepSeek-like preset at EP 2 for 20 iterations, its steps 15-16
  # profiled on rank 0, then the peer: where its 0.57x of 2026-11-28 goes once warm.
  BM_PROFILE=1 ITERS=20 ours deepseek_ep2_late deepseek_moe_1b 2 --profile --profile-step-start 15 --profile-step-end 16 --profile-ranks 0
  torch deepseek_ep2 --preset deepseek --ep 2
fi
if [ "$PART" != all ] && part steady2; then
  # For 2 GPUs (NPROC=2): both presets at EP 2 for 20 iterations each (the first six compile
  # and tune), each followed by its peer; no profile.
  ITERS=20 ours mixtral_ep2_steady mixtral_1b_moe 2
  torch mixtral_ep2 --preset mixtral --ep 2
  ITERS=20 ours deepseek_ep2_steady deepseek_moe_1b 2
  torch deepseek_ep2 --preset deepseek --ep 2
fi
if [ "$PART" != all ] && part global2; then
  # For 2 GPUs (NPROC=2): what --moe-router-load-balancing-type global_aux_loss costs (one
  # all-reduce of the counts over DP x CP a layer and micro-batch, on the device): the
  # Mixtral-like preset at EP 2 with the hook for 20 iterations with the Switch loss
  # (aux_loss), then with global_aux_loss, then the peer.
  ITERS=20 ours mixtral_ep2_hook_aux mixtral_1b_moe 2 --overlap-grad-reduce
  ITERS=20 ours mixtral_ep2_hook_global mixtral_1b_moe 2 --overlap-grad-reduce --moe-router-load-balancing-type global_aux_loss
  torch mixtral_ep2 --preset mixtral --ep 2
fi
if [ "$PART" != all ] && part jitter2; then
  # For 2 GPUs (NPROC=2): what a list of load-balancing losses and the router's input jitter
  # cost (a counter-based draw of the router's input a layer and micro-batch): the
  # Mixtral-like preset at EP 2 with the hook for 20 iterations with aux_loss, then with
  # aux_loss and seq_aux_loss and --moe-input-jitter-eps 0.01, then the peer.
  ITERS=20 ours mixtral_ep2_hook_aux mixtral_1b_moe 2 --overlap-grad-reduce
  ITERS=20 ours mixtral_ep2_hook_jitter mixtral_1b_moe 2 --overlap-grad-reduce --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01 0.001 --moe-input-jitter-eps 0.01
  torch mixtral_ep2 --preset mixtral --ep 2
fi
if [ "$PART" != all ] && part jitterprof2; then
  # For 2 GPUs (NPROC=2): jitter2's two runs for 10 iterations, step 8 profiled on rank 0.
  BM_PROFILE=1 ITERS=10 ours mixtral_ep2_hook_aux_profile mixtral_1b_moe 2 --overlap-grad-reduce --profile --profile-step-start 8 --profile-step-end 9 --profile-ranks 0
  BM_PROFILE=1 ITERS=10 ours mixtral_ep2_hook_jitter_profile mixtral_1b_moe 2 --overlap-grad-reduce --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01 0.001 --moe-input-jitter-eps 0.01 --profile --profile-step-start 8 --profile-step-end 9 --profile-ranks 0
fi
if [ "$PART" != all ] && part grouped2; then
  # For 2 GPUs (NPROC=2): the experts' forward and input-gradient products as one cuBLAS
  # grouped GEMM (BM_GROUPED_GEMM=grouped) against one cuBLASLt GEMM an expert (the default),
  # both presets at EP 2 for 20 iterations, then the DeepSeek-like peer. Run PART=gemm
  # first for the products' TFLOP/s alone.
  ITERS=20 ours deepseek_ep2_loop deepseek_moe_1b 2
  BM_GROUPED_GEMM=grouped ITERS=20 ours deepseek_ep2_grouped deepseek_moe_1b 2
  BM_GROUPED_GEMM=grouped ITERS=20 ours mixtral_ep2_grouped mixtral_1b_moe 2
  torch deepseek_ep2 --preset deepseek --ep 2
fi
if [ "$PART" != all ] && part engines1; then
  # For one GPU (NPROC=1): the experts' products by each engine (BM_GROUPED_GEMM: cuBLAS's
  # grouped GEMM, cuBLASLt GEMMs on 2 and 4 streams), 8 layers of each preset at EP 1, 16
  # iterations; the DeepSeek-like one profiled at step 14 with 4 streams; then its peer with
  # 8 layers. Run PART=gemm first for the products' TFLOP/s alone.
  BM_GROUPED_GEMM=grouped ITERS=16 ours deepseek_ep1_grouped deepseek_moe_1b 1 --num-layers 8
  BM_GROUPED_GEMM=streams:4 ITERS=16 ours deepseek_ep1_streams4 deepseek_moe_1b 1 --num-layers 8
  BM_GROUPED_GEMM=streams:2 ITERS=16 ours deepseek_ep1_streams2 deepseek_moe_1b 1 --num-layers 8
  BM_GROUPED_GEMM=streams:4 BM_PROFILE=1 ITERS=16 ours deepseek_ep1_streams4_profile deepseek_moe_1b 1 --num-layers 8 --profile --profile-step-start 14 --profile-step-end 15 --profile-ranks 0
  ITERS=16 ours mixtral_ep1_loop mixtral_1b_moe 1 --num-layers 8
  BM_GROUPED_GEMM=streams:4 ITERS=16 ours mixtral_ep1_streams4 mixtral_1b_moe 1 --num-layers 8
  torch deepseek_ep1 --preset deepseek --ep 1 --layers 8
fi
if [ "$PART" != all ] && part rule1; then
  # For one GPU (NPROC=1): the engines' rule (grouped above 8 local experts, 2 streams
  # below), 8 layers of each preset at EP 1, 16 iterations, the DeepSeek-like one profiled at
  # step 14 in a second run; then its peer with 8 layers.
  ITERS=16 ours deepseek_ep1_rule deepseek_moe_1b 1 --num-layers 8
  ITERS=16 ours mixtral_ep1_rule mixtral_1b_moe 1 --num-layers 8
  BM_PROFILE=1 ITERS=16 ours deepseek_ep1_rule_profile deepseek_moe_1b 1 --num-layers 8 --profile --profile-step-start 14 --profile-step-end 15 --profile-ranks 0
  torch deepseek_ep1 --preset deepseek --ep 1 --layers 8
fi
if [ "$PART" != all ] && part hook1; then
  # For one GPU (NPROC=1): the experts' weight gradients through the overlap hook
  # (--overlap-grad-reduce: summed over the micro-batches in the f32 buffers, the grouped
  # products accumulating there) against the gradient container's bf16 sums, 8 layers of each
  # preset at EP 1, 16 iterations; the DeepSeek-like one with the hook profiled at step 14;
  # then its peer with 8 layers.
  ITERS=16 ours deepseek_ep1_container deepseek_moe_1b 1 --num-layers 8
  ITERS=16 ours deepseek_ep1_hook deepseek_moe_1b 1 --num-layers 8 --overlap-grad-reduce
  ITERS=16 ours mixtral_ep1_hook mixtral_1b_moe 1 --num-layers 8 --overlap-grad-reduce
  torch deepseek_ep1 --preset deepseek --ep 1 --layers 8
  BM_PROFILE=1 ITERS=16 ours deepseek_ep1_hook_profile deepseek_moe_1b 1 --num-layers 8 --overlap-grad-reduce --profile --profile-step-start 14 --profile-step-end 15 --profile-ranks 0
  ITERS=16 ours mixtral_ep1_container mixtral_1b_moe 1 --num-layers 8
fi
if [ "$PART" != all ] && part hook1b; then
  # For one GPU (NPROC=1): PART=hook1's runs with the overlap hook again, each next to its peer
  # (both presets, 8 layers at EP 1).
  ITERS=16 ours deepseek_ep1_hook deepseek_moe_1b 1 --num-layers 8 --overlap-grad-reduce
  torch deepseek_ep1 --preset deepseek --ep 1 --layers 8
  ITERS=16 ours mixtral_ep1_hook mixtral_1b_moe 1 --num-layers 8 --overlap-grad-reduce
  torch mixtral_ep1 --preset mixtral --ep 1 --layers 8
fi
if [ "$PART" != all ] && part adamw2; then
  # For 2 GPUs (NPROC=2): the build before (OLD=.gpu/old/pretrain_gpt) against this one, the
  # DeepSeek-like preset at EP 2, 14 iterations, step 12 profiled on rank 0 (AdamW's kernel
  # time is in the profile's table).
  if [ -x "${OLD:-}" ]; then
    PRETRAIN=$OLD BM_PROFILE=1 ITERS=14 ours deepseek_ep2_old deepseek_moe_1b 2 --profile --profile-step-start 12 --profile-step-end 13 --profile-ranks 0
  fi
  BM_PROFILE=1 ITERS=14 ours deepseek_ep2_new deepseek_moe_1b 2 --profile --profile-step-start 12 --profile-step-end 13 --profile-ranks 0
fi
if [ "$PART" != all ] && part nan2; then
  # For 2 GPUs (NPROC=2): the Mixtral-like model at EP 1 x DP 2 (no token exchange), whose
  # losses EP 2 must match up to bf16 rounding; the DeepSeek-like one with 8 layers (far
  # from full memory) at EP 2.
  ITERS=20 ours mixtral_ep1 mixtral_1b_moe 1
  ITERS=6 ours deepseek_ep2_8layers deepseek_moe_1b 2 --num-layers 8
fi
if [ "$PART" != all ] && part nan2b; then
  # For 2 GPUs (NPROC=2), with RUST_BACKTRACE=1 (a binary with its symbols): the Mixtral-like
  # model at EP 1 x DP 2 for 2 iterations; the DeepSeek-like one (16 layers) at EP 2 with full
  # recomputation for 4.
  RUST_BACKTRACE=1 ITERS=3 ours mixtral_ep1_bt mixtral_1b_moe 1
  ITERS=4 ours deepseek_ep2_recompute deepseek_moe_1b 2 --recompute-granularity full
fi
if [ "$PART" != all ] && part nan2c; then
  # For 2 GPUs (NPROC=2): the DeepSeek-like model with 8 layers at EP 2 with full recomputation
  # (the same run without it: part nan2), to compare the first iteration's gradient norm.
  ITERS=3 ours deepseek_ep2_8layers_recompute deepseek_moe_1b 2 --num-layers 8 --recompute-granularity full
  RUST_BACKTRACE=1 ITERS=3 ours mixtral_ep1_bt mixtral_1b_moe 1
fi
if [ "$PART" != all ] && part nan2d; then
  # For 2 GPUs (NPROC=2): the DeepSeek-like model (16 layers) at EP 2 with the bucketed,
  # overlapped gradient reduction instead of one reduce-scatter of the whole flat buffer.
  ITERS=3 ours deepseek_ep2_overlap deepseek_moe_1b 2 --overlap-grad-reduce
fi
if [ "$PART" != all ] && part parts2; then
  # For 2 GPUs (NPROC=2): the presets whose routed experts pass 2^32 elements on a rank, now
  # cut into parts by the optimizer: the DeepSeek-like model (16 layers) at EP 2 and its peer,
  # then the Mixtral-like one at EP 1 x DP 2.
  ITERS=8 ours deepseek_ep2_parts deepseek_moe_1b 2
  torch deepseek_ep2 --preset deepseek --ep 2
  ITERS=4 ours mixtral_ep1_parts mixtral_1b_moe 1
fi
if [ "$PART" != all ] && part gather2; then
  # For 2 GPUs (NPROC=2): the Mixtral-like model at EP 2 with each token dispatcher: the
  # all-gather one's losses against the all-to-all's, and their speeds.
  ITERS=10 ours mixtral_ep2_alltoall mixtral_1b_moe 2 --moe-token-dispatcher-type alltoall
  ITERS=10 ours mixtral_ep2_allgather mixtral_1b_moe 2 --moe-token-dispatcher-type allgather
fi
if [ "$PART" != all ] && part hook2; then
  # For 2 GPUs (NPROC=2): both presets at EP 2 with the overlap hook (the experts' weight
  # gradients accumulated in the f32 buffers and reduced over expert-DP during the backward
  # pass), 20 iterations, each next to its peer.
  ITERS=20 ours mixtral_ep2_hook mixtral_1b_moe 2 --overlap-grad-reduce
  torch mixtral_ep2 --preset mixtral --ep 2
  ITERS=20 ours deepseek_ep2_hook deepseek_moe_1b 2 --overlap-grad-reduce
  torch deepseek_ep2 --preset deepseek --ep 2
fi
if [ "$PART" != all ] && part etp2; then
  # For 2 GPUs (NPROC=2): expert tensor parallelism on GPUs. The Mixtral-like preset with 8
  # layers at TP 2 with sequence parallelism, EP 1, its experts split over TP (ETP 2, the
  # default) and whole on each TP rank (ETP 1): equal losses up to bf16's rounding, and
  # their speeds. Then the router's dtype: the DeepSeek-like preset with 8 layers at EP 2,
  # the router in fp32 and in fp64.
  TP=2 ITERS=12 ours mixtral_tp2_etp2 mixtral_1b_moe 1 --num-layers 8 --sequence-parallel
  TP=2 ITERS=12 ours mixtral_tp2_etp1 mixtral_1b_moe 1 --num-layers 8 --sequence-parallel --expert-tensor-parallel-size 1
  ITERS=12 ours deepseek_ep2_router32 deepseek_moe_1b 2 --num-layers 8 --moe-router-dtype fp32
  ITERS=12 ours deepseek_ep2_router64 deepseek_moe_1b 2 --num-layers 8 --moe-router-dtype fp64
fi
if [ "$PART" != all ] && part router1; then
  # For one GPU (NPROC=1): the router's dtype on a GPU. The DeepSeek-like preset with 8 layers
  # at EP 1 (bf16), the router in the model's dtype, in fp32 and in fp64.
  ITERS=12 ours deepseek_ep1_router_bf16 deepseek_moe_1b 1 --num-layers 8
  ITERS=12 ours deepseek_ep1_router32 deepseek_moe_1b 1 --num-layers 8 --moe-router-dtype fp32
  ITERS=12 ours deepseek_ep1_router64 deepseek_moe_1b 1 --num-layers 8 --moe-router-dtype fp64
fi
if [ "$PART" != all ] && part sinkhorn1; then
  # For one GPU (NPROC=1): Sinkhorn balancing on a GPU. The Mixtral-like preset with 8 layers
  # at EP 1 (bf16) with --moe-router-load-balancing-type sinkhorn (no auxiliary loss), 16
  # iterations, next to the same model with the auxiliary loss.
  ITERS=16 ours mixtral_ep1_aux mixtral_1b_moe 1 --num-layers 8
  ITERS=16 ours mixtral_ep1_sinkhorn mixtral_1b_moe 1 --num-layers 8 --moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0
fi
if [ "$PART" != all ] && part balanced1; then
  # For one GPU (NPROC=1): what the routing's imbalance costs. Both presets with 8 layers at
  # EP 1 with the overlap hook, routed as trained and with an even load (FORCE_BALANCE), each
  # next to its peer routed the same way.
  for preset in deepseek mixtral; do
    cfg=${preset}_1b_moe; [ $preset = deepseek ] && cfg=deepseek_moe_1b
    ITERS=16 ours ${preset}_ep1_hook $cfg 1 --num-layers 8 --overlap-grad-reduce
    torch ${preset}_ep1 --preset $preset --ep 1 --layers 8
    FORCE_BALANCE=1 ITERS=16 ours ${preset}_ep1_hook_even $cfg 1 --num-layers 8 --overlap-grad-reduce
    FORCE_BALANCE=1 torch ${preset}_ep1_even --preset $preset --ep 1 --layers 8
  done
fi
if [ "$PART" != all ] && part padded1; then
  # For one GPU (NPROC=1): the DeepSeek-like layers' 64 experts with their blocks padded to one
  # size (one strided-batched GEMM a product, the default) against cuBLAS's grouped GEMM on the
  # blocks as they are (BM_EXPERT_PADDING=off), at an even load and as routed, next to the peer.
  FORCE_BALANCE=1 ITERS=16 ours deepseek_ep1_even_padded deepseek_moe_1b 1 --num-layers 8 --overlap-grad-reduce
  BM_EXPERT_PADDING=off FORCE_BALANCE=1 ITERS=16 ours deepseek_ep1_even_unpadded deepseek_moe_1b 1 --num-layers 8 --overlap-grad-reduce
  FORCE_BALANCE=1 torch deepseek_ep1_even --preset deepseek --ep 1 --layers 8
  ITERS=16 ours deepseek_ep1_padded deepseek_moe_1b 1 --num-layers 8 --overlap-grad-reduce
  torch deepseek_ep1 --preset deepseek --ep 1 --layers 8
fi
if [ "$PART" != all ] && part padprof1; then
  # For one GPU: where the padded DeepSeek-like step goes at an even load (step 15 profiled).
  FORCE_BALANCE=1 BM_PROFILE=1 ITERS=16 ours deepseek_ep1_even_padded_profile deepseek_moe_1b 1 --num-layers 8 --overlap-grad-reduce --profile --profile-step-start 14 --profile-step-end 15 --profile-ranks 0
fi
if [ "$PART" != all ] && part fold1; then
  # For one GPU: the experts' padding done by the dispatcher's own row moves (this build)
  # against its own two gathers each way (the build before, OLD=.gpu/old/pretrain_gpt), the
  # DeepSeek-like layers (8, EP 1, the hook) at an even load, next to the peer.
  FORCE_BALANCE=1 ITERS=16 ours deepseek_ep1_even_fold deepseek_moe_1b 1 --num-layers 8 --overlap-grad-reduce
  if [ -x "${OLD:-}" ]; then
    PRETRAIN=$OLD FORCE_BALANCE=1 ITERS=16 ours deepseek_ep1_even_old deepseek_moe_1b 1 --num-layers 8 --overlap-grad-reduce
  fi
  FORCE_BALANCE=1 torch deepseek_ep1_even --preset deepseek --ep 1 --layers 8
fi
if [ "$PART" != all ] && part foldr1; then
  # For one GPU: PART=fold1's comparison with the layers routed as trained, the build
  # before first this time.
  if [ -x "${OLD:-}" ]; then
    PRETRAIN=$OLD ITERS=16 ours deepseek_ep1_old deepseek_moe_1b 1 --num-layers 8 --overlap-grad-reduce
  fi
  ITERS=16 ours deepseek_ep1_fold deepseek_moe_1b 1 --num-layers 8 --overlap-grad-reduce
  torch deepseek_ep1 --preset deepseek --ep 1 --layers 8
fi
if [ "$PART" != all ] && part fold2; then
  # For 2 GPUs (NPROC=2): PART=hook2's DeepSeek-like run (EP 2, 32 local experts: padded), the
  # build before (OLD=.gpu/old/pretrain_gpt: the padding's own gathers) and this one (the
  # padding in the dispatcher's gathers), next to the peer.
  if [ -x "${OLD:-}" ]; then
    PRETRAIN=$OLD ITERS=20 ours deepseek_ep2_hook_old deepseek_moe_1b 2 --overlap-grad-reduce
  fi
  ITERS=20 ours deepseek_ep2_hook deepseek_moe_1b 2 --overlap-grad-reduce
  torch deepseek_ep2 --preset deepseek --ep 2
fi
if [ "$PART" != all ] && part gatherpad2; then
  # For 2 GPUs (NPROC=2): the DeepSeek-like layers (8, EP 2: 32 local experts, padded at an
  # even load) with each token dispatcher, the all-gather one's padding in its own plan (this
  # build) and by the experts' gathers (the build before, OLD=.gpu/old/pretrain_gpt).
  FORCE_BALANCE=1 ITERS=12 ours deepseek_ep2_even_alltoall deepseek_moe_1b 2 --num-layers 8 --overlap-grad-reduce --moe-token-dispatcher-type alltoall
  FORCE_BALANCE=1 ITERS=12 ours deepseek_ep2_even_allgather deepseek_moe_1b 2 --num-layers 8 --overlap-grad-reduce --moe-token-dispatcher-type allgather
  if [ -x "${OLD:-}" ]; then
    PRETRAIN=$OLD FORCE_BALANCE=1 ITERS=12 ours deepseek_ep2_even_allgather_old deepseek_moe_1b 2 --num-layers 8 --overlap-grad-reduce --moe-token-dispatcher-type allgather
  fi
fi
if [ "$PART" != all ] && part gathersteady2; then
  # For 2 GPUs (NPROC=2): PART=hook2's runs (16 layers, EP 2, the hook, 20 iterations) with
  # the all-gather dispatcher, each next to its peer (whose dispatch is an all-to-all).
  ITERS=20 ours mixtral_ep2_hook_allgather mixtral_1b_moe 2 --overlap-grad-reduce --moe-token-dispatcher-type allgather
  torch mixtral_ep2 --preset mixtral --ep 2
  ITERS=20 ours deepseek_ep2_hook_allgather deepseek_moe_1b 2 --overlap-grad-reduce --moe-token-dispatcher-type allgather
  torch deepseek_ep2 --preset deepseek --ep 2
fi
if [ "$PART" != all ] && part direct1; then
  # For one GPU: 8 Mixtral-like layers (8 experts: not padded) at EP 1 with the hook, where
  # the all-to-all's send buffer is now the experts' blocks (no exchange, no receive gather),
  # against the build before (OLD=.gpu/old/pretrain_gpt), routed as trained and at an even
  # load, next to the peer routed as trained.
  if [ -x "${OLD:-}" ]; then
    PRETRAIN=$OLD ITERS=16 ours mixtral_ep1_hook_old mixtral_1b_moe 1 --num-layers 8 --overlap-grad-reduce
  fi
  ITERS=16 ours mixtral_ep1_hook mixtral_1b_moe 1 --num-layers 8 --overlap-grad-reduce
  torch mixtral_ep1 --preset mixtral --ep 1 --layers 8
  if [ -x "${OLD:-}" ]; then
    PRETRAIN=$OLD FORCE_BALANCE=1 ITERS=16 ours mixtral_ep1_hook_even_old mixtral_1b_moe 1 --num-layers 8 --overlap-grad-reduce
  fi
  FORCE_BALANCE=1 ITERS=16 ours mixtral_ep1_hook_even mixtral_1b_moe 1 --num-layers 8 --overlap-grad-reduce
fi
if [ "$PART" != all ] && part steady4a; then
  # For 4 GPUs (NPROC=4): issue 34's EP 4 check settled: both presets (16 layers) with the
  # overlap hook for 20 iterations, each next to its peer.
  ITERS=20 ours mixtral_ep4_hook mixtral_1b_moe 4 --overlap-grad-reduce
  torch mixtral_ep4 --preset mixtral --ep 4
  ITERS=20 ours deepseek_ep4_hook deepseek_moe_1b 4 --overlap-grad-reduce
  torch deepseek_ep4 --preset deepseek --ep 4
fi
if [ "$PART" != all ] && part steady4b; then
  # For 4 GPUs (NPROC=4): issue 34's EP 2 x expert-DP 2 check: the same at EP 2 on 4 ranks.
  ITERS=20 ours mixtral_ep2_edp2_hook mixtral_1b_moe 2 --overlap-grad-reduce
  torch mixtral_ep2_edp2 --preset mixtral --ep 2
  ITERS=20 ours deepseek_ep2_edp2_hook deepseek_moe_1b 2 --overlap-grad-reduce
  torch deepseek_ep2_edp2 --preset deepseek --ep 2
fi
if [ "$PART" != all ] && part gathersteady4; then
  # For 4 GPUs (NPROC=4): PART=steady4a's runs (EP 4, the hook, 20 iterations) with the
  # all-gather dispatcher, then the peers while the budget lasts.
  ITERS=20 ours mixtral_ep4_hook_allgather mixtral_1b_moe 4 --overlap-grad-reduce --moe-token-dispatcher-type allgather
  ITERS=20 ours deepseek_ep4_hook_allgather deepseek_moe_1b 4 --overlap-grad-reduce --moe-token-dispatcher-type allgather
  torch mixtral_ep4 --preset mixtral --ep 4
  torch deepseek_ep4 --preset deepseek --ep 4
fi
if [ "$PART" != all ] && part late4; then
  # For 4 GPUs: the same at EP 4.
  BM_PROFILE=1 ITERS=20 ours mixtral_ep4_late mixtral_1b_moe 4 --profile --profile-step-start 15 --profile-step-end 16 --profile-ranks 0
  torch mixtral_ep4 --preset mixtral --ep 4
fi
part ours && ours mixtral_ep4 mixtral_1b_moe 4
part torch && torch mixtral_ep4 --preset mixtral --ep 4
part ours && ours deepseek_ep4 deepseek_moe_1b 4
part torch && torch deepseek_ep4 --preset deepseek --ep 4
part ours && ours mixtral_ep2 mixtral_1b_moe 2
part torch && torch mixtral_ep2 --preset mixtral --ep 2
say "=== summary ($(( $(date +%s) - T0 )) s; $SUMMARY)"
[ -f "$SUMMARY" ] && tee -a "$LOG" < "$SUMMARY"
true
