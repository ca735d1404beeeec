# BENCHMARK PEER, not part of burn-megatron: PyTorch's context parallelism (issue 35) on the
# ~1B Llama of examples/configs/llama_1b_long.toml, run in the same device call as
# pretrain_gpt --context-parallel-size (bench/context_parallel_gpu_check.sh), so that our
# step is reported as a ratio to it.
#
#   torchrun --nproc-per-node 4 bench/torch_cp.py --cp 4 --seq 131072            # CP 4 x DP 1
#   torchrun --nproc-per-node 4 bench/torch_cp.py --cp 2 --seq 32768 --rotate alltoall
#
# torchtitan's recipe: a 2-D mesh dp x cp; `torch.distributed.tensor.experimental.
# context_parallel` (ring attention over the cp dimension, patched into
# F.scaled_dot_product_attention, K/V passed round by all-gather or by all-to-all:
# `set_rotate_method`, --rotate; causal load balancing by PyTorch's default head-tail split,
# rank i holding chunks i and 2·cp−1−i, as ours); FSDP2 (`fully_shard` on every block and the
# root, bf16 parameters, fp32 gradient reduction) over all dp x cp ranks, as torchtitan's
# dp_shard_cp mesh; full activation checkpointing per block (--ac full, as our
# --recompute-granularity full); `torch.compile` per block (--no-compile for eager); SDPA on
# flash attention (--sdpa); fused AdamW. K/V heads are repeated to the query heads before SDPA,
# as torchtitan's Llama does (the ring then moves 4x the K/V of grouped-query attention).
#
# The whole measured loop runs inside one `context_parallel` context: the RoPE tables and a
# position index are its buffers (sharded once), and each step's tokens and targets are taken
# at this rank's positions from that index, so they follow whatever split PyTorch chose.
# Before training, one attention call under the context is checked against full causal SDPA
# (a patch that did not apply would attend only to the rank's own tokens: fast and wrong).
#
# The model is bench/torch_train.py's (shapes, init, FLOPs formula), built on the meta device
# as bench/torch_fsdp.py does. Each DP replica reads --batch sequences of --seq tokens a step;
# tokens/s counts all of them, TFLOP/s and MFU are per GPU (Megatron's FLOPs formula, as ours).
# The RESULT line has torch_fsdp.py's fields plus cp, dp, rotate, ac, sdpa.

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_train
from torch_fsdp import init_weights
from torch_train import Gpt, padded, peak_flops, training_flops

PRESETS = {
    # name: (hidden, layers, heads, query groups, ffn, vocab, seq, kind, tied)
    "llama-1b-long": (2048, 16, 32, 8, 8192, 32000, 32768, "llama", False),
    "llama-1b": (2048, 16, 32, 8, 8192, 128256, 32768, "llama", False),
}


