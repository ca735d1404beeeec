#!/usr/bin/env bash
# Build CUDA-enabled binaries on this (CPU-only) machine and pack them into .gpu/
# so that a GPU machine, which has the CUDA driver, NVRTC and NCCL but no Rust
# toolchain, can run them.
#
#   bench/pack_gpu.sh build --release --features cuda --example gpt_bench
#   bench/pack_gpu.sh test  --release --features cuda --test gpu
#
# The first word is the cargo verb (build or test); the rest goes to cargo.
# Every executable cargo reports is stripped into .gpu/bin/, .gpu/env.sh is
# written next to it, and .gpu/ is added to .git/info/exclude.
# On the GPU machine (carry [".gpu"]):  source .gpu/env.sh && .gpu/bin/NAME
set -euo pipefail
verb=${1:?usage: pack build|test CARGO_ARGS...}; shift
top=$(git rev-parse --show-toplevel); cd "$top"
mkdir -p .git/info .gpu/bin
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
case "$verb" in
  build) cmd=(cargo build --message-format=json-render-diagnostics "$@") ;;
  test)  cmd=(cargo test --no-run --message-format=json-render-diagnostics "$@") ;;
  *) echo "pack: first word must be build or test" >&2; exit 2 ;;
esac
"${cmd[@]}" > .gpu/cargo.json
python3 - <<'PY'
import json, os, shutil, subprocess
seen = []
for line in open('.gpu/cargo.json'):
    try: m = json.loads(line)
    except ValueError: continue
    exe = m.get('executable') if m.get('reason') == 'compiler-artifact' else None
    if exe:
        name = m['target']['name']
        dst = os.path.join('.gpu/bin', name)
        subprocess.run(['strip', '-o', dst, exe], check=True)
        seen.append((name, os.path.getsize(dst)))
for n, s in seen: print(f"packed .gpu/bin/{n}  {s/2**20:.1f} MiB")
if not seen: print("pack: cargo reported no executable")
PY
rm -f .gpu/cargo.json
cat > .gpu/env.sh <<'ENV'
# Sourced on the GPU machine: lets cudarc find NCCL and NVRTC, and keeps NVLink multicast off.
nccl=$(ls -d /opt/*/.venv/lib/python3*/site-packages/nvidia/nccl/lib 2>/dev/null | head -1)
[ -n "$nccl" ] || nccl=$(python3 -c 'import nvidia.nccl,os;print(list(nvidia.nccl.__path__)[0]+"/lib")' 2>/dev/null)
export LD_LIBRARY_PATH="$nccl:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export CUDA_PATH=/usr/local/cuda
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ENV
du -sh .gpu | awk '{print "pack: .gpu holds " $1 " (a device call carries 64 MiB at most)"}'
