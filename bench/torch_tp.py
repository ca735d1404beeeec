# BENCHMARK PEER, not part of burn-megatron: PyTorch's own tensor parallelism (DTensor,
# `torch.distributed.tensor.parallel`) with sequence parallelism for the Llama shapes of
# examples/configs (issue 31), run in the same device call as pretrain_gpt's TP layouts.
#
#   torchrun --nproc-per-node 4 bench/torch_tp.py --preset llama3-8b --batch 1
#
# torchtitan's TP plan: the embedding row-parallel with a sequence-sharded output, each norm
# sequence-parallel, wq/wk/wv and the MLP's gate/up column-parallel, wo and down row-parallel
# back to sequence shards, the output layer column-parallel with a vocabulary-parallel loss
# (`loss_parallel`); `torch.compile` per block after the plan; bf16 autocast over fp32
# parameters (fp32 master weights), fused AdamW. Every rank of the TP group reads the same
# --batch samples, --accum times a step (gradient accumulation, as pretrain_gpt's global
# batch): tokens/s counts them once. Llama presets only (the GPT ones tie and add learned
# positions, which this plan does not cover). The RESULT line has torch_fsdp's fields.

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch_fsdp import PRESETS
from torch_train import Rope, padded, peak_flops, training_flops


class Attention(nn.Module):
    def __init__(self, hidden, heads, groups, seq):
        super().__init__()
        self.head_dim = d = hidden // heads
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, groups * d, bias=False)
        self.wv = nn.Linear(hidden, groups * d, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.rope = Rope(d, seq, 500000.0)

    def forward(self, x):
        b, s, _ = x.shape
        d = self.head_dim
        # Column-parallel outputs are this rank's heads.
        q = self.wq(x).view(b, s, -1, d).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, d).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, d).transpose(1, 2)
        q, k = self.rope(q), self.rope(k)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
        )
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, hidden, heads, groups, ffn, seq):
        super().__init__()
        self.attention_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.attention = Attention(hidden, heads, groups, seq)
        self.ffn_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.feed_forward = FeedForward(hidden, ffn)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, hidden, layers, heads, groups, ffn, vocab, seq):
        super().__init__()
        self.embedding = nn.Embedding(padded(vocab), hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, groups, ffn, seq) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.output = nn.Linear(hidden, padded(vocab), bias=False)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def apply_tp(model, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        mesh,
        {
            "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.gate": ColwiseParallel(),
                "feed_forward.up": ColwiseParallel(),
                "feed_forward.down": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", choices=[p for p in PRESETS if PRESETS[p][7] == "llama"],
                        default="llama3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--layers", type=int, help="the preset's shape with fewer layers")
    parser.add_argument("--accum", type=int, default=1,
                        help="microbatches of --batch samples per optimizer step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float)
    args = parser.parse_args()

    hidden, layers, heads, groups, ffn, vocab, default_seq, kind, _ = PRESETS[args.preset]
    seq = args.seq or default_seq
    layers = args.layers or layers
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cuda", (world,))
    start = time.perf_counter()
    torch.manual_seed(1234)
    with torch.device("meta"):
        model = Llama(hidden, layers, heads, groups, ffn, vocab, seq)
    params = sum(p.numel() for p in model.parameters())
    apply_tp(model, mesh)
    if not args.no_compile:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.fill_(1.0) if p.dim() == 1 else local.normal_(std=0.02)
        for module in model.modules():
            if isinstance(module, Rope):
                fresh = Rope(module.cos.shape[-1], module.cos.shape[0], 500000.0)
                module.cos.copy_(fresh.cos)
                module.sin.copy_(fresh.sin)
    try:
        optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    except (RuntimeError, ValueError):
        optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    setup = time.perf_counter() - start
    # The same samples on every rank of the TP group.
    torch.manual_seed(1234)
    batches = [
        (
            torch.randint(0, vocab, (args.batch, seq), device=device),
            torch.randint(0, vocab, (args.batch, seq), device=device),
        )
        for _ in range(4)
    ]

    def step(i):
        begin = time.perf_counter()
        for j in range(args.accum):
            tokens, targets = batches[(i * args.accum + j) % len(batches)]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens)
            with loss_parallel():
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
                (loss / args.accum).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        value = loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
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
    samples = args.batch * args.accum
    tokens = samples * seq
    flops = training_flops(hidden, layers, heads, groups, ffn, vocab, kind, samples, seq)
    tflops = flops / (step_ms / 1e3) / 1e12 / world
    gpu = torch.cuda.get_device_name(device)
    mfu = flops / (step_ms / 1e3) / peak_flops(gpu, "bf16", args.peak_tflops) / world
    impl = "torch-dtensor-tp-sp" + ("" if args.no_compile else "-compile")
    print(
        f"torch_tp: {args.preset} ({params / 1e9:.2f}B params), {samples} samples x seq {seq} "
        f"a step, {impl} (TP {world}) on {world} x {gpu}, torch {torch.__version__}; "
        f"set-up {setup:.1f} s"
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
