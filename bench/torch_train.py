# BENCHMARK PEER, not part of burn-megatron: PyTorch's training step for the same GPT shapes
# as examples/examples/gpt_train_bench.rs, so that our step is always reported as a ratio to
# PyTorch's measured in the same device call (issue 13).
#
#   python3 bench/torch_train.py --preset gpt2-124m --batch 16 --mode compile
#   python3 bench/torch_train.py --preset gpt2-124m --batch 16 --mode eager
#   torchrun --nproc-per-node 2 bench/torch_train.py --preset gpt2-350m --batch 8   # DDP
#
# Under torchrun (WORLD_SIZE > 1) each process trains a replica on its own GPU with
# DistributedDataParallel (NCCL, default 25 MiB buckets overlapped with backward): --batch is
# the per-GPU batch, as in gpt_train_bench's --data-parallel runs, and tokens/s counts every
# GPU's tokens; TFLOP/s and MFU are per GPU. Rank 0 prints.
#
# What it runs: the same model shape (padded vocabulary, tied or untied output, LayerNorm +
# GELU + learned positions for GPT, RMSNorm + SwiGLU + RoPE + GQA for Llama), the same init
# scheme (normal, std 0.02; GPT-2's scaled std for the layers writing into the residual stream
# where our preset scales them), dropout 0, random tokens, AdamW (fused, lr 3e-4,
# weight decay 1e-4 as Burn's default; epsilon is torch's 1e-8, Burn's is 1e-5, which changes
# no timing), F.scaled_dot_product_attention (causal). Precision is
# PyTorch's usual mixed precision: f32 parameters and optimizer state, bf16 autocast. The
# step ends with loss.item() (a device sync), and the printed RESULT line has the same fields
# and the same FLOPs formula (Megatron's, see book/src/benchmarks.md) as ours.

import argparse
import math
import statistics
import time

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# Dropout on the residual stream and the embeddings (`--hidden-dropout`).
DROPOUT = 0.0

PRESETS = {
    # name: (hidden, layers, heads, query groups, ffn, vocab, default seq, kind, tied)
    "gpt2-124m": (768, 12, 12, 12, 3072, 50257, 1024, "gpt", True),
    "gpt2-350m": (1024, 24, 16, 16, 4096, 50257, 1024, "gpt", True),
    "gpt-1.3b": (2048, 24, 16, 16, 8192, 50257, 2048, "gpt", True),
    "llama-1b": (2048, 16, 32, 8, 8192, 32000, 2048, "llama", False),
}


def padded(vocab, multiple=128):
    """Megatron's padded vocabulary, as our model pads it (TP = 1)."""
    return (vocab + multiple - 1) // multiple * multiple


def training_flops(hidden, layers, heads, groups, ffn, vocab, kind, batch, seq):
    """Model FLOPs of a training step: 6·T·(l·(h(h+2·kv) + h² + 2sh + m·h·f) + h·V), which is
    Megatron's 72·B·s·l·h²·(1 + s/(6h) + V/(12lh)) for GPT."""
    h, kv, s = hidden, groups * (hidden // heads), seq
    m = 3 if kind == "llama" else 2
    layer = h * (h + 2 * kv) + h * h + 2 * s * h + m * h * ffn
    return 6.0 * batch * seq * (layers * layer + h * padded(vocab))


class Rope(nn.Module):
    """Rotary embeddings on [batch, heads, seq, head_dim] (pairs of halves, as Llama's HF code)."""

    def __init__(self, head_dim, seq, base):
        super().__init__()
        inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        s = x.shape[-2]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos[:s].to(x.dtype) + rotated * self.sin[:s].to(x.dtype)


class Block(nn.Module):
    def __init__(self, hidden, heads, groups, ffn, kind, seq):
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, hidden // heads
        llama = kind == "llama"
        norm = (lambda: nn.RMSNorm(hidden, eps=1e-5)) if llama else (lambda: nn.LayerNorm(hidden))
        bias = not llama
        self.norm1, self.norm2 = norm(), norm()
        self.qkv = nn.Linear(hidden, hidden + 2 * groups * self.head_dim, bias=bias)
        self.proj = nn.Linear(hidden, hidden, bias=bias)
        self.up = nn.Linear(hidden, ffn, bias=bias)
        self.gate = nn.Linear(hidden, ffn, bias=bias) if llama else None
        self.down = nn.Linear(ffn, hidden, bias=bias)
        self.rope = Rope(self.head_dim, seq, 500000.0) if llama else None

    def forward(self, x):
        b, s, h = x.shape
        d, kv = self.head_dim, self.groups * self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([h, kv, kv], dim=-1)
        q = q.view(b, s, self.heads, d).transpose(1, 2)
        k = k.view(b, s, self.groups, d).transpose(1, 2)
        v = v.view(b, s, self.groups, d).transpose(1, 2)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.groups != self.heads
        )
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, s, h)), DROPOUT, self.training)
        z = self.norm2(x)
        z = F.silu(self.gate(z)) * self.up(z) if self.gate is not None else F.gelu(self.up(z))
        return x + F.dropout(self.down(z), DROPOUT, self.training)


