# BENCHMARK PEER, not part of burn-megatron: a PyTorch mixture of experts with expert
# parallelism (issue 34) on the models of examples/configs/mixtral_1b_moe.toml and
# deepseek_moe_1b.toml, run in the same device call as pretrain_gpt --num-experts
# (bench/moe_gpu_check.sh), so that our step is reported as a ratio to it.
#
#   torchrun --nproc-per-node 4 bench/torch_moe.py --preset mixtral --ep 4
#   torchrun --nproc-per-node 4 bench/torch_moe.py --preset mixtral --ep 2     # EP 2 x expert-DP 2
#   torchrun --nproc-per-node 4 bench/torch_moe.py --preset deepseek --ep 4
#   torchrun --nproc-per-node 2 bench/torch_moe.py --device cpu --tiny --ep 2  # gloo smoke test
#   ... --force-balance   # random logits, an even load (Megatron's --moe-router-force-load-balancing)
#
# What it does, as Megatron's MoE does it and as ours does:
# - the router: a linear layer to one logit per expert, softmax (Mixtral) or sigmoid with
#   normalised top-k weights and DeepSeek-V3's expert bias (added for the choice only, moved by
#   sign(mean load - load) after each step), the Switch load-balancing loss; dropless;
# - dispatch: the (token, choice) assignments sorted by expert on the GPU (a stable argsort),
#   the counts per expert exchanged, then the tokens by `torch.distributed.all_to_all_single`
#   with variable splits over the EP group (an autograd function, the reverse exchange in the
#   backward pass), regrouped by local expert;
# - experts: SwiGLU, weights stacked [local experts, ...], computed with `torch._grouped_mm`
#   (one kernel per projection); where it is missing (or on the CPU) a loop over the experts,
#   and the RESULT line says impl=loop;
# - the rest: plain DDP for the non-expert parameters (over all ranks); the expert gradients
#   averaged over the expert-data-parallel group (ranks holding the same experts) by hand;
#   `torch.compile` on each layer's attention block (the MoE has data-dependent shapes and
#   host reads of the split sizes; it runs eager), --no-compile for all eager; bf16 parameters
#   and activations (fp32 on the CPU), fused AdamW; SDPA (flash) with K/V heads repeated.
#
# Each rank reads --micro-batch sequences of --seq tokens per micro-batch, --grad-accum
# micro-batches a step. tokens/s counts every rank's tokens; TFLOP/s and MFU are per GPU and
# count active FLOPs as pretrain_gpt does (Megatron's count: 6 per multiply-add of a token
# through attention, QKᵀ and PV in full, the router, top-k experts, the shared expert and the
# output layer; recomputation not counted).
# The summary line: RESULT tok_s=.. tflops=.. mfu=.. mem_alloc_gib=.. mem_reserved_gib=..
# impl=grouped_mm|loop compile=0|1 ep=.. edp=..

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    # hidden, layers, heads, groups, vocab, experts, top-k, expert ffn, shared ffn, score, bias
    "mixtral": dict(h=2048, l=16, heads=16, groups=4, vocab=32000, e=8, k=2, f=5632, fs=0,
                    score="softmax", bias=False, aux=0.01, rope=1e6),
    "deepseek": dict(h=2048, l=16, heads=16, groups=4, vocab=32000, e=64, k=6, f=1408, fs=2816,
                     score="sigmoid", bias=True, aux=1e-4, rope=1e4),
}
TINY = dict(h=64, l=2, heads=4, groups=2, vocab=512, f=32, fs=64)


def log(*a):
    if dist.get_rank() == 0:
        print("torch_moe:", *a, flush=True)


def padded(vocab, multiple=128):
    return (vocab + multiple - 1) // multiple * multiple


