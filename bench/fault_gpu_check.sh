#!/usr/bin/env bash
# A rank killed with SIGKILL on 4 GPUs (issue 32), in one device call (kind nvidia-h100-x4 or
# nvidia-h200-x4): `bm-launch --nproc-per-node 4 -- pretrain_gpt`, a GPT-2 124M-sized model at
# TP 2 x DP 2 in bf16 (the fast settings: --collective-checks false), checkpoints every SAVE
# iterations to a temporary directory.
#   whole    the uninterrupted run: the losses to compare with.
#   a        rank VICTIM is killed (kill -9) mid-step after iteration KILL_A: every other rank
#            must end by itself within 30 s (bm-launch gets --grace-secs 60, so it kills no one),
#            each with an error naming the dead rank, none with a panic.
#   b        the same run under `--max-restarts 1 --save D --load D`, rank VICTIM killed after
#            the checkpoint at SAVE is published and iteration KILL_B logged: bm-launch restarts
#            every rank, the run resumes from that checkpoint and finishes, and every loss it
#            logged (before the kill, and the repeated iterations after the resume) equals the
#            uninterrupted run's at the log's 4 decimals (TOL: allowed difference, default 0).
# Each rank's output goes to its own file (rank{R}.attempt{A}.log, through a wrapper); every log
# is kept under $OUT (the checkpoints are not). Prints PASS/FAIL lines (also in $OUT/fault.log);
# exits 1 if any check failed.
#
# On the device machine, packed under .gpu/ (bench/pack_gpu.sh):
#   bin/{pretrain_gpt,bm-launch}   bench/pack_gpu.sh build --release --features cuda
#       -p burn-megatron-examples --example pretrain_gpt, and -p burn-megatron-dist --bin bm-launch
#   bash bench/fault_gpu_check.sh
# On the CPU (process ranks, a tiny model; checks the script itself), after
# `cargo build -p burn-megatron-examples --example pretrain_gpt` and
# `cargo build -p burn-megatron-dist --bin bm-launch`:
#   OUT=/tmp/fault bash bench/fault_gpu_check.sh --cpu            (BIN=target/debug by default)
# Settings (environment): BIN, DEVICE=gpu|cpu, ITERS, SAVE, KILL_A, KILL_B, VICTIM, TOL, LIMIT,
# PORT, CHECKS (--collective-checks: false on GPUs by default), PART=a|b|all.
set -u
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-gpu}
for arg in "$@"; do
  case "$arg" in
    --cpu) DEVICE=cpu ;;
    --gpu) DEVICE=gpu ;;
    *) echo "usage: bash bench/fault_gpu_check.sh [--cpu|--gpu]" >&2; exit 2 ;;
  esac
