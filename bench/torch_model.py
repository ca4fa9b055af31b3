#!/usr/bin/env python3
"""The PyTorch baseline of `tandem bench model` (cli/bench_model.cc).

The reference model (worker/model/model.h) written with torch.nn in eager
fp32 on the GPU: byte embeddings plus learned positions, pre-LayerNorm
blocks of causal self-attention (one qkv projection, heads of d_model/heads)
and a GELU (tanh) MLP of 4 x d_model, a final LayerNorm and an untied head,
mean cross-entropy. TF32 stays off, as in Tandem's GPU path (plain fp32
products). Attention is written out (q.k, mask, softmax, att.v) as Tandem
computes it, not a fused kernel.

For each batch size: --warmup untimed then --iters timed steps of forward
plus backward (gradients set to None between steps), each step timed with
CUDA synchronisation; prints "BATCH MEDIAN_MS" per line. Without torch or a
GPU it prints one line "unavailable: REASON" and exits with 0.
"""

import argparse
import math
import statistics
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batches", default="8,32,128")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001 - any import failure means no baseline
        print(f"unavailable: torch cannot be imported ({e})")
        return 0
    if not torch.cuda.is_available():
        print(f"unavailable: torch {torch.__version__} sees no CUDA device")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    T, C, H, L, V = args.context, args.d_model, args.heads, args.layers, args.vocab

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(C)
            self.qkv = nn.Linear(C, 3 * C)
            self.proj = nn.Linear(C, C)
            self.ln2 = nn.LayerNorm(C)
            self.fc = nn.Linear(C, 4 * C)
            self.fcproj = nn.Linear(4 * C, C)

        def forward(self, x, mask):
            B = x.shape[0]
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q = q.view(B, T, H, C // H).transpose(1, 2)
            k = k.view(B, T, H, C // H).transpose(1, 2)
            v = v.view(B, T, H, C // H).transpose(1, 2)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
            att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, C)
            x = x + self.proj(y)
            return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(T, C)
            self.blocks = nn.ModuleList([Block() for _ in range(L)])
            self.lnf = nn.LayerNorm(C)
            self.head = nn.Linear(C, V, bias=False)
            self.register_buffer("mask", torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1))
            self.register_buffer("pos", torch.arange(T))

        def forward(self, tokens, targets):
            x = self.wte(tokens) + self.wpe(self.pos)
            for b in self.blocks:
                x = b(x, self.mask)
            logits = self.head(self.lnf(x))
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    torch.manual_seed(1)
    model = Model().to(dev)
    for batch in [int(b) for b in args.batches.split(",") if b]:
        tokens = torch.randint(0, V, (batch, T), device=dev)
        targets = torch.randint(0, V, (batch, T), device=dev)
        times = []
        for i in range(args.warmup + args.iters):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.zero_grad(set_to_none=True)
            loss = model(tokens, targets)
            loss.backward()
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
        print(f"{batch} {statistics.median(times):.6f}", flush=True)
        print(f"torch {torch.__version__}: batch {batch}, loss {loss.item():.4f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
