#!/usr/bin/env bash
# Context parallelism (issue 35) on 4 GPUs in one device call (kind nvidia-h100-x4 or
# nvidia-h200-x4): pretrain_gpt --context-parallel-size on a ~1B Llama
# (examples/configs/llama_1b_long.toml: Llama-3.2-1B's shape, untied, 32000-token vocabulary)
# in bf16 at 32k, 64k and 128k tokens a sequence, CP 1 (x DP 4), CP 2 (x DP 2) and CP 4, and
# PyTorch's context parallelism (bench/torch_cp.py: context_parallel + FSDP2) at the same
# shapes; logs go to $OUT. Micro-batch 1, global batch = DP (one sequence per CP group and
# step; GB= sets another), full recomputation (every layer rerun in the backward pass) unless a run says
# otherwise, the distributed optimizer, no checkpoints, no evaluation. Needs, packed under
# .gpu/ (bench/pack_gpu.sh): bin/{pretrain_gpt,bm-launch} (bench/pack_gpu.sh build --release
# --features cuda -p burn-megatron-examples --example pretrain_gpt, and -p burn-megatron-dist
# --bin bm-launch), and torch with torchrun on the machine.
#
#   bash bench/context_parallel_gpu_check.sh                  # PART=all in priority order, within BUDGET
#   PART=key bash bench/context_parallel_gpu_check.sh         # the first 6 runs only (~6 min)
#   PART=seq,comm BUDGET=520 bash bench/context_parallel_gpu_check.sh
#
# Parts, in the order they run (PART=all runs them all, each run started only while at least
# MIN_START of the BUDGET seconds is left, and cut at what is left):
#   key    ours CP 4 p2p at 128k; CP 1 (DP 4) and CP 2 p2p (DP 2) at 32k; torch CP 4 at 128k
#          and CP 2 at 32k; ours CP 1 at 128k (2 iterations: does it fit? an out-of-memory is
#          reported as status OOM)
#   seq    ours CP 4 at 32k; CP 2, CP 4 and CP 1 at 64k; CP 2 at 128k
#   comm   ours a2a at CP 2 and 4, all_gather at CP 4 and 2 (32k; all_gather is a composition
#          that materialises [heads, seq/cp, seq] f32 scores a layer: 32-64 GiB at 32k, expect
#          OOM); torch with the all-to-all rotation (CP 2) and CP 4, at 32k
#   long   ours CP 4 and torch CP 4 at 128k, ours CP 1 at 128k (the key part's 128k runs)
#   two    (NPROC=2) ours CP 1 (DP 2), CP 2 p2p and a2a at 32k, a profile of CP 2 p2p, CP 2 at
#          128k; torch CP 2 at 32k with both rotations
#   ratio  (NPROC=2) ours CP 1 (DP 2) and CP 2 p2p at 32k, and a profile of CP 2 p2p
#   two64  (NPROC=2) ours CP 1 (DP 2), CP 2 p2p and a2a at 64k; a2a at 32k
#   room   ours CP 4 and CP 1 (x DP 4) at 128k without recomputation (does CP 1 fit?)
#   ag2    (NPROC=2) the fused all_gather: ours CP 1 (DP 2) and CP 2 all_gather at 32k and 64k
#   peer   ours against PyTorch's CP in one call: CP 1 (x DP 4) and CP 2 p2p and all_gather
#          at 32k with torch CP 2; CP 4 p2p at 64k with torch CP 4; CP 4 p2p and all_gather
#          at 128k with torch CP 4
#   equal  ours at 32k with the same global batch (4 sequences a step) at CP 1 (x DP 4) and
#          CP 2 (x DP 2, 2 microbatches) with each comm type: the per-step work (the gradient
#          reduction, the optimizer step) spread over as many tokens
#   matrix ours at 32k and 64k, CP 1 (x DP 4), CP 2 (x DP 2) and CP 4 with each comm type;
#          at 128k CP 4 with each comm type and CP 2 p2p (3 iterations each)
#   extra  ours CP 4 at 128k without recomputation; all_gather and p2p at 8k (CP 4); torch CP 4
#          at 128k with the all-to-all rotation, and without activation checkpointing
# Each run prints its iteration lines and one RUN line (median tokens/s, TFLOP/s per GPU and
# MFU over the iterations after the first, the log's memory in use of the largest rank at the
# end of a step, nvidia-smi's peak memory of any GPU sampled every 0.5 s, rc, status); every
# RUN line also goes to $OUT/summary.tsv, printed again at the end.
#
# Settings: ITERS=4 (ours; iteration 1 compiles and tunes the kernels and is left out of the
# medians), TORCH_STEPS=3 after 2 warm-up steps, BUDGET=520 s, LIMIT_OURS=150 and
# LIMIT_TORCH=240 s a run (a hung run is cut there; torch compiles for a minute or more),
# MIN_START=45 s, TORCH_FALLBACK=1 (a torch run that fails with torch.compile, for another
# reason than memory, is rerun with --no-compile, and later torch runs skip compile).
# CPU_CHECK=1 runs every pretrain_gpt command line of the script on CPU thread ranks with a
# tiny model (target/debug binaries, fp32, seq 256) to check that pretrain_gpt accepts them,
# and prints the torch command lines without running them.
set -u
cd "$(dirname "$0")/.."
CPU_CHECK=${CPU_CHECK:-0}
NPROC=${NPROC:-4}
ITERS=${ITERS:-4}
TORCH_STEPS=${TORCH_STEPS:-3}
BUDGET=${BUDGET:-520}
MIN_START=${MIN_START:-45}
LIMIT_OURS=${LIMIT_OURS:-150}
LIMIT_TORCH=${LIMIT_TORCH:-240}
TORCH_FALLBACK=${TORCH_FALLBACK:-1}
PART=${PART:-all}
CONFIG=examples/configs/llama_1b_long.toml
if [ "$CPU_CHECK" = 1 ]; then
  OUT=${OUT:-/tmp/context_parallel_cpu_check}
  LAUNCH=target/debug/bm-launch
  PRETRAIN=target/debug/examples/pretrain_gpt
  PRECISION=()
  TINY=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2
        --ffn-hidden-size 128 --vocab-size 512)