done
if [ -z "${OUT:-}" ]; then OUT=$(mktemp -d); echo "logs in $OUT"; fi
mkdir -p "$OUT"
if [ "$DEVICE" = gpu ]; then
  source .gpu/env.sh
  for z in .gpu/bin/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done 2>/dev/null
  chmod +x .gpu/bin/* 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
  BIN=${BIN:-.gpu/bin}
  MODEL="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --vocab-size 50304
         --micro-batch-size 4 --global-batch-size 16 --bf16 --collective-checks ${CHECKS:-false}"
  ITERS=${ITERS:-30} SAVE=${SAVE:-10} KILL_A=${KILL_A:-6} KILL_B=${KILL_B:-14}
else
  BIN=${BIN:-target/debug}
  MODEL="--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32
         --micro-batch-size 2 --global-batch-size 8 --collective-checks ${CHECKS:-true}"
  ITERS=${ITERS:-40} SAVE=${SAVE:-10} KILL_A=${KILL_A:-6} KILL_B=${KILL_B:-14}
fi
LAUNCH=$BIN/bm-launch
PRETRAIN=$BIN/pretrain_gpt
[ -x "$PRETRAIN" ] || PRETRAIN=$BIN/examples/pretrain_gpt
for b in "$LAUNCH" "$PRETRAIN"; do
  [ -x "$b" ] || { echo "FAIL setup: $b is missing" | tee -a "$OUT/fault.log"; exit 1; }
done
LAUNCH=$(realpath "$LAUNCH") PRETRAIN=$(realpath "$PRETRAIN")
VICTIM=${VICTIM:-3} TOL=${TOL:-0} LIMIT=${LIMIT:-240} PORT=${PORT:-29640}
ARGS="$MODEL --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --data-parallel-size 2
      --train-iters $ITERS --lr-warmup-iters 2 --eval-interval 0 --log-interval 1 --save-interval $SAVE"
part() { [ "${PART:-all}" = all ] || [ "${PART:-all}" = "$1" ]; }
CK=$(mktemp -d)
WRAP=$(mktemp)
trap 'rm -rf "$CK" "$WRAP"' EXIT
# bm-launch starts this for each rank: the rank's output to its own file, one per attempt.
cat > "$WRAP" <<'EOF'
#!/usr/bin/env bash
exec "$@" > "$LOGDIR/rank${RANK}.attempt${BM_RESTART_COUNT:-0}.log" 2>&1
EOF
chmod +x "$WRAP"

failed=0
report() { # PASS|FAIL, check, message
  echo "$1 $2: $3" | tee -a "$OUT/fault.log"
  [ "$1" = PASS ] || failed=1
}
now() { date +%s.%N; }
# "iteration loss" of every loss line of the given logs, sorted, repeated equal lines merged.
losses() {
  cat "$@" 2>/dev/null | awk '/^ iteration / { split($2, it, "/"); for (i = 1; i <= NF; i++) if ($i == "loss" && $(i - 1) != "lm") print it[1], $(i + 1) }' | sort -n -k1,1 | uniq
}
# Starts bm-launch in the background (its pid in $launcher): name, port, bm-launch's options
# (one word list), pretrain_gpt's options beyond $ARGS and --save.
start() {
  local name=$1 port=$2 opts=$3 extra=$4
  launch_port=$port
  mkdir -p "$OUT/$name"
  echo "=== $name: bm-launch --nproc-per-node 4 --master-port $port $opts -- pretrain_gpt $(echo $ARGS) --save $CK/$name $extra" | tee -a "$OUT/fault.log"
  LOGDIR="$OUT/$name" timeout "$LIMIT" "$LAUNCH" --nproc-per-node 4 --master-port "$port" $opts -- \
    "$WRAP" "$PRETRAIN" $ARGS --save "$CK/$name" $extra > "$OUT/$name/launch.log" 2>&1 &
  launcher=$!
}
# The pid of rank VICTIM of the running launch: the process whose environment has
# RANK=VICTIM and this launch's MASTER_PORT (read from /proc; no procps needed).
victim_pid() {
  local p env
  for p in /proc/[0-9]*; do
    env=$(tr '\0' '\n' < "$p/environ" 2>/dev/null) || continue
    if grep -qx "RANK=$VICTIM" <<< "$env" && grep -qx "MASTER_PORT=$launch_port" <<< "$env" &&
       grep -q pretrain_gpt "$p/cmdline" 2>/dev/null; then
      echo "${p#/proc/}"
      return 0
    fi
  done
  return 1
}
# Waits until iteration $1 is logged in attempt $2's logs of run $3 (and file $4 exists, if
# given); false if the run ends first.
wait_for() {
  local it=$1 attempt=$2 name=$3 file=${4:-}
  until cat "$OUT/$name"/rank*.attempt"$attempt".log 2>/dev/null | grep -qE "^ iteration +$it/" &&
        { [ -z "$file" ] || [ -e "$file" ]; }; do
    kill -0 "$launcher" 2>/dev/null || return 1
    sleep 0.05
  done
}
# Kills rank VICTIM some tenths of a second after the wait, so that it dies inside a step.
kill_victim() {
  local pid
  sleep "0.$((RANDOM % 10))"
  pid=$(victim_pid) || return 1
  kill -9 "$pid" || return 1
  killed_at=$(now)
  echo "killed rank $VICTIM (pid $pid) at $(date -u +%T.%N | cut -c1-12)" | tee -a "$OUT/fault.log"
}

# The uninterrupted run.
start whole "$PORT" "" ""
wait "$launcher"; rc=$?
losses "$OUT/whole"/rank*.attempt0.log > "$OUT/whole/losses"
n=$(wc -l < "$OUT/whole/losses")
if [ "$rc" -eq 0 ] && [ "$n" -eq "$ITERS" ]; then
  report PASS whole "$n iterations, last: $(tail -1 "$OUT/whole/losses")"
else
  report FAIL whole "rc=$rc, $n of $ITERS iterations logged; see $OUT/whole"
  tail -20 "$OUT/whole"/*.log
  exit 1
fi

if part a; then
  start a $((PORT + 1)) "--grace-secs 60" ""
  if wait_for "$KILL_A" 0 a && kill_victim; then
    wait "$launcher"; rc=$?
    took=$(awk -v a="$killed_at" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }')
    echo "bm-launch rc=$rc, $took s after the kill" | tee -a "$OUT/fault.log"
    if awk -v t="$took" 'BEGIN { exit !(t <= 30) }' && [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then
      report PASS a-ended "every rank ended $took s after rank $VICTIM was killed"
    else
      report FAIL a-ended "the ranks ended $took s after the kill (rc=$rc; 124: timeout)"
    fi
    for r in 0 1 2 3; do
      [ "$r" = "$VICTIM" ] && continue
      log="$OUT/a/rank$r.attempt0.log"
      status=$(grep -E "^bm-launch: +rank $r: " "$OUT/a/launch.log" | sed 's/^bm-launch: *//')
      # "rank 3 failed", "because rank 3 failed", or a list: "ranks [1, 3] finished ...".
      named=$(grep -vE "^ iteration |^ saved checkpoint" "$log" |
        grep -E "rank $VICTIM([^0-9]|$)|ranks \[([0-9]+, )*$VICTIM[],]" | head -1 | cut -c1-300)
      if [ -n "$named" ] && echo "$status" | grep -q "exit status"; then
        report PASS "a-rank$r" "$status; its error: $named"
      else
        report FAIL "a-rank$r" "${status:-no status}; no error naming rank $VICTIM (last lines: $(tail -3 "$log" | tr '\n' ' ' | cut -c1-300))"
      fi
      if grep -q "panicked" "$log"; then
        report FAIL "a-rank$r-typed" "a panic instead of a typed error: $(grep -m1 -A1 panicked "$log" | tr '\n' ' ' | cut -c1-300)"
      fi
    done
  else
    report FAIL a "the run ended before iteration $KILL_A, or rank $VICTIM was not found"
    wait "$launcher"
  fi