class Gpt(nn.Module):
    def __init__(self, hidden, layers, heads, groups, ffn, vocab, seq, positions, kind, tied):
        super().__init__()
        self.vocab = padded(vocab)
        self.embedding = nn.Embedding(self.vocab, hidden)
        # Our GPT's learned table is the preset's longest sequence (or `seq`, if longer).
        self.positions = nn.Embedding(positions, hidden) if kind == "gpt" else None
        self.layers = nn.ModuleList(
            Block(hidden, heads, groups, ffn, kind, seq) for _ in range(layers)
        )
        self.final_norm = nn.RMSNorm(hidden, eps=1e-5) if kind == "llama" else nn.LayerNorm(hidden)
        self.output = None if tied else nn.Linear(hidden, self.vocab, bias=False)
        std = 0.02
        # GPT-2 (and our GPT presets) scale the residual-writing layers; our Llama preset does not.
        scaled = std / math.sqrt(2 * layers) if kind == "gpt" else std
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p) if "norm" in name and name.endswith("weight") else nn.init.zeros_(p)
            elif name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=scaled)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens, targets):
        x = self.embedding(tokens)
        if self.positions is not None:
            x = x + self.positions.weight[: tokens.shape[1]]
        x = F.dropout(x, DROPOUT, self.training)
        for layer in self.layers:
            x = layer(x)
        x = self.final_norm(x)
        table = self.embedding.weight if self.output is None else self.output.weight
        logits = F.linear(x, table)
        return F.cross_entropy(logits.float().view(-1, self.vocab), targets.view(-1))


def peak_flops(name, dtype, given):
    if given:
        return given * 1e12
    if ("H100" in name and "PCIe" not in name) or "H200" in name:
        bf16 = 989.4e12
    elif "H100" in name:
        bf16 = 756.0e12
    else:
        return float("nan")
    return bf16 if dtype == "bf16" else bf16 / 2


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", choices=PRESETS, default="gpt2-124m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    parser.add_argument("--mode", choices=["compile", "eager"], default="compile")
    parser.add_argument("--hidden-dropout", type=float, default=0.0,
                        help="dropout on the residual stream (attention dropout stays 0)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--device", default="cuda", help="cpu only checks the script runs")
    parser.add_argument("--fp8", action="store_true",
                        help="float8 GEMMs in the blocks (bench/torch_float8.py: torchao's recipe)")
    args = parser.parse_args()
    global DROPOUT
    DROPOUT = args.hidden_dropout

    hidden, layers, heads, groups, ffn, vocab, default_seq, kind, tied = PRESETS[args.preset]
    seq = args.seq or default_seq
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = torch.device(args.device)
    if world > 1:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    cuda = device.type == "cuda"
    positions = max(seq, default_seq)
    model = Gpt(hidden, layers, heads, groups, ffn, vocab, seq, positions, kind, tied).to(device)
    params = sum(p.numel() for p in model.parameters())
    fp8 = ""
    if args.fp8:
        import torch_float8

        fp8 = "-" + torch_float8.convert(model, model.layers)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4, fused=cuda)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    forward = torch.compile(model) if args.mode == "compile" else model
    # Each replica reads its own batches.
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
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = forward(tokens, targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        value = loss.item()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, value

    start = time.perf_counter()
    first_loss = step(0)[1]
    for i in range(1, args.warmup):
        step(i)
    warmup = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], float("nan")
    for i in range(args.steps):
        elapsed, loss = step(args.warmup + i)
        times.append(elapsed)

    if world > 1:
        dist.destroy_process_group()
        if rank != 0:
            return
    step_ms = statistics.median(times) * 1e3
    tokens = args.batch * seq * world
    flops = training_flops(hidden, layers, heads, groups, ffn, vocab, kind, args.batch * world, seq)
    tflops = flops / (step_ms / 1e3) / 1e12 / world
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    mfu = flops / (step_ms / 1e3) / peak_flops(gpu, args.dtype, args.peak_tflops) / world
    alloc = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if cuda else float("nan")
    impl = f"torch-{args.mode}" + ("-ddp" if world > 1 else "") + fp8
    print(
        f"torch_train: {args.preset} ({params / 1e6:.1f}M params, f32 master weights, "
        f"{args.dtype} autocast), batch {args.batch} x seq {seq}, {impl}, torch "
        f"{torch.__version__} on {gpu}"
    )
    print(
        f"  warm-up: {args.warmup} steps in {warmup:.1f} s (first loss {first_loss:.4f}); "
        f"measured: {args.steps} steps, loss now {loss:.4f}"
    )
    print(
        f"  step: median {step_ms:.2f} ms (min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}); "
        f"{tokens / (step_ms / 1e3):.0f} tokens/s on {world} GPU(s); {tflops:.1f} TFLOP/s per GPU "
        f"({flops:.3e} model FLOPs per step); MFU {100 * mfu:.1f}%"
    )
    print(f"  memory: {alloc:.2f} GiB allocated at most, {reserved:.2f} GiB reserved at most")
    print(
        f"RESULT impl={impl} preset={args.preset} batch={args.batch} seq={seq} dtype={args.dtype} "
        f"recompute=none hidden_dropout={args.hidden_dropout} dp={world} params={params} step_ms={step_ms:.2f} tok_s={tokens / (step_ms / 1e3):.0f} "
        f"tflops={tflops:.1f} mfu={mfu:.4f} mem_alloc_gib={alloc:.2f} mem_reserved_gib={reserved:.2f} "
        f"loss={loss:.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