def training_flops(c, tokens, seq):
    """Active model FLOPs of a step (pretrain_gpt's count for MoE, see transformer/flops.rs)."""
    h, kv = c["h"], c["groups"] * (c["h"] // c["heads"])
    moe = h * c["e"] + 3 * h * (c["k"] * c["f"] + c["fs"])
    layer = h * (h + 2 * kv) + h * h + 2 * seq * h + moe
    return 6.0 * tokens * (c["l"] * layer + h * padded(c["vocab"]))


def peak_flops(name, given):
    if given:
        return given * 1e12
    if ("H100" in name and "PCIe" not in name) or "H200" in name:
        return 989.4e12
    if "H100" in name:
        return 756.0e12
    return float("nan")


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` with variable splits; the backward pass sends the gradients back."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def rope_tables(head_dim, seq, base, device):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq, device=device).float(), inv)
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """RMSNorm, grouped-query attention with rope, output projection and the residual."""

    def __init__(self, c):
        super().__init__()
        h, self.heads, self.groups = c["h"], c["heads"], c["groups"]
        self.d = h // self.heads
        self.norm = nn.RMSNorm(h)
        self.qkv = nn.Linear(h, h + 2 * self.groups * self.d, bias=False)
        self.out = nn.Linear(h, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        kv = self.groups * self.d
        q, k, v = self.qkv(self.norm(x)).split([h, kv, kv], -1)
        q = apply_rope(q.view(b, s, self.heads, self.d).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(b, s, self.groups, self.d).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.groups, self.d).transpose(1, 2)
        rep = self.heads // self.groups
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(o.transpose(1, 2).reshape(b, s, h))


class Moe(nn.Module):
    """RMSNorm, router, dispatch, this rank's experts, combine, shared expert, residual."""

    def __init__(self, c, ep_group, grouped_mm):
        super().__init__()
        h, e, f = c["h"], c["e"], c["f"]
        self.c, self.group, self.grouped_mm = c, ep_group, grouped_mm
        self.ep = dist.get_world_size(ep_group)
        self.local = e // self.ep
        self.norm = nn.RMSNorm(h)
        self.router = nn.Linear(h, e, bias=False)
        # [local experts, out, in], as nn.Linear and torchtitan keep them: the grouped GEMMs
        # take their transposes (column-major), the layout torch._grouped_mm is made for.
        std = 0.02
        self.w1 = nn.Parameter(torch.randn(self.local, f, h) * std)
        self.w3 = nn.Parameter(torch.randn(self.local, f, h) * std)
        self.w2 = nn.Parameter(torch.randn(self.local, h, f) * std)
        for w in (self.w1, self.w3, self.w2):
            w.expert = True
        self.shared = None
        if c["fs"]:
            self.shared = nn.ModuleDict(dict(
                w1=nn.Linear(h, c["fs"], bias=False), w3=nn.Linear(h, c["fs"], bias=False),
                w2=nn.Linear(c["fs"], h, bias=False)))
        self.register_buffer("expert_bias", torch.zeros(e), persistent=False)
        self.load = torch.zeros(e)

    def experts(self, x, counts):
        """SwiGLU of local expert j on its block of `x` (`counts[j]` rows, in order)."""
        if self.grouped_mm[0]:
            try:
                offs = torch.cumsum(counts, 0).to(torch.int32)
                t = lambda w: w.transpose(-2, -1)  # noqa: E731
                up = torch._grouped_mm(x, t(self.w1), offs=offs)
                gate = torch._grouped_mm(x, t(self.w3), offs=offs)
                return torch._grouped_mm(F.silu(gate) * up, t(self.w2), offs=offs)
            except (RuntimeError, TypeError) as e:  # shared by every layer: the loop from now on
                self.grouped_mm[0] = False
                print(f"torch_moe: torch._grouped_mm failed, experts computed by a loop over the "
                      f"experts from now on: {str(e).splitlines()[0][:200]}", flush=True)
        outs = []
        for j, block in enumerate(x.split(counts.tolist())):
            outs.append((F.silu(block @ self.w3[j].t()) * (block @ self.w1[j].t())) @ self.w2[j].t())
        return torch.cat(outs)

    def forward(self, x):
        c = self.c
        b, s, h = x.shape
        t = self.norm(x).reshape(b * s, h)
        logits = self.router(t).float()
        if c.get("force_balance"):
            # Megatron's --moe-router-force-load-balancing: random logits for an even load,
            # the gradient passed straight through to the real ones.
            logits = logits + (torch.randn_like(logits) - logits).detach()
        scores = logits.softmax(-1) if c["score"] == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if c["bias"] else scores
        idx = choice.detach().topk(c["k"], -1).indices
        weights = scores.gather(1, idx)
        if c["score"] == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True)
        flat = idx.flatten()
        counts = torch.bincount(flat, minlength=c["e"])
        self.load = counts.detach()
        probs = scores if c["score"] == "softmax" else scores / scores.sum(-1, keepdim=True)
        aux = c["aux"] * c["e"] * (probs.mean(0) * counts.float() / flat.numel()).sum()

        # Dispatch: assignments sorted by expert, so by destination rank, then local expert.
        order = torch.argsort(flat, stable=True)
        send = t[order // c["k"]]
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        in_splits = counts.view(self.ep, self.local).sum(1).tolist()
        recv_counts = recv_counts.view(self.ep, self.local)
        out_splits = recv_counts.sum(1).tolist()
        recv = AllToAll.apply(send, out_splits, in_splits, self.group)
        # Received rows are by source rank, then local expert: regroup them by local expert.
        local_of_row = torch.repeat_interleave(
            torch.arange(self.local, device=t.device).repeat(self.ep), recv_counts.flatten())
        regroup = torch.argsort(local_of_row, stable=True)
        y = self.experts(recv[regroup], recv_counts.sum(0))
        y = torch.empty_like(y).index_copy(0, regroup, y)
        back = AllToAll.apply(y, in_splits, out_splits, self.group)
        per_assignment = torch.empty_like(back).index_copy(0, order, back)
        out = (per_assignment.view(b * s, c["k"], h) * weights.to(x.dtype).unsqueeze(-1)).sum(1)
        if self.shared is not None:
            sh = self.shared
            out = out + sh.w2(F.silu(sh.w3(t)) * sh.w1(t))
        return x + out.view(b, s, h), aux


class Model(nn.Module):
    def __init__(self, c, seq, ep_group, grouped_mm, compile_attention, device):
        super().__init__()
        self.embed = nn.Embedding(padded(c["vocab"]), c["h"])
        self.attn = nn.ModuleList(Attention(c) for _ in range(c["l"]))
        self.moe = nn.ModuleList(Moe(c, ep_group, grouped_mm) for _ in range(c["l"]))
        self.norm = nn.RMSNorm(c["h"])
        self.head = nn.Linear(c["h"], padded(c["vocab"]), bias=False)
        cos, sin = rope_tables(c["h"] // c["heads"], seq, c["rope"], device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.attn_fns = [torch.compile(a) if compile_attention else a for a in self.attn]

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        aux = 0.0
        for attn, moe in zip(self.attn_fns, self.moe):
            x, a = moe(attn(x, cos, sin))
            aux = aux + a
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + aux


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default="mixtral")
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=None, help="layers (the preset's by default)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--force-balance", action="store_true",
                   help="route by random logits (Megatron's --moe-router-force-load-balancing)")
    p.add_argument("--no-grouped-mm", action="store_true", help="the loop over experts")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (smoke tests)")
    p.add_argument("--peak-tflops", type=float, default=None)
    a = p.parse_args()

    cpu = a.device == "cpu"
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cpu:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))), torch.bfloat16
        torch.cuda.set_device(device)
    c = dict(PRESETS[a.preset])
    if a.tiny:
        c.update(TINY)
        c["fs"] = TINY["fs"] if c["fs"] else 0
    if a.layers:
        c["l"] = a.layers
    c["force_balance"] = a.force_balance
    if world % a.ep or c["e"] % a.ep:
        sys.exit(f"torch_moe: ERROR: --ep {a.ep} must divide the world ({world}) and the experts ({c['e']})")
    # EP groups: consecutive ranks; expert-DP groups: the ranks holding the same experts.
    ep_group = edp_group = None
    for start in range(0, world, a.ep):
        g = dist.new_group(list(range(start, start + a.ep)))
        if start <= rank < start + a.ep:
            ep_group = g
    for j in range(a.ep):
        g = dist.new_group(list(range(j, world, a.ep)))
        if rank % a.ep == j:
            edp_group = g
    edp = world // a.ep

    grouped_mm = hasattr(torch, "_grouped_mm") and not cpu and not a.no_grouped_mm
    if not grouped_mm:
        why = "--no-grouped-mm" if a.no_grouped_mm else ("the CPU" if cpu else "torch._grouped_mm is missing")
        log(f"experts computed by a loop over the experts ({why})")
    torch.manual_seed(1234 + rank % a.ep)  # experts differ by EP rank, equal over expert DP
    use_grouped_mm = [grouped_mm]  # a cell every layer shares, cleared if the kernel fails
    model = Model(c, a.seq, ep_group, use_grouped_mm, not a.no_compile, device).to(device, dtype)
    with torch.no_grad():  # the same non-expert weights everywhere (DDP also broadcasts them)
        for n, w in model.named_parameters():
            if not getattr(w, "expert", False):
                dist.broadcast(w, 0)
    expert_params = [w for w in model.parameters() if getattr(w, "expert", False)]
    ignore = [n for n, w in model.named_parameters() if getattr(w, "expert", False)]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=None if cpu else [device],
                                              broadcast_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                            fused=not cpu)
    total = sum(w.numel() for w in model.parameters())
    log(f"{a.preset}{' (tiny)' if a.tiny else ''}: world {world}, EP {a.ep} x expert-DP {edp}, "
        f"{total / 1e9:.2f} B parameters on rank 0, impl={'grouped_mm' if grouped_mm else 'loop'}, "
        f"compile={int(not a.no_compile)}, {dtype}")

    gen = torch.Generator(device="cpu").manual_seed(rank)
    vocab = c["vocab"]

    def step():
        for m in range(a.grad_accum):
            tokens = torch.randint(0, vocab, (a.micro_batch, a.seq + 1), generator=gen).to(device)
            sync = ddp.no_sync() if m + 1 < a.grad_accum else nullcontext()
            with sync:
                loss = ddp(tokens[:, :-1], tokens[:, 1:]) / a.grad_accum
                loss.backward()
        if edp > 1:
            for w in expert_params:
                dist.all_reduce(w.grad, group=edp_group)
                w.grad.div_(edp)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if c["bias"]:  # DeepSeek-V3's expert bias, from the step's load over every rank
            loads = torch.stack([m.load.float() for m in model.moe])
            dist.all_reduce(loads)
            for m, load in zip(model.moe, loads):
                m.expert_bias += 1e-3 * torch.sign(load.mean() - load)
        return loss.detach()

    tokens_per_step = world * a.micro_batch * a.grad_accum * a.seq
    flops = training_flops(c, tokens_per_step, a.seq)
    peak = float("nan") if cpu else peak_flops(torch.cuda.get_device_name(device), a.peak_tflops)
    times = []
    for i in range(a.warmup + a.steps):
        if not cpu:
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        if not cpu:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        dist.all_reduce(loss)
        kind = "warm-up" if i < a.warmup else "step"
        log(f"{kind} {i + 1}: loss {loss.item() / world:.4f} | {dt:.3f} s | "
            f"{tokens_per_step / dt:.0f} tokens/s | {flops / dt / world / 1e12:.1f} TFLOP/s per GPU")
        if i >= a.warmup:
            times.append(dt)
    dt = statistics.median(times)
    tflops = flops / dt / world / 1e12
    mem = ""
    if not cpu:
        mem = (f" mem_alloc_gib={torch.cuda.max_memory_allocated(device) / 2**30:.1f}"
               f" mem_reserved_gib={torch.cuda.max_memory_reserved(device) / 2**30:.1f}")
    log(f"median over {len(times)} steps")
    if rank == 0:
        impl = "grouped_mm" if use_grouped_mm[0] else "loop"
        print(f"RESULT tok_s={tokens_per_step / dt:.0f} tflops={tflops:.1f} mfu={tflops * 1e12 / peak:.4f}"
              f"{mem} impl={impl} compile={int(not a.no_compile)}"
              f" ep={a.ep} edp={edp} preset={a.preset}", flush=True)
    dist.destroy_process_group()


class nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
