# BENCHMARK PEER, not part of burn-megatron: PyTorch's multi-GPU training step for the 7-8B
# shapes of examples/configs (issue 31), run in the same device call as pretrain_gpt so that
# our step is reported as a ratio to it.
#
#   torchrun --nproc-per-node 4 bench/torch_fsdp.py --preset llama3-8b --batch 1
#   torchrun --nproc-per-node 4 bench/torch_fsdp.py --preset gpt3-6.7b --batch 2
#
# torchtitan's recipe: FSDP2 (`fully_shard` on every block and on the root, bf16 parameters
# with fp32 gradient reduction), `torch.compile` per block, SDPA (flash), fused AdamW on fp32
# sharded master weights. Every GPU reads --batch samples a step: tokens/s counts every GPU's.
# (PyTorch's DTensor tensor parallelism as a second peer is not written yet.)
#
# The model is bench/torch_train.py's (the same shapes, init and FLOPs formula as ours), built
# on the meta device and materialised shard by shard. The printed RESULT line has
# gpt_train_bench's fields.

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_train
from torch_train import Gpt, Rope, padded, peak_flops, training_flops

PRESETS = {
    # name: (hidden, layers, heads, query groups, ffn, vocab, seq, kind, tied)
    "llama3-8b": (4096, 32, 32, 8, 14336, 128256, 4096, "llama", False),
    "gpt3-6.7b": (4096, 32, 32, 32, 16384, 50257, 2048, "gpt", True),
    "llama-1b": (2048, 16, 32, 8, 8192, 128256, 2048, "llama", False),
}


def init_weights(model, layers, kind, seq):
    """torch_train.Gpt's initialisation, for a model materialised from the meta device."""
    std = 0.02
    scaled = std / (2 * layers) ** 0.5 if kind == "gpt" else std
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if p.dim() == 1:
                if "norm" in name and name.endswith("weight"):
                    local.fill_(1.0)
                else:
                    local.zero_()
            elif name.endswith(("proj.weight", "down.weight")):
                local.normal_(std=scaled)
            else:
                local.normal_(std=std)
        for module in model.modules():
            if isinstance(module, Rope):
                fresh = Rope(module.cos.shape[-1], module.cos.shape[0], 500000.0)
                module.cos.copy_(fresh.cos)
                module.sin.copy_(fresh.sin)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", choices=PRESETS, default="llama3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--layers", type=int, help="the preset's shape with fewer layers")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--fp8", action="store_true",
                        help="float8 GEMMs in the blocks (bench/torch_float8.py: torchao's recipe)")
    args = parser.parse_args()

    hidden, layers, heads, groups, ffn, vocab, default_seq, kind, tied = PRESETS[args.preset]
    seq = args.seq or default_seq
    layers = args.layers or layers
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(1234)
    torch_train.DROPOUT = 0.0
    start = time.perf_counter()
    with torch.device("meta"):
        model = Gpt(hidden, layers, heads, groups, ffn, vocab, seq, seq, kind, tied)
    params = sum(p.numel() for p in model.parameters())
    fp8 = ""
    if args.fp8:
        import torch_float8

        fp8 = "-" + torch_float8.convert(model, model.layers)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        if not args.no_compile:
            block = torch.compile(block)
            model.layers[i] = block
        # The last block's parameters are needed at once by the backward pass.
        fully_shard(block, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    init_weights(model, layers, kind, seq)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    setup = time.perf_counter() - start
    torch.manual_seed(1234 + rank)
    batches = [
        (
            torch.randint(0, vocab, (args.batch, seq), device=device),
            torch.randint(0, vocab, (args.batch, seq), device=device),
        )
        for _ in range(4)
    ]

    def step(i):
        tokens, targets = batches[i % len(batches)]
        begin = time.perf_counter()
        loss = model(tokens, targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        value = loss.item()
        torch.cuda.synchronize()
        return time.perf_counter() - begin, value

    begin = time.perf_counter()
    first_loss = step(0)[1]
    for i in range(1, args.warmup):
        step(i)
    warmup = time.perf_counter() - begin
    torch.cuda.reset_peak_memory_stats()
    times, loss = [], float("nan")
    for i in range(args.steps):
        elapsed, loss = step(args.warmup + i)
        times.append(elapsed)
    alloc = torch.cuda.max_memory_allocated(device) / 2**30
    reserved = torch.cuda.max_memory_reserved(device) / 2**30
    dist.destroy_process_group()
    if rank != 0:
        return
    step_ms = statistics.median(times) * 1e3
    samples = args.batch * world
    tokens = samples * seq
    flops = training_flops(hidden, layers, heads, groups, ffn, vocab, kind, samples, seq)
    tflops = flops / (step_ms / 1e3) / 1e12 / world
    gpu = torch.cuda.get_device_name(device)
    mfu = flops / (step_ms / 1e3) / peak_flops(gpu, "bf16", args.peak_tflops) / world
    impl = "torch-fsdp2" + ("" if args.no_compile else "-compile") + fp8
    print(
        f"torch_fsdp: {args.preset} ({params / 1e9:.2f}B params, padded vocabulary "
        f"{padded(vocab)}), {samples} samples x seq {seq} a step, {impl} on {world} x {gpu}, "
        f"torch {torch.__version__}; set-up {setup:.1f} s"
    )
    print(
        f"  warm-up: {args.warmup} steps in {warmup:.1f} s (first loss {first_loss:.4f}); "
        f"measured: {args.steps} steps, loss now {loss:.4f}"
    )
    print(
        f"  step: median {step_ms:.1f} ms (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}); "
        f"{tokens / (step_ms / 1e3):.0f} tokens/s on {world} GPUs; {tflops:.1f} TFLOP/s per GPU; "
        f"MFU {100 * mfu:.1f}%; memory {alloc:.1f} GiB allocated, {reserved:.1f} GiB reserved at most"
    )
    print(
        f"RESULT impl={impl} preset={args.preset} batch={samples} seq={seq} dtype=bf16 "
        f"world={world} params={params} step_ms={step_ms:.1f} tok_s={tokens / (step_ms / 1e3):.0f} "
        f"tflops={tflops:.1f} mfu={mfu:.4f} mem_alloc_gib={alloc:.1f} "
        f"mem_reserved_gib={reserved:.1f} setup_s={setup:.1f} loss={loss:.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
