#!/usr/bin/env python3
"""A GPT-style byte-level language model trained with Tandem's PyTorch front end.

Plain torch.nn: byte embeddings plus learned positions, pre-LayerNorm blocks of
causal self-attention (one qkv projection, the attention written out as
q.k, mask, softmax, att.v) and a GELU MLP, a final LayerNorm and a head (tied
to the byte embeddings with --tied). AdamW with no weight decay on biases,
LayerNorm parameters and embeddings; gradient clipping by the distributed
optimizer (max_grad_norm=); linear learning-rate warmup by a LambdaLR
scheduler.

Run it alone (one process, everything local):

    /usr/bin/python3 examples/torch/gpt.py --steps 100

or on a local Tandem cluster (the launcher passes --steps, --seed and --data to
the script through tt.config()):

    build/bin/tandem run --script examples/torch/gpt.py --nodes 2 --workers-per-node 2 \\
        --servers 2 --steps 50 -- --d-model 64

Every process seeds torch before building the model, so all start from the
same weights. Global sample i is the sequence at a position drawn from a
permutation of the corpus's positions (one permutation per pass over the
data, seeded by the seed), so N workers train on exactly the sequences one
process would.

Other scripts import the pieces: build_model(args), make_optimizer(model,
args), Data(args).batch(indices) -> (x, y), loss_fn(model, x, y),
add_arguments(parser) and resolve(args, cfg) (bench/torch_ddp.py does, to
train the same model with DistributedDataParallel).
"""

import argparse
import contextlib
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# The defaults of what the launcher may also set (tt.config()): a flag given
# to the script wins, then the launcher's value, then these.
DEFAULT_STEPS = 200
DEFAULT_GLOBAL_BATCH = 16
DEFAULT_SEED = 1
VOCAB = 256  # bytes


def import_tandem():
    """tandem.torch, from PYTHONPATH or else from this source tree's build/python."""
    try:
        import tandem.torch as tt
    except ImportError:
        build = os.environ.get("TANDEM_BUILD_DIR") or os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "..", "..", "build"
        )
        sys.path.insert(0, os.path.join(os.path.abspath(build), "python"))
        import tandem.torch as tt
    return tt


def add_arguments(p):
    g = p.add_argument_group("model")
    g.add_argument("--context", type=int, default=64, help="bytes per sequence (default 64)")
    g.add_argument("--d-model", type=int, default=128, help="width (default 128)")
    g.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    g.add_argument("--heads", type=int, default=4, help="attention heads; divides --d-model (default 4)")
    g.add_argument("--mlp-ratio", type=int, default=4, help="MLP width / d_model (default 4)")
    g.add_argument("--tied", action="store_true", help="tie the head to the byte embeddings")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=None, help=f"steps (default: the launcher's, else {DEFAULT_STEPS})")
    g.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help=f"sequences per step over all ranks (default: the launcher's, else {DEFAULT_GLOBAL_BATCH})",
    )
    g.add_argument("--accumulation", type=int, default=1, help="micro-batches per rank and step (default 1)")
    g.add_argument("--seed", type=int, default=None, help=f"seed (default: the launcher's, else {DEFAULT_SEED})")
    g.add_argument("--data", default=None, help="text file to train on (default: the launcher's, else Tandem's built-in corpus)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.999)
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay of the matrices (default 0.01)")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: off; default 1)")
    g.add_argument("--warmup-steps", type=int, default=10, help="linear learning-rate warmup (0: none; default 10)")
    g.add_argument("--threads", type=int, default=1, help="torch threads of each process (default 1)")
    g.add_argument("--log-every", type=int, default=10, help="rank 0 prints the loss every N steps (default 10)")
    return p


def resolve(args, cfg=None):
    """Fills what the command line left open from the launcher's config, then the defaults."""

    def pick(value, launcher, default):
        if value is not None:
            return value
        if launcher:
            return launcher
        return default

    args.steps = pick(args.steps, getattr(cfg, "steps", 0), DEFAULT_STEPS)
    args.global_batch = pick(args.global_batch, getattr(cfg, "global_batch", 0), DEFAULT_GLOBAL_BATCH)
    args.seed = pick(args.seed, getattr(cfg, "seed", 0), DEFAULT_SEED)
    args.data = pick(args.data, getattr(cfg, "data", ""), "")
    if args.d_model % args.heads != 0:
        raise SystemExit(f"--heads {args.heads} does not divide --d-model {args.d_model}")
    if min(args.steps, args.global_batch, args.context, args.layers, args.accumulation) < 1:
        raise SystemExit("--steps, --global-batch, --context, --layers and --accumulation must be at least 1")
    return args


