# BENCHMARK PEER, not part of burn-megatron: PyTorch's torch.save / torch.load of the same
# model state as examples/examples/checkpoint_bench.rs saves and loads with our checkpoints, so
# that our times are always reported next to PyTorch's measured in the same device call
# (issue 16).
#
#   cargo run --release --example checkpoint_bench -- --preset gpt-1b
#   python3 bench/torch_checkpoint.py --preset gpt-1b
#   # the state on the GPU: --device cuda (and --dtype bf16) on both
#
# The state: the tensors our checkpoint stores for the same GPT, with Megatron's names and
# shapes (the vocabulary unpadded, as we store it; the output layer tied to the embedding),
# random values. What is timed, each --repeats times (the median is reported):
# - save: torch.save of the state dict to one file, then os.fsync (our save fsyncs every file);
# - load: torch.load(map_location=device, weights_only=True), then a device sync;
# - load (mmap): the same with mmap=True, each tensor then copied to the device (or touched
#   on CPU) so that every byte is read.
# Loads read the file just written, from the page cache, as ours do.

import argparse
import os
import shutil
import statistics
import time

import torch

PRESETS = {
    # name: (hidden, layers, ffn, vocab, max sequence)
    "gpt-1b": (2048, 18, 8192, 50257, 2048),
    "gpt-1.3b": (2048, 24, 8192, 50257, 2048),
    "tiny": (256, 4, 1024, 50257, 2048),
}


def state_dict(preset, dtype, device):
    """Our GPT's parameters by our paths, random, in `dtype` on `device`."""
    hidden, layers, ffn, vocab, seq = PRESETS[preset]
    shapes = {
        "embedding.weight": (vocab, hidden),
        "position_embedding": (seq, hidden),
        "block.final_norm.scale": (hidden,),
        "block.final_norm.shift": (hidden,),
    }
    for i in range(layers):
        p = f"block.layers.{i}."
        shapes.update(
            {
                p + "input_norm.scale": (hidden,),
                p + "input_norm.shift": (hidden,),
                p + "attention.qkv.weight": (hidden, 3 * hidden),
                p + "attention.qkv.bias": (3 * hidden,),
                p + "attention.output.weight": (hidden, hidden),
                p + "attention.output.bias": (hidden,),
                p + "post_attention_norm.scale": (hidden,),
                p + "post_attention_norm.shift": (hidden,),
                p + "mlp.fc1.weight": (hidden, ffn),
                p + "mlp.fc1.bias": (ffn,),
                p + "mlp.fc2.weight": (ffn, hidden),
                p + "mlp.fc2.bias": (hidden,),
            }
        )
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        name: torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        for name, shape in shapes.items()
    }


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpt-1b")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    parser.add_argument("--dir", default="/tmp/torch_checkpoint_bench")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "model.pt")
    state = state_dict(args.preset, dtype, args.device)
    sync(args.device)
    params = sum(t.numel() for t in state.values())

    saves, loads, mmap_loads = [], [], []
    try:
        for _ in range(args.repeats):
            start = time.perf_counter()
            torch.save(state, path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            saves.append(time.perf_counter() - start)

            start = time.perf_counter()
            loaded = torch.load(path, map_location=args.device, weights_only=True)
            sync(args.device)
            loads.append(time.perf_counter() - start)
            del loaded

            start = time.perf_counter()
            mapped = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            if args.device == "cpu":
                touched = {k: t.clone() for k, t in mapped.items()}
            else:
                touched = {k: t.to(args.device) for k, t in mapped.items()}
            sync(args.device)
            mmap_loads.append(time.perf_counter() - start)
            del mapped, touched
        size = os.path.getsize(path)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)

    gb = size / 1e9
    print(
        f"torch_checkpoint: {args.preset}, {params} parameters, {args.dtype} on {args.device}, "
        f"{gb:.3f} GB file, {args.repeats} repeats, torch {torch.__version__}"
    )
    for what, times in [("save", saves), ("load", loads), ("load (mmap)", mmap_loads)]:
        m = statistics.median(times)
        each = ", ".join(f"{t:.3f}" for t in times)
        print(f"  {what:<22} {m:>8.3f} s  {gb / m:>6.2f} GB/s   (each: {each})")
    print(
        f"RESULT torch params={params} bytes={size} save_s={statistics.median(saves):.4f} "
        f"load_s={statistics.median(loads):.4f} load_mmap_s={statistics.median(mmap_loads):.4f}"
    )


if __name__ == "__main__":
    main()