fi

if part b; then
  ck=$CK/b/$(printf 'iter_%07d' "$SAVE")/metadata.json
  start b $((PORT + 2)) "--max-restarts 1" "--load $CK/b"
  if wait_for "$KILL_B" 0 b "$ck" && kill_victim; then
    wait "$launcher"; rc=$?
    restarts=$(grep -c "restarting all" "$OUT/b/launch.log")
    resumed=$(grep -h "resumed from" "$OUT/b"/rank*.attempt1.log 2>/dev/null | head -1 | cut -c1-300)
    losses "$OUT/b"/rank*.attempt0.log > "$OUT/b/losses.attempt0"
    losses "$OUT/b"/rank*.attempt1.log > "$OUT/b/losses.attempt1"
    first=$(head -1 "$OUT/b/losses.attempt1" | cut -d' ' -f1)
    if [ "$rc" -eq 0 ] && [ "$restarts" -eq 1 ] && [ -n "$resumed" ] && [ "${first:-0}" -gt 1 ]; then
      report PASS b-restart "one restart, the second attempt resumed at iteration $first: $resumed"
    else
      report FAIL b-restart "rc=$rc, $restarts restarts, first iteration after the restart: ${first:-none}, resumed: ${resumed:-no}"
    fi
    awk 'FNR == 1 { f++ } { v[f, $1] = $2; if (f == 1) its[++n] = $1 }
      END { print "iteration uninterrupted attempt0 attempt1"
            for (i = 1; i <= n; i++) { k = its[i]
              print k, v[1, k], ((2, k) in v ? v[2, k] : "-"), ((3, k) in v ? v[3, k] : "-") } }' \
      "$OUT/whole/losses" "$OUT/b/losses.attempt0" "$OUT/b/losses.attempt1" > "$OUT/b/compare"
    cat "$OUT/b/compare"
    # Every iteration logged by either attempt, the ones repeated after the resume included,
    # against the uninterrupted run; and every iteration logged at least once.
    verdict=$(awk -v tol="$TOL" -v iters="$ITERS" 'NR > 1 {
        for (c = 3; c <= 4; c++) if ($c != "-") {
          seen[$1] = 1; d = $c - $2; if (d < 0) d = -d; if (d > max) max = d
          if ($c != $2) exact = exact " " $1
          if (d > tol) bad = bad " " $1
        }
      } END {
        n = 0; for (i in seen) n++
        printf "%s|%d|%g|%s|%s\n", (bad == "" && n == iters) ? "ok" : "bad", n, max, exact, bad
      }' "$OUT/b/compare")
    IFS='|' read -r ok n max exact bad <<< "$verdict"
    # GPU kernels with atomics (attention's backward) may differ in the last bits: say how far.
    echo "INFO b-losses: largest difference $max; within 1e-3: $(awk -v m="$max" 'BEGIN { print (m <= 0.001) ? "yes" : "no" }')" | tee -a "$OUT/fault.log"
    if [ "$ok" = ok ]; then
      report PASS b-losses "$n of $ITERS iterations logged, largest difference $max (TOL $TOL); not bit-equal at 4 decimals:${exact:- none}"
    else
      report FAIL b-losses "$n of $ITERS iterations logged, largest difference $max (TOL $TOL); beyond TOL at:${bad:- none}"
    fi
  else
    report FAIL b "the run ended before iteration $KILL_B and the checkpoint at $SAVE, or rank $VICTIM was not found"
    wait "$launcher"
  fi
fi

[ "$failed" = 0 ] && echo "fault_gpu_check: every check passed" | tee -a "$OUT/fault.log"
exit "$failed"
