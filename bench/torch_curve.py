# BENCHMARK PEER, not part of burn-megatron: PyTorch's loss curve for the 350M GPT of
# bench/fp8_gpu_check.sh's curve parts, in bf16 and in float8, on the same corpus (a Megatron
# .bin/.idx pair, e.g. bench/make_realtext.py's after preprocess_data), so that our FP8 run's
# distance from our bf16 run is set next to PyTorch's float8 distance from PyTorch's bf16
# (issue 33).
#
#   python3 bench/torch_curve.py --data-prefix .gpu/data/realtext_text_document [--fp8]
#
# What it runs: bench/torch_train.py's GPT (LayerNorm, GeLU, learned positions, tied output,
# biases, std 0.02 with GPT-2's scaled std on the residual-writing layers), the vocabulary
# padded to a multiple of 8 as ours; f32 parameters under bf16 autocast, torch.compile;
# AdamW (β 0.9/0.95, ε 1e-8, weight decay 0.01 on matrices only), gradients clipped at norm
# 1, linear warm-up then cosine decay to --min-lr: pretrain_gpt's defaults. --fp8 converts the
# blocks' linear layers with bench/torch_float8.py (torchao's tensorwise recipe).
#
# The data, as Megatron's GPT dataset lays it out (not bit for bit the same samples as ours):
# the first 98 % of the documents train, the rest validate; the training documents are
# concatenated in a seeded random order (a new order each epoch) and cut into samples of
# seq + 1 tokens that overlap by one, read in a seeded random order. Both runs (bf16 and
# float8) read the same batches. The validation loss is the mean over the same
# --eval-iters batches of held-out samples at every evaluation.
#
# Lines printed: " iteration N/T | lr X | loss L | lm loss M | grad norm G" (L the iteration's
# loss, M the mean since the previous line) and " validation loss at iteration N | loss V",
# the formats of pretrain_gpt's log.

import argparse
import math
import sys
import time

import numpy as np
import torch

import torch_train

DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def read_corpus(prefix):
    """The tokens of a Megatron indexed dataset and the token offset of each document."""
    with open(prefix + ".idx", "rb") as f:
        header = f.read(34)
        if header[:9] != b"MMIDIDX\x00\x00":
            sys.exit(f"{prefix}.idx: not a Megatron index")
        code = header[17]
        sequences = int.from_bytes(header[18:26], "little")
        documents = int.from_bytes(header[26:34], "little")
        sizes = np.frombuffer(f.read(4 * sequences), dtype=np.int32)
        np.frombuffer(f.read(8 * sequences), dtype=np.int64)  # byte pointers, unused
        doc_idx = np.frombuffer(f.read(8 * documents), dtype=np.int64)
    tokens = np.fromfile(prefix + ".bin", dtype=DTYPES[code]).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes.astype(np.int64))])
    # Document d holds sequences doc_idx[d]..doc_idx[d + 1].
    return tokens, [(starts[doc_idx[d]], starts[doc_idx[d + 1]]) for d in range(len(doc_idx) - 1)]


class Samples:
    """Samples of seq + 1 tokens over the documents concatenated in a seeded order."""

    def __init__(self, tokens, docs, seq, seed):
        self.tokens, self.docs, self.seq = tokens, docs, seq
        self.rng = np.random.default_rng(seed)
        self.epoch = []

    def _new_epoch(self):
        order = self.rng.permutation(len(self.docs))
        stream = np.concatenate([self.tokens[a:b] for a, b in (self.docs[i] for i in order)])
        count = (len(stream) - 1) // self.seq
        starts = self.rng.permutation(count) * self.seq
        self.epoch = [stream[s:s + self.seq + 1] for s in starts]

    def batch(self, size):
        rows = []
        while len(rows) < size:
            if not self.epoch:
                self._new_epoch()
            rows.append(self.epoch.pop())
        return torch.from_numpy(np.stack(rows))


def lr_at(it, args):
    """Linear warm-up to --lr, then cosine decay to --min-lr at --train-iters."""
    if it <= args.lr_warmup_iters:
        return args.lr * it / max(args.lr_warmup_iters, 1)
    done = (it - args.lr_warmup_iters) / max(args.train_iters - args.lr_warmup_iters, 1)
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data-prefix", required=True)
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--train-iters", type=int, default=1000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--lr-warmup-iters", type=int, default=100)
    p.add_argument("--log-interval", type=int, default=25)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--mode", choices=["compile", "eager"], default="compile")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    tokens, docs = read_corpus(args.data_prefix)
    vocab = int(tokens.max()) + 1
    train_docs = round(0.98 * len(docs))
    train = Samples(tokens, docs[:train_docs], args.seq_length, args.seed)
    held_out = Samples(tokens, docs[train_docs:], args.seq_length, args.seed + 1)
    held_out._new_epoch()
    valid = held_out.epoch[: args.eval_iters * args.global_batch_size]

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    # Our vocabulary is padded to a multiple of 8 (--make-vocab-size-divisible-by).
    torch_train.padded = lambda v, multiple=8: (v + multiple - 1) // multiple * multiple
    h = args.hidden_size
    model = torch_train.Gpt(h, args.num_layers, args.num_attention_heads, args.num_attention_heads,
                            4 * h, vocab, args.seq_length, args.seq_length, "gpt", True).to(device)
    impl = "bf16"
    if args.fp8:
        import torch_float8

        impl = torch_float8.convert(model, model.layers)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    rest = [q for q in model.parameters() if q.dim() < 2]
    cuda = device.type == "cuda"
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda,
    )
    forward = torch.compile(model) if args.mode == "compile" else model
    print(f"torch_curve: {sum(q.numel() for q in model.parameters()) / 1e6:.2f} M parameters, "
          f"vocabulary {vocab} (padded {model.vocab}), {len(docs)} documents ({train_docs} train), "
          f"{impl}, torch {torch.__version__}", flush=True)

    def loss_of(batch):
        batch = batch.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            return forward(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())

    start, interval = time.perf_counter(), []
    for it in range(1, args.train_iters + 1):
        for group in optim.param_groups:
            group["lr"] = lr_at(it, args)
        model.train()
        loss = loss_of(train.batch(args.global_batch_size))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        interval.append(loss.detach())
        if it % args.log_interval == 0 or it == args.train_iters:
            mean = torch.stack(interval).mean().item()
            tokens_per_s = (len(interval) * args.global_batch_size * args.seq_length
                            / (time.perf_counter() - start))
            print(f" iteration {it:>6}/{args.train_iters:<6} | lr {lr_at(it, args):.3e} | loss "
                  f"{loss.item():.4f} | lm loss {mean:.4f} | grad norm {norm.item():.3f} | "
                  f"{tokens_per_s:.0f} tokens/s", flush=True)
            start, interval = time.perf_counter(), []
        if args.eval_interval and (it % args.eval_interval == 0 or it == args.train_iters):
            model.eval()
            with torch.no_grad():
                total = sum(
                    loss_of(torch.from_numpy(np.stack(valid[i:i + args.global_batch_size])))
                    for i in range(0, len(valid), args.global_batch_size)
                )
            batches = math.ceil(len(valid) / args.global_batch_size)
            print(f" validation loss at iteration {it} | loss {total.item() / batches:.4f}",
                  flush=True)
            start = time.perf_counter()


if __name__ == "__main__":
    main()
