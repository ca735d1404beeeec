# BENCHMARK PEER, not part of burn-megatron: transformers' `generate` on the same Llama as
# examples/examples/generate.rs, so that our greedy tokens are checked against transformers'
# and our decode speed is reported next to transformers' measured in the same device call
# (issue 37; bench/generate_gpu_check.sh runs both).
#
#   python3 bench/torch_generate.py make /tmp/llama1b --preset llama-1b --dtype f32
#   python3 bench/torch_generate.py greedy /tmp/llama1b --prompt-ids 1,2,3 --prompt-ids 4,5 \
#       --max-new-tokens 32 [--ours OUR_LOG ...]
#   python3 bench/torch_generate.py bench /tmp/llama1b --dtype bf16 --batch-size 1,32 \
#       --prompt-length 128 --max-new-tokens 64 [--compile]
#
# - make: a LlamaForCausalLM of the preset's shape (Llama-3.2-1B's for llama-1b: tied
#   embeddings, RoPE base 500000, no rope scaling, no biases), randomly initialised (normal,
#   std --init-std: large enough that greedy picks have clear margins), saved with
#   save_pretrained (safetensors) for `generate --hf DIR` to import. No bos/eos token: nothing
#   stops generation early on either side.
# - greedy: transformers' greedy ids for each prompt alone (no padding), printed as
#   `ids: 1 2 3` lines, the format of `generate`'s. With --ours LOG (a log of `generate
#   --prompt-ids ...` with the same prompts), compares: PASS where the ids are equal; where
#   they differ, the first differing position, and transformers' logits on our whole sequence
#   (teacher forcing) judge every one of our picks: TIE where each is transformers' argmax or
#   within --tie-tolerance of the logits' standard deviation of it (rounding decided), FAIL
#   where one is further off.
# - bench: transformers' generate with the static KV cache (cache_implementation="static"),
#   greedy, exactly --max-new-tokens tokens for --batch-size prompts of --prompt-length random
#   ids. Eager (automatic compilation disabled), or with --compile transformers' own
#   torch.compile of the decoding forward (its automatic compilation of static-cache decoding;
#   where that is not there or compiles nothing, torch.compile(model.forward,
#   mode="reduce-overhead", fullgraph=True)); the RESULT line says which ran. Timing as ours: a run of one new token
#   (the prefill, which picks the first token) and a run of N, each the median of --repeats
#   runs after a warm-up run of each, between torch.cuda.synchronize() calls; decode is the
#   difference, the N - 1 tokens after the first; tokens/s = batch x (N - 1) / decode.
#   Under torchrun with more than one process (`torchrun --nproc-per-node 2 bench/torch_generate.py
#   bench ...`): transformers' own tensor parallelism (`from_pretrained(tp_plan="auto")`), every
#   rank the same prompts, rank 0 printing; the RESULT line says tp=N.

import argparse
import json
import os
import statistics
import sys
import time

import torch