else
  source .gpu/env.sh
  for z in .gpu/bin/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done 2>/dev/null
  chmod +x .gpu/bin/* 2>/dev/null
  LAUNCH=.gpu/bin/bm-launch
  PRETRAIN=.gpu/bin/pretrain_gpt
  PRECISION=(--bf16)
  TINY=()
fi
: "${OUT:?OUT must name the folder for the logs}"
mkdir -p "$OUT"
LOG=$OUT/cp.log
SUMMARY=$OUT/summary.tsv
T0=$(date +%s)
PORT=${PORT_BASE:-29610}
TORCH_NO_COMPILE=0
SMI_PID=
say() { echo "$*" | tee -a "$LOG"; }
part() { [ "$PART" = all ] && return 0; case ",${PART// /,}," in *",$1,"*) return 0 ;; esac; return 1; }
# The seconds a run may take: its limit, or what is left of the budget; fails when too little is.
run_limit() { # the run's own limit
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
                [r"^.*torch_cp: (?:ERROR|OUT OF MEMORY).*$",
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

ours() { # name seq cp comm [pretrain_gpt flags...]; env IT (iterations), RC=none (no recomputation), GB (global batch, default DP)
  local name=$1 seq=$2 cp=$3 comm=$4; shift 4
  local dp=$(( NPROC / cp )) iters=${IT:-$ITERS} lim recompute
  local gb=${GB:-$dp}
  local warmup=$(( iters > 2 ? 2 : iters - 1 )) # the decay must outlast the warm-up
  if ! lim=$(run_limit "$LIMIT_OURS"); then say "=== skip ours $name: less than ${MIN_START} s of the ${BUDGET} s budget left"; return; fi
  if [ "${RC:-full}" = none ]; then
    recompute=()
  else
    recompute=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
  fi
  [ "$CPU_CHECK" = 1 ] && seq=256
  local args=(--config $CONFIG ${TINY[@]+"${TINY[@]}"} ${PRECISION[@]+"${PRECISION[@]}"} --no-save --eval-interval 0 --log-interval 1
    --train-iters "$iters" --lr-warmup-iters "$warmup" --collective-checks false --use-distributed-optimizer
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --context-parallel-size "$cp" --cp-comm-type "$comm" --data-parallel-size "$dp"
    --micro-batch-size 1 --global-batch-size "$gb" --seq-length "$seq" ${recompute[@]+"${recompute[@]}"} "$@")
  PORT=$(( PORT + 1 ))
  say "=== ours $name: seq $seq, CP $cp x DP $dp, global batch $gb, $comm, recompute ${RC:-full}, $iters iterations (limit $lim s)"
  echo "$PRETRAIN ${args[*]}" >> "$LOG"
  local s=$(date +%s)
  smi_start "$name"
  timeout -k 20 "$lim" $LAUNCH --nproc-per-node $NPROC --master-port $PORT -- $PRETRAIN "${args[@]}" > "$OUT/$name.log" 2>&1
  local rc=$?
  smi_stop
  grep -E "start-up|training a GPT|iteration +[0-9]+/|panicked|Error|error" "$OUT/$name.log" | grep -v "^start-up: building" | tail -$(( iters + 3 )) | cut -c1-400 | tee -a "$LOG"
  summarise ours "$name" $rc $(( $(date +%s) - s )) "seq=$seq cp=$cp dp=$dp comm=$comm recompute=${RC:-full}"
  gpus_idle
}

torch() { # name [torch_cp.py flags...]
  local name=$1; shift
  local lim flags=("$@")
  [ "$TORCH_NO_COMPILE" = 1 ] && [[ " $* " != *" --no-compile "* ]] && { flags+=(--no-compile); name=${name}_eager; }
  if [ "$CPU_CHECK" = 1 ]; then
    say "=== torch $name (not run on CPU): torchrun --nproc-per-node $NPROC bench/torch_cp.py ${flags[*]}"
    return
  fi
  if ! lim=$(run_limit "$LIMIT_TORCH"); then say "=== skip torch $name: less than ${MIN_START} s of the ${BUDGET} s budget left"; return; fi
  PORT=$(( PORT + 1 ))
  say "=== torch $name: ${flags[*]} (limit $lim s)"
  local s=$(date +%s)
  smi_start "torch_$name"
  timeout -k 30 "$lim" torchrun --nproc-per-node $NPROC --master-port $PORT bench/torch_cp.py "${flags[@]}" > "$OUT/torch_$name.log" 2>&1
  local rc=$?
  smi_stop
  grep -E "torch_cp|RESULT|step:|warm-up|Error|error" "$OUT/torch_$name.log" | grep -v "^\[rank[1-9]" | tail -8 | cut -c1-400 | tee -a "$LOG"
  summarise torch "$name" $rc $(( $(date +%s) - s )) "${flags[*]}"
  gpus_idle
  if [ $rc -ne 0 ] && [ "$TORCH_FALLBACK" = 1 ] && [[ " ${flags[*]} " != *" --no-compile "* ]] \
      && ! grep -qE "OUT OF MEMORY|OutOfMemoryError|out of memory" "$OUT/torch_$name.log" && [ $rc -ne 124 ] && [ $rc -ne 137 ]; then
    say "torch $name failed with torch.compile (rc $rc): again without it, and later torch runs without it"
    TORCH_NO_COMPILE=1
    torch "$name" "${flags[@]}"
  fi
}

# Preflight: the binary knows context parallelism; the GPUs; torch and its CP API.
if ! $PRETRAIN --help 2>/dev/null | grep -q -- "--context-parallel-size"; then
  say "ERROR: $PRETRAIN has no --context-parallel-size: repack it (bench/pack_gpu.sh) from a tree with issue 35"
  exit 1
fi
if [ "$CPU_CHECK" != 1 ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
  python3 -c "import torch; from torch.distributed.tensor.experimental import context_parallel; print('torch', torch.__version__, 'with context_parallel')" 2>&1 | tail -1 | tee -a "$LOG"
fi
say "context_parallel_gpu_check: PART=$PART ITERS=$ITERS BUDGET=${BUDGET}s $(date -u +%H:%M:%S)"
TS=(--warmup 2 --steps "$TORCH_STEPS")

if part key; then
  ours cp4_p2p_128k 131072 4 p2p
  ours cp1_32k 32768 1 p2p
  ours cp2_p2p_32k 32768 2 p2p
  torch cp4_128k --cp 4 --seq 131072 "${TS[@]}"
  torch cp2_32k --cp 2 --seq 32768 "${TS[@]}"
  # Four 128k sequences a step on 4 GPUs without CP: out of memory, or ~20 s an iteration.
  IT=2 ours cp1_128k 131072 1 p2p
fi
if part long; then
  # The 128k targets only: ours CP 4 against PyTorch's CP 4, and CP 1 (does it fit?).
  ours cp4_p2p_128k 131072 4 p2p
  torch cp4_128k --cp 4 --seq 131072 "${TS[@]}"
  IT=2 ours cp1_128k 131072 1 p2p
fi
if part ratio; then
  # For 2 GPUs (NPROC=2): issue 35's 90 % target alone: CP 2 p2p against CP 1 (x DP 2) at
  # 32k, then CP 2 p2p profiled.
  ours cp1_32k 32768 1 p2p
  ours cp2_p2p_32k 32768 2 p2p
  BM_PROFILE=1 IT=3 ours cp2_p2p_32k_profile 32768 2 p2p --profile --profile-step-start 2 --profile-step-end 3 --profile-ranks 0 1
fi
if part two64; then
  # For 2 GPUs (NPROC=2): 64k, each fused variant against CP 1 (x DP 2), and a2a at 32k.
  IT=3 ours cp1_64k 65536 1 p2p
  IT=3 ours cp2_p2p_64k 65536 2 p2p
  IT=3 ours cp2_a2a_64k 65536 2 a2a
  ours cp2_a2a_32k 32768 2 a2a
fi
if part room; then
  # For 4 GPUs: without recomputation, CP 4 at 128k against CP 1 (x DP 4), which should not
  # fit: the memory CP makes.
  RC=none ours cp4_p2p_128k_norecompute 131072 4 p2p
  RC=none IT=2 ours cp1_128k_norecompute 131072 1 p2p
fi
if part ag2; then
  # For 2 GPUs (NPROC=2): all_gather on the fused flash attention against CP 1 (x DP 2).
  ours cp1_32k 32768 1 p2p
  ours cp2_ag_32k 32768 2 all_gather
  IT=3 ours cp1_64k 65536 1 p2p
  IT=3 ours cp2_ag_64k 65536 2 all_gather
fi
if part peer; then
  # For 4 GPUs: the issue's comparison with PyTorch's context parallelism, same call.
  IT=3 ours cp1_32k 32768 1 p2p
  IT=3 ours cp2_p2p_32k 32768 2 p2p
  IT=3 ours cp2_all_gather_32k 32768 2 all_gather
  torch cp2_32k --cp 2 --seq 32768 "${TS[@]}"
  IT=3 ours cp4_p2p_64k 65536 4 p2p
  torch cp4_64k --cp 4 --seq 65536 "${TS[@]}"
  IT=3 ours cp4_p2p_128k 131072 4 p2p
  IT=3 ours cp4_all_gather_128k 131072 4 all_gather
  torch cp4_128k --cp 4 --seq 131072 "${TS[@]}"
fi
if part equal; then
  # For 4 GPUs: CP 2 against CP 1 at the same global batch.
  GB=4 IT=3 ours cp1_32k_gb4 32768 1 p2p
  for comm in p2p all_gather a2a; do
    GB=4 IT=3 ours cp2_${comm}_32k_gb4 32768 2 $comm
  done
fi
if part matrix; then
  # For 4 GPUs: every CP size and comm type at 32k and 64k, and CP 4 (and CP 2 p2p) at 128k.
  for seq in 32768 65536; do
    k=$(( seq / 1024 ))k
    IT=3 ours cp1_$k $seq 1 p2p
    for cp in 2 4; do
      for comm in p2p all_gather a2a; do
        IT=3 ours cp${cp}_${comm}_$k $seq $cp $comm
      done
    done
  done
  for comm in p2p all_gather a2a; do
    IT=3 ours cp4_${comm}_128k 131072 4 $comm
  done
  IT=3 ours cp2_p2p_128k 131072 2 p2p
fi
if part two; then
  # For 2 GPUs (NPROC=2): CP 2 against CP 1 (x DP 2) at 32k, each comm type, the peer, and a
  # profile of CP 2 p2p (BM_PROFILE=1: the ring's exposed communication).
  ours cp1_32k 32768 1 p2p
  ours cp2_p2p_32k 32768 2 p2p
  torch cp2_32k --cp 2 --seq 32768 "${TS[@]}"
  ours cp2_a2a_32k 32768 2 a2a
  BM_PROFILE=1 IT=3 ours cp2_p2p_32k_profile 32768 2 p2p --profile --profile-step-start 2 --profile-step-end 3 --profile-ranks 0 1
  IT=3 ours cp2_p2p_128k 131072 2 p2p
  torch cp2_32k_alltoall --cp 2 --seq 32768 --rotate alltoall "${TS[@]}"
fi
if part seq; then
  ours cp4_p2p_32k 32768 4 p2p
  ours cp2_p2p_64k 65536 2 p2p
  ours cp4_p2p_64k 65536 4 p2p
  IT=3 ours cp1_64k 65536 1 p2p
  IT=3 ours cp2_p2p_128k 131072 2 p2p
fi
if part comm; then
  ours cp2_a2a_32k 32768 2 a2a
  ours cp4_a2a_32k 32768 4 a2a
  ours cp4_ag_32k 32768 4 all_gather
  ours cp2_ag_32k 32768 2 all_gather
  torch cp2_32k_alltoall --cp 2 --seq 32768 --rotate alltoall "${TS[@]}"
  torch cp4_32k --cp 4 --seq 32768 "${TS[@]}"
fi
if part extra; then
  RC=none ours cp4_p2p_128k_norecompute 131072 4 p2p
  ours cp4_ag_8k 8192 4 all_gather
  ours cp4_p2p_8k 8192 4 p2p
  torch cp4_128k_alltoall --cp 4 --seq 131072 --rotate alltoall "${TS[@]}"
  torch cp4_128k_noac --cp 4 --seq 131072 --ac none "${TS[@]}"
fi
say "=== summary ($(( $(date +%s) - T0 )) s; $SUMMARY)"
[ -f "$SUMMARY" ] && tee -a "$LOG" < "$SUMMARY"
true