class Block(nn.Module):
    def __init__(self, d_model, heads, mlp_ratio):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, mlp_ratio * d_model)
        self.fc_proj = nn.Linear(mlp_ratio * d_model, d_model)

    def forward(self, x, mask):
        B, T, C = x.shape
        H = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
        att = (att + mask[:T, :T]).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, context, d_model, layers, heads, mlp_ratio=4, tied=False, vocab=VOCAB):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList([Block(d_model, heads, mlp_ratio) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight
        # The causal mask, added to the attention scores: -inf above the
        # diagonal (float, not bool: gloo cannot broadcast bool buffers).
        mask = torch.full((context, context), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)
        # GPT-2's initialisation: N(0, 0.02), the projections into the
        # residual stream scaled down by sqrt(2 * layers).
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight",)) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln_f(x))


def build_model(args):
    """The model; seed torch first (main() does) so every process builds the same weights."""
    return GPT(args.context, args.d_model, args.layers, args.heads, args.mlp_ratio, args.tied)


def make_optimizer(model, args):
    """AdamW; biases, LayerNorm parameters and embeddings (so a tied head too) without weight decay."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, (nn.LayerNorm, nn.Embedding)) or name == "bias":
                no_decay.append(p)
            else:
                decay.append(p)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=1e-8)


def warmup_lambda(args):
    """The LambdaLR factor: linear warmup over --warmup-steps, then constant."""
    w = args.warmup_steps
    return lambda done: min(1.0, (done + 1) / w) if w > 0 else 1.0


def load_corpus(path):
    if path:
        with open(path, "rb") as f:
            return f.read()
    return import_tandem().builtin_corpus()


class Data:
    """Sequences of context + 1 bytes; global sample i is deterministic.

    There are len(corpus) - context sequences, one per start position. Pass
    e = i // size over the data takes the positions in the order of a
    permutation seeded by (seed, e).
    """

    def __init__(self, args, corpus=None):
        corpus = load_corpus(args.data) if corpus is None else corpus
        if len(corpus) <= args.context + 1:
            raise SystemExit(f"the corpus has {len(corpus)} bytes: fewer than --context + 2")
        self.tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        self.context = args.context
        self.size = len(corpus) - args.context
        self.seed = args.seed
        self._offsets = torch.arange(args.context + 1)
        self._perms = {}

    def _perm(self, epoch):
        perm = self._perms.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.size, generator=g)
            self._perms = {epoch: perm}  # keep one pass's permutation
        return perm

    def starts(self, indices):
        return torch.tensor([int(self._perm(i // self.size)[i % self.size]) for i in indices], dtype=torch.long)

    def batch(self, indices):
        """(x, y): inputs and next-byte targets, each [len(indices), context] int64."""
        seq = self.tokens[self.starts(indices)[:, None] + self._offsets]
        return seq[:, :-1], seq[:, 1:]


def loss_fn(model, x, y):
    """Mean cross-entropy of the next byte over the batch."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())  # shared (tied) parameters once


def micro_batches(indices, n):
    """`indices` (a range) split into n contiguous pieces, the empty ones left out."""
    n = max(1, min(n, len(indices)))
    q, r = divmod(len(indices), n)
    out, start = [], indices.start
    for k in range(n):
        size = q + (1 if k < r else 0)
        out.append(range(start, start + size))
        start += size
    return out


def train_step(model, opt, data, indices, accumulation):
    """Forward and backward of this rank's samples (accumulated over micro-batches
    without communication but for the last); returns this rank's mean loss."""
    if len(indices) == 0:  # more ranks than samples: zero gradients, but take part in the step
        sum(p.sum() for p in model.parameters() if p.requires_grad).mul(0.0).backward()
        return 0.0
    pieces = micro_batches(indices, accumulation)
    total = 0.0
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        with (contextlib.nullcontext() if last else opt.no_sync()):
            x, y = data.batch(piece)
            loss = loss_fn(model, x, y) * (len(piece) / len(indices))
            loss.backward()
        total += loss.item()
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_arguments(p).parse_args(argv)
    tt = import_tandem()
    tt.init()
    resolve(args, tt.config())
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_model(args)
    data = Data(args, tt.builtin_corpus() if not args.data else None)
    opt = tt.DistributedOptimizer(
        make_optimizer(model, args),
        named_parameters=model.named_parameters(),
        max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(args))
    started = time.perf_counter()
    for plan in tt.steps(args.steps, args.global_batch):
        if plan.step == 1 and plan.rank == 0:
            print(
                f"gpt: {count_parameters(model) / 1e6:.2f}M parameters ({args.layers} layers, d_model {args.d_model}, "
                f"context {args.context}), {plan.world_size} rank(s), global batch {args.global_batch}, "
                f"{args.steps} steps",
                flush=True,
            )
        idx = plan.samples
        opt.zero_grad()
        loss = train_step(model, opt, data, idx, args.accumulation)
        # This rank's figures; tandem.torch sums them over the ranks for the
        # progress line, the metrics and `tandem run`'s summary.
        tt.report(loss=loss, samples=len(idx), tokens=len(idx) * args.context)
        opt.step()
        scheduler.step()
        if plan.rank == 0 and (plan.step == 1 or plan.step % args.log_every == 0 or plan.step == args.steps):
            print(
                f"step {plan.step:5d}/{args.steps}  loss {loss:.4f}  lr {scheduler.get_last_lr()[0]:.2e}  "
                f"{time.perf_counter() - started:.1f} s",
                flush=True,
            )
    tt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