PRESETS = {
    # Llama-3.2-1B's shape (our TransformerConfig::llama_1b).
    "llama-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    # generate's --preset llama-tiny, for checks on a CPU.
    "llama-tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        rope_theta=500000.0,
    ),
}

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def device_of(name):
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def llama_config(preset, init_std, max_positions):
    """A LlamaConfig of the preset's shape, with only options our importer reads."""
    from transformers import LlamaConfig

    shape = dict(PRESETS[preset])
    theta = shape.pop("rope_theta")
    config = LlamaConfig(
        **shape,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    # transformers 5 keeps the RoPE base in rope_parameters, 4.x in rope_theta.
    if isinstance(getattr(config, "rope_parameters", None), dict):
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    try:
        if hasattr(config, "rope_theta"):
            config.rope_theta = theta
    except AttributeError:  # a read-only view of rope_parameters
        pass
    return config, theta


def check_rope(model, theta, head_dim):
    """The model's RoPE frequencies are those of base `theta` (no scaling)."""
    inv_freq = model.model.rotary_emb.inv_freq.float().cpu()
    want = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if not torch.allclose(inv_freq, want, rtol=1e-5):
        sys.exit(f"the model's RoPE frequencies are not base {theta}'s: {inv_freq[:3]} vs {want[:3]}")


def cmd_make(args):
    from transformers import LlamaForCausalLM

    config, theta = llama_config(args.preset, args.init_std, args.max_positions)
    device = device_of(args.device)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(DTYPES[args.dtype]).eval()
    check_rope(model, theta, config.hidden_size // config.num_attention_heads)
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        sys.exit("the output layer is not tied to the embeddings")
    try:
        model.save_pretrained(args.dir, safe_serialization=True)
    except TypeError:  # a transformers without the option (safetensors always)
        model.save_pretrained(args.dir)
    with open(os.path.join(args.dir, "config.json")) as f:
        saved = json.load(f)
    rope = {k: saved.get(k) for k in ("rope_theta", "rope_parameters", "rope_scaling") if saved.get(k)}
    params = sum(p.numel() for p in model.parameters())
    print(
        f"made {args.dir}: {args.preset}, {params / 1e6:.1f}M parameters, {args.dtype}, "
        f"init std {args.init_std}, seed {args.seed}, on {device} in {time.perf_counter() - start:.1f} s; "
        f"config.json's RoPE: {rope}; files: {sorted(os.listdir(args.dir))}"
    )


def load(dir, dtype, device, tp=False):
    from transformers import LlamaForCausalLM

    # With tp: transformers' tensor parallelism over the torchrun processes (each its GPU).
    extra = {"tp_plan": "auto"} if tp else {}
    try:
        model = LlamaForCausalLM.from_pretrained(dir, dtype=dtype, **extra)
    except TypeError:  # transformers 4.x before `dtype`
        model = LlamaForCausalLM.from_pretrained(dir, torch_dtype=dtype, **extra)
    # (A transformers that ignores `dtype` loads f32: the cast makes sure.)
    if not tp:
        model = model.to(device=device, dtype=dtype)
    model = model.eval()
    # No stop token: exactly max_new_tokens tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def ids_arg(text):
    return [int(t) for t in text.split(",") if t.strip()]


def read_ours(path):
    """The `ids:` lines of one of our logs, in order."""
    with open(path) as f:
        return [[int(t) for t in line.split()[1:]] for line in f if line.startswith("ids:")]


@torch.no_grad()
def cmd_greedy(args):
    device = device_of(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = load(args.dir, DTYPES[args.dtype], device)
    theirs = []
    for prompt in args.prompt_ids:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
        )
        new = out[0, len(prompt):].tolist()
        theirs.append(new)
        print("ids:", " ".join(map(str, new)), flush=True)
    failed = tied = 0
    for log in args.ours or []:
        ours = read_ours(log)
        if len(ours) != len(theirs):
            print(f"FAIL {log}: {len(ours)} outputs, transformers {len(theirs)}")
            failed += 1
            continue
        for i, (prompt, a, b) in enumerate(zip(args.prompt_ids, ours, theirs)):
            verdict = compare(model, device, prompt, a, b, args.tie_tolerance)
            failed += verdict.startswith("FAIL")
            tied += verdict.startswith("TIE")
            print(f"{verdict.split(':')[0]} {log} prompt {i} ({len(prompt)} ids){verdict[verdict.index(':'):]}")
    if args.ours:
        print(f"GREEDY {'FAIL' if failed else 'PASS'}: {failed} failed, {tied} with near ties only")
        sys.exit(1 if failed else 0)


def compare(model, device, prompt, ours, theirs, tolerance):
    """PASS where the ids are equal. Otherwise transformers' logits on our whole sequence (one
    forward pass, teacher forcing) judge each of our picks: transformers' argmax there, a near
    tie (the gap to the argmax below `tolerance` of the logits' standard deviation: rounding
    decided it, TIE) or not (FAIL)."""
    if ours == theirs:
        return f"PASS: {len(ours)} of {len(theirs)} ids equal"
    k = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    if not ours:
        return "FAIL: no ids of ours"
    ids = torch.tensor([prompt + ours[:-1]], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
    picked = logits.gather(1, torch.tensor(ours, device=device)[:, None])[:, 0]
    best, std = logits.max(dim=1).values, logits.std(dim=1)
    gaps = ((best - picked) / std).tolist()
    ties = [j for j, g in enumerate(gaps) if 0 < g <= tolerance]
    fails = [j for j, g in enumerate(gaps) if g > tolerance]
    at_k = ""
    if k < min(len(ours), len(theirs)):
        at_k = (
            f"first difference from transformers' generate at position {k} (ours {ours[k]}, "
            f"transformers {theirs[k]}); "
        )
    elif len(ours) != len(theirs):
        at_k = f"lengths {len(ours)} (ours) and {len(theirs)} (transformers); "
    verdict = "FAIL" if fails or len(ours) != len(theirs) else "TIE"
    worst = max(range(len(gaps)), key=lambda j: gaps[j])
    return (
        f"{verdict}: {at_k}on our sequence, transformers' argmax at {len(gaps) - len(ties) - len(fails)} "
        f"of {len(gaps)} positions, near ties (gap <= {tolerance} std) at {ties}, "
        f"other picks at {fails}; largest gap {gaps[worst]:.3g} std at position {worst}"
    )


def compiled_graphs():
    try:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]
    except Exception:
        return 0


@torch.no_grad()
def cmd_bench(args):
    from transformers import GenerationConfig

    device = device_of(args.device)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if tp > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = "cuda"
    model = load(args.dir, DTYPES[args.dtype], device, tp=tp > 1)
    if rank != 0:
        sys.stdout = open(os.devnull, "w")
    auto = hasattr(GenerationConfig(), "disable_compile")
    if args.compile:
        mode = "auto" if auto else "manual"
        if not auto:
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        extra = {}
    else:
        mode = "off"
        extra = {"disable_compile": True} if auto else {}
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    import transformers

    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, {gpu}; "
        f"{args.dir} in {args.dtype}, attention {model.config._attn_implementation}, static cache, "
        f"compile {mode}"
    )
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    for batch in args.batch_size:
        ids = torch.randint(0, vocab, (batch, args.prompt_length), generator=generator).to(device)

        def once(new):
            sync(device)
            if tp > 1:
                torch.distributed.barrier()
            start = time.perf_counter()
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                cache_implementation="static",
                **extra,
            )
            sync(device)
            elapsed = time.perf_counter() - start
            if out.shape[1] != args.prompt_length + new:
                sys.exit(f"generate gave {out.shape[1] - args.prompt_length} tokens, not {new}")
            return elapsed

        start = time.perf_counter()
        try:
            once(args.max_new_tokens)
            once(1)
        except Exception as e:  # a compile that fails: say so, and measure eager instead
            if not args.compile or mode == "failed":
                raise
            print(f"compile failed ({type(e).__name__}: {str(e)[:300]}); measuring eager")
            mode, extra = "failed", ({"disable_compile": True} if auto else {})
            if not auto:
                del model.forward  # the class's forward again
            once(args.max_new_tokens)
            once(1)
        if mode == "auto" and compiled_graphs() == 0:
            # transformers did not compile (its criteria: a CUDA device, a compileable cache):
            # compile the forward ourselves, as its docs did before automatic compilation.
            print("transformers compiled nothing: torch.compile(model.forward) instead")
            mode = "manual"
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            once(args.max_new_tokens)
            once(1)
        warmup = time.perf_counter() - start
        if args.repeats == 0:
            print(f"warm-up only: batch {batch}, {warmup:.1f} s, compile {mode}", flush=True)
            continue
        prefill, total = [], []
        for _ in range(args.repeats):
            prefill.append(once(1))
            total.append(once(args.max_new_tokens))
        prefill, total = statistics.median(prefill), statistics.median(total)
        n = args.max_new_tokens
        decode = total - prefill
        if decode <= 0:
            print("the one-token run took longer than the N-token run (a recompilation?): no decode time")
        tok_s = batch * (n - 1) / decode
        if mode in ("auto", "manual") and compiled_graphs() == 0:
            mode = f"{mode}-not-triggered"
        impl = "transformers-compile" if mode in ("auto", "manual") else "transformers-eager"
        print(
            f"benchmark: batch {batch}, prompts of {args.prompt_length}, {n} new tokens; medians of "
            f"{args.repeats} runs after {warmup:.1f} s of warm-up; compiled graphs so far: {compiled_graphs()}\n"
            f"  prefill (and the first token): {prefill * 1e3:.2f} ms\n"
            f"  decode ({n - 1} tokens a prompt after the first): {decode * 1e3:.2f} ms, "
            f"{decode * 1e3 / (n - 1):.3f} ms a step, {tok_s:.1f} tokens/s"
        )
        print(
            f"RESULT generate impl={impl} compile={mode} tp={tp} pp=1 dtype={args.dtype} batch={batch} "
            f"prompt={args.prompt_length} new={n} prefill_ms={prefill * 1e3:.3f} total_ms={total * 1e3:.3f} "
            f"decode_ms_per_step={decode * 1e3 / (n - 1):.4f} decode_tok_s={tok_s:.1f}",
            flush=True,
        )


    if tp > 1:
        torch.distributed.destroy_process_group()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser(description="transformers' generate beside ours (see the top of this file)")
    sub = p.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="a random Llama saved with save_pretrained")
    make.add_argument("dir")
    make.add_argument("--preset", choices=sorted(PRESETS), default="llama-1b")
    make.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--init-std", type=float, default=0.1)
    make.add_argument("--max-positions", type=int, default=2048)
    make.add_argument("--device", default="auto", help="where to initialise (auto: cuda if there)")
    greedy = sub.add_parser("greedy", help="transformers' greedy ids, compared with ours")
    greedy.add_argument("dir")
    greedy.add_argument("--prompt-ids", type=ids_arg, action="append", required=True)
    greedy.add_argument("--max-new-tokens", type=int, default=32)
    greedy.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    greedy.add_argument("--ours", action="append", help="a log of ours to compare (repeatable)")
    greedy.add_argument("--tie-tolerance", type=float, default=0.01)
    greedy.add_argument("--device", default="auto")
    bench = sub.add_parser("bench", help="transformers' generate, timed")
    bench.add_argument("dir")
    bench.add_argument("--batch-size", type=ids_arg, default=[1], help="e.g. 1,32")
    bench.add_argument("--prompt-length", type=int, default=128)
    bench.add_argument("--max-new-tokens", type=int, default=64)
    bench.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    bench.add_argument("--compile", action="store_true")
    bench.add_argument("--repeats", type=int, default=3, help="0: the warm-up runs only")
    bench.add_argument("--seed", type=int, default=1234)
    bench.add_argument("--device", default="auto")
    args = p.parse_args()
    if getattr(args, "max_new_tokens", 2) < (2 if args.command == "bench" else 1):
        sys.exit("--max-new-tokens must be at least 2 for bench, 1 otherwise")
    {"make": cmd_make, "greedy": cmd_greedy, "bench": cmd_bench}[args.command](args)


if __name__ == "__main__":
    main()