def fail(message, code=2):
    print(f"torch_cp: ERROR: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def load_cp_api():
    """context_parallel, set_rotate_method and the options object, wherever this PyTorch keeps
    them (torch/distributed/tensor/experimental/_context_parallel/ since 2.9, _attention.py
    before)."""
    try:
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as e:
        fail(f"torch {torch.__version__} has no "
             f"torch.distributed.tensor.experimental.context_parallel ({e}): PyTorch's context "
             "parallelism needs 2.6 or later")
    set_rotate_method = options = None
    for where in ("torch.distributed.tensor.experimental._context_parallel",
                  "torch.distributed.tensor.experimental._attention"):
        try:
            module = __import__(where, fromlist=["set_rotate_method"])
        except ImportError:
            continue
        set_rotate_method = getattr(module, "set_rotate_method", None)
        options = getattr(module, "_cp_options", None)
        if set_rotate_method is not None:
            break
    if set_rotate_method is None:
        fail(f"torch {torch.__version__}: no set_rotate_method in "
             "torch.distributed.tensor.experimental._context_parallel or ._attention")
    return context_parallel, set_rotate_method, options


class CpBlock(torch_train.Block):
    """torch_train.Block (Llama) with the K/V heads repeated to the query heads before SDPA
    (torchtitan's repeat_kv): the CP ring calls the flash/efficient/cuDNN kernels directly,
    without SDPA's enable_gqa. F.scaled_dot_product_attention is looked up at each call, so
    the context's patch applies."""

    def forward(self, x):
        b, s, h = x.shape
        d, kv = self.head_dim, self.groups * self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([h, kv, kv], dim=-1)
        q = q.view(b, s, self.heads, d).transpose(1, 2)
        k = k.view(b, s, self.groups, d).transpose(1, 2)
        v = v.view(b, s, self.groups, d).transpose(1, 2)
        q, k = self.rope(q), self.rope(k)
        if self.groups != self.heads:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        z = self.norm2(x)
        return x + self.down(F.silu(self.gate(z)) * self.up(z))


def head_tail_positions(seq, cp, rank):
    """The positions rank `rank` holds under the head-tail split (chunks rank, 2·cp−1−rank)."""
    c = seq // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", choices=PRESETS, default="llama-1b-long")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size; dp = world / cp")
    parser.add_argument("--seq", type=int, help="tokens a sequence [the preset's, 32768]")
    parser.add_argument("--batch", type=int, default=1, help="sequences a DP replica reads a step")
    parser.add_argument("--layers", type=int, help="the preset's shape with fewer layers")
    parser.add_argument("--rotate", choices=["allgather", "alltoall"], default="allgather",
                        help="how the ring passes K/V (PyTorch's default: allgather)")
    parser.add_argument("--sdpa", choices=["flash", "cudnn", "efficient"], default="flash",
                        help="the SDPA kernel (math is off: it has no CP path)")
    parser.add_argument("--ac", choices=["full", "none"], default="full",
                        help="activation checkpointing of every block")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float)
    args = parser.parse_args()

    hidden, layers, heads, groups, ffn, vocab, default_seq, kind, tied = PRESETS[args.preset]
    seq = args.seq or default_seq
    layers = args.layers or layers
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    cp = args.cp
    if cp < 1 or world % cp:
        fail(f"--cp {cp} must divide the world of {world} ranks")
    if seq % (2 * cp):
        fail(f"--seq {seq} must be divisible by 2 x --cp = {2 * cp}")
    dp = world // cp
    context_parallel = set_rotate_method = cp_options = None
    if cp > 1:
        context_parallel, set_rotate_method, cp_options = load_cp_api()
        set_rotate_method(args.rotate)
        if cp_options is not None and hasattr(cp_options, "enable_load_balance"):
            cp_options.enable_load_balance = True

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"))
    cp_mesh, dp_rank = mesh["cp"], mesh["dp"].get_local_rank()
    # FSDP over every rank (dp x cp, torchtitan's dp_shard_cp; TP = PP = 1 here).
    fsdp_mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp_cp",))

    torch.backends.cuda.enable_math_sdp(False)
    torch.backends.cuda.enable_flash_sdp(args.sdpa == "flash")
    torch.backends.cuda.enable_cudnn_sdp(args.sdpa == "cudnn")
    torch.backends.cuda.enable_mem_efficient_sdp(args.sdpa in ("flash", "efficient"))

    torch.manual_seed(1234)
    torch_train.DROPOUT = 0.0
    start = time.perf_counter()
    with torch.device("meta"):
        model = Gpt(hidden, layers, heads, groups, ffn, vocab, seq, seq, kind, tied)
    if kind != "llama":
        fail("torch_cp runs the Llama presets only")
    # One RoPE table for every block: two CP buffers instead of 2 per layer.
    rope = model.layers[0].rope
    for block in model.layers:
        block.__class__ = CpBlock
        block.rope = rope
    params = sum(p.numel() for p in model.parameters())

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        if args.ac == "full":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if not args.no_compile:
            block = torch.compile(block)
        model.layers[i] = block
        fully_shard(block, mesh=fsdp_mesh, mp_policy=policy,
                    reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=policy)
    model.to_empty(device=device)
    init_weights(model, layers, kind, seq)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    setup = time.perf_counter() - start

    # Every CP rank of a DP replica holds the same whole sequences; the replicas differ.
    torch.manual_seed(1234 + dp_rank)
    batches = [
        (
            torch.randint(0, vocab, (args.batch, seq), device=device),
            torch.randint(0, vocab, (args.batch, seq), device=device),
        )
        for _ in range(4)
    ]
    # The attention check's inputs and full causal reference, the same on every rank.
    generator = torch.Generator(device=device).manual_seed(7)
    check = [torch.randn(1, 2, seq, hidden // heads, device=device, dtype=torch.bfloat16,
                         generator=generator) for _ in range(3)]
    with torch.no_grad():
        reference = F.scaled_dot_product_attention(*check, is_causal=True)
    original_sdpa = F.scaled_dot_product_attention

    positions = torch.arange(seq, device=device)
    if cp > 1:
        context = context_parallel(
            cp_mesh,
            buffers=[positions, rope.cos, rope.sin],
            buffer_seq_dims=[0, 0, 0],
            no_restore_buffers={positions},
        )
    else:
        context = contextlib.nullcontext()

    def step(i):
        tokens, targets = batches[i % len(batches)]
        begin = time.perf_counter()
        tokens, targets = tokens[:, positions], targets[:, positions]
        loss = model(tokens, targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        value = loss.item()
        torch.cuda.synchronize()
        return time.perf_counter() - begin, value

    if cp == 1:
        del check, reference
    with context, torch.enable_grad():
        # This rank's positions: PyTorch's split, compared with ours (head-tail).
        if positions.numel() != seq // cp or rope.cos.shape[0] != seq // cp:
            fail(f"context_parallel left {positions.numel()} positions and a RoPE table of "
                 f"{rope.cos.shape[0]} rows on rank {rank}, not seq / cp = {seq // cp}")
        cp_rank = cp_mesh.get_local_rank() if cp > 1 else 0
        head_tail = torch.equal(positions.cpu(), head_tail_positions(seq, cp, cp_rank))
        split = "head-tail (chunks i, 2cp-1-i, as ours)" if head_tail else "NOT head-tail"
        if cp > 1:
            patched = F.scaled_dot_product_attention is not original_sdpa
            with torch.no_grad():
                local = [t.index_select(2, positions) for t in check]
                out = F.scaled_dot_product_attention(*local, is_causal=True)
                expected = reference.index_select(2, positions).float()
                # Relative to the output's norm: the outputs are averages over up to `seq`
                # random values, small, and attention to the wrong keys is as small but
                # uncorrelated (relative error ~1); bf16 rounding is ~4e-3.
                error = ((out.float() - expected).norm() / expected.norm()).item()
            del check, reference, local, out, expected
            if not error < 5e-2:
                fail(f"rank {rank}: CP attention under context_parallel differs from full causal "
                     f"attention by {error:.3g} (relative; SDPA patched: {patched}, split "
                     f"{split}): this PyTorch's CP does not apply as this script assumes", code=4)
            if rank == 0:
                print(f"torch_cp: CP attention check passed (relative error {error:.2e}, SDPA "
                      f"patched: {patched}); rank 0 holds positions {positions[0].item()}.. and "
                      f"{positions[seq // cp // 2].item()}..: {split}", flush=True)
        try:
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
        except torch.cuda.OutOfMemoryError as e:
            first = str(e).splitlines()[0] if str(e) else ""
            print(f"torch_cp: OUT OF MEMORY on rank {rank} (seq {seq}, cp {cp}, dp {dp}): "
                  f"{first}", flush=True)
            os._exit(3)
    alloc = torch.cuda.max_memory_allocated(device) / 2**30
    reserved = torch.cuda.max_memory_reserved(device) / 2**30
    dist.destroy_process_group()
    if rank != 0:
        return
    step_ms = statistics.median(times) * 1e3
    samples = args.batch * dp
    tokens = samples * seq
    flops = training_flops(hidden, layers, heads, groups, ffn, vocab, kind, samples, seq)
    tflops = flops / (step_ms / 1e3) / 1e12 / world
    gpu = torch.cuda.get_device_name(device)
    mfu = flops / (step_ms / 1e3) / peak_flops(gpu, "bf16", args.peak_tflops) / world
    impl = (f"torch-cp-{args.rotate}" + ("" if args.no_compile else "-compile")
            + ("-ac" if args.ac == "full" else ""))
    print(
        f"torch_cp: {args.preset} ({params / 1e9:.2f}B params, padded vocabulary "
        f"{padded(vocab)}, {layers} layers), {samples} samples x seq {seq} a step, {impl} on "
        f"{world} x {gpu} (CP {cp} x DP {dp}, SDPA {args.sdpa}, split {split}), "
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
        f"RESULT impl={impl} preset={args.preset} batch={samples} seq={seq} cp={cp} dp={dp} "
        f"rotate={args.rotate} ac={args.ac} sdpa={args.sdpa} dtype=bf16 "
        f"world={world} params={params} step_ms={step_ms:.1f} tok_s={tokens / (step_ms / 1e3):.0f} "
        f"tflops={tflops:.1f} mfu={mfu:.4f} mem_alloc_gib={alloc:.1f} "
        f"mem_reserved_gib={reserved:.1f} setup_s={setup:.1f} loss={loss:.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
