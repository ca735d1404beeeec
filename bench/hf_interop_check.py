# Check peer (transformers, not part of burn-megatron): the reference side of the Hugging Face
# import/export check. Runs offline on the device machine (PyTorch + transformers, no network).
#
#   python bench/hf_interop_check.py make DIR     # random tiny GPT-2, Llama, Mixtral, Qwen3-MoE,
#                                                 # saved with save_pretrained, and their logits
#   cargo run --release -p burn-megatron-examples --example hf_import_check -- DIR
#                                                 # imports them (TP = 1 and 2; the Mixtral
#                                                 # also at EP = 2 and TP 2 x EP 2), compares
#                                                 # logits, exports DIR/<model>/export
#   python bench/hf_interop_check.py compare DIR  # transformers reloads our exports and
#                                                 # compares their logits with the originals
"""Reference side of examples/examples/hf_import_check.rs."""
import json
import os
import sys

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

TOKENS = [[(7 * i + 3 * b + 1) % 1000 for i in range(16)] for b in range(2)]


def models():
    gpt2 = GPT2Config(
        vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4,
        activation_function="gelu_new", layer_norm_epsilon=1e-5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    llama = LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    )
    # 4 experts, top 2, renormalised (Mixtral's routing); rope_theta left at Mixtral's default
    # (1e6), which transformers writes under whichever key its version uses.
    mixtral = MixtralConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=None, router_jitter_noise=0.0,
    )
    # 4 experts, top 2, not renormalised; heads of 32 where hidden / heads is 16 (our
    # --kv-channels), per-head q/k RMSNorm (our --qk-layernorm).
    qwen3_moe = Qwen3MoeConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
    )
    return {
        "gpt2": (GPT2LMHeadModel, gpt2),
        "llama": (LlamaForCausalLM, llama),
        "mixtral": (MixtralForCausalLM, mixtral),
        "qwen3_moe": (Qwen3MoeForCausalLM, qwen3_moe),
    }


# Router weights are scaled by this after the perturbation: the routers' logits then differ by
# far more than the rounding of two implementations, so both pick the same top-k experts.
ROUTER_SCALE = 10.0


def perturb(model, seed):
    # LayerNorm/RMSNorm weights start at one and biases at zero: randomise every tensor so a
    # swapped scale/shift or a misplaced bias shows.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
            # The MoE routers: Mixtral's `block_sparse_moe.gate` (transformers 4) or `mlp.gate`
            # (5, and Qwen3-MoE).
            if name.endswith(".gate.weight") and "experts" not in name:
                p.mul_(ROUTER_SCALE)


def logits_of(model):
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float()


def make(root):
    torch.manual_seed(0)
    for name, (cls, config) in models().items():
        model = cls(config).float()
        perturb(model, 1)
        out = os.path.join(root, name)
        model.save_pretrained(out, safe_serialization=True)
        with open(os.path.join(out, "reference_logits.json"), "w") as f:
            json.dump({"tokens": TOKENS, "logits": logits_of(model).tolist()}, f)
        print(f"{name}: saved to {out}")


def compare(root):
    worst = 0.0
    for name, (cls, _) in models().items():
        with open(os.path.join(root, name, "reference_logits.json")) as f:
            want = torch.tensor(json.load(f)["logits"])
        export = os.path.join(root, name, "export")
        got = logits_of(cls.from_pretrained(export, torch_dtype=torch.float32))
        abs_diff = (got - want).abs().max().item()
        rel = abs_diff / want.abs().max().item()
        worst = max(worst, abs_diff)
        print(f"{name}: transformers on our export vs the original: max abs {abs_diff:.3e}, "
              f"max rel (to max |logit|) {rel:.3e}")
    print("PASS" if worst < 1e-4 else "FAIL", f"(max abs {worst:.3e}, bound 1e-4)")
    return worst < 1e-4


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "compare"):
        sys.exit("usage: hf_interop_check.py make|compare DIR")
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        sys.exit(0 if compare(sys.argv[2]) else 1)
