#!/usr/bin/env python3
"""A small MLP classifier trained with Tandem's PyTorch front end.

The data set is synthetic and deterministic (no downloads): --samples points
x ~ N(0, I) in --inputs dimensions, labelled by the arg max of a fixed random
"teacher" network's --classes outputs, all generated from --data-seed. The
student is an MLP with --hidden units in each of --depth hidden layers (ReLU),
trained with SGD and momentum on the mean cross-entropy.

    /usr/bin/python3 examples/torch/mlp.py --steps 200
    build/bin/tandem run --script examples/torch/mlp.py --nodes 2 --workers-per-node 2 --servers 2 \\
        --steps 100 -- --hidden 256

Global sample i is data point i mod --samples, so N workers train on exactly
the points one process would. Every process seeds torch with the seed before
building the model, so all start from the same weights.

Other scripts import the pieces: build_model(args), make_optimizer(model,
args), Data(args).batch(indices) -> (x, y), loss_fn(model, x, y),
add_arguments(parser) and resolve(args, cfg).
"""

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULT_STEPS = 200
DEFAULT_GLOBAL_BATCH = 64
DEFAULT_SEED = 1


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
    g = p.add_argument_group("data and model")
    g.add_argument("--samples", type=int, default=16384, help="data points (default 16384)")
    g.add_argument("--inputs", type=int, default=32, help="input dimensions (default 32)")
    g.add_argument("--classes", type=int, default=10, help="classes (default 10)")
    g.add_argument("--data-seed", type=int, default=7, help="seed of the data set and its teacher (default 7)")
    g.add_argument("--hidden", type=int, default=256, help="units of each hidden layer (default 256)")
    g.add_argument("--depth", type=int, default=2, help="hidden layers (default 2)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=None, help=f"steps (default: the launcher's, else {DEFAULT_STEPS})")
    g.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help=f"samples per step over all ranks (default: the launcher's, else {DEFAULT_GLOBAL_BATCH})",
    )
    g.add_argument("--accumulation", type=int, default=1, help="micro-batches per rank and step (default 1)")
    g.add_argument("--seed", type=int, default=None, help=f"seed of the model (default: the launcher's, else {DEFAULT_SEED})")
    g.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (default 0)")
    g.add_argument("--max-grad-norm", type=float, default=0.0, help="clip the global gradient norm (0: off; default)")
    g.add_argument("--threads", type=int, default=1, help="torch threads of each process (default 1)")
    g.add_argument("--log-every", type=int, default=20, help="rank 0 prints the loss every N steps (default 20)")
    return p


def resolve(args, cfg=None):
    """Fills what the command line left open from the launcher's config, then the defaults."""

    def pick(value, launcher, default):
        return value if value is not None else (launcher or default)

    args.steps = pick(args.steps, getattr(cfg, "steps", 0), DEFAULT_STEPS)
    args.global_batch = pick(args.global_batch, getattr(cfg, "global_batch", 0), DEFAULT_GLOBAL_BATCH)
    args.seed = pick(args.seed, getattr(cfg, "seed", 0), DEFAULT_SEED)
    args.context = 1  # one "token" per sample, for tokens/s
    if min(args.steps, args.global_batch, args.samples, args.inputs, args.classes, args.hidden, args.accumulation) < 1:
        raise SystemExit("--steps, --global-batch, --samples, --inputs, --classes, --hidden and --accumulation must be >= 1")
    return args


class MLP(nn.Module):
    def __init__(self, inputs, hidden, depth, classes):
        super().__init__()
        layers, width = [], inputs
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def build_model(args):
    """The model; seed torch first (main() does) so every process builds the same weights."""
    return MLP(args.inputs, args.hidden, args.depth, args.classes)


def make_optimizer(model, args):
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


class Data:
    """--samples points and their teacher's labels, generated from --data-seed."""

    def __init__(self, args):
        g = torch.Generator().manual_seed(args.data_seed)
        self.x = torch.randn(args.samples, args.inputs, generator=g)
        w1 = torch.randn(args.inputs, 64, generator=g) / args.inputs**0.5
        w2 = torch.randn(64, args.classes, generator=g) / 8.0
        self.y = (torch.tanh(self.x @ w1) @ w2).argmax(dim=1)
        self.size = args.samples

    def batch(self, indices):
        """(x, y): [len(indices), inputs] float32 and [len(indices)] int64 labels."""
        i = torch.tensor([j % self.size for j in indices], dtype=torch.long)
        return self.x[i], self.y[i]


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


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
    """Forward and backward of this rank's samples; returns (mean loss, correct predictions)."""
    if len(indices) == 0:  # more ranks than samples: zero gradients, but take part in the step
        sum(p.sum() for p in model.parameters()).mul(0.0).backward()
        return 0.0, 0
    pieces = micro_batches(indices, accumulation)
    total, correct = 0.0, 0
    for k, piece in enumerate(pieces):
        with (contextlib.nullcontext() if k == len(pieces) - 1 else opt.no_sync()):
            x, y = data.batch(piece)
            logits = model(x)
            loss = F.cross_entropy(logits, y) * (len(piece) / len(indices))
            loss.backward()
        total += loss.item()
        correct += int((logits.argmax(dim=1) == y).sum())
    return total, correct


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_arguments(p).parse_args(argv)
    tt = import_tandem()
    tt.init()
    resolve(args, tt.config())
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_model(args)
    data = Data(args)
    opt = tt.DistributedOptimizer(
        make_optimizer(model, args),
        named_parameters=model.named_parameters(),
        max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None,
    )
    started = time.perf_counter()
    for plan in tt.steps(args.steps, args.global_batch):
        if plan.step == 1 and plan.rank == 0:
            print(
                f"mlp: {count_parameters(model) / 1e6:.3f}M parameters ({args.depth} x {args.hidden} hidden), "
                f"{plan.world_size} rank(s), global batch {args.global_batch}, {args.steps} steps",
                flush=True,
            )
        idx = plan.samples
        opt.zero_grad()
        loss, correct = train_step(model, opt, data, idx, args.accumulation)
        # This rank's figures; tandem.torch sums them over the ranks for the
        # progress line, the metrics and `tandem run`'s summary.
        tt.report(loss=loss, samples=len(idx), tokens=len(idx))
        opt.step()
        if plan.rank == 0 and (plan.step == 1 or plan.step % args.log_every == 0 or plan.step == args.steps):
            acc = correct / len(idx) if len(idx) else 0.0
            print(
                f"step {plan.step:5d}/{args.steps}  loss {loss:.4f}  batch accuracy {acc:.2f}  "
                f"{time.perf_counter() - started:.1f} s",
                flush=True,
            )
    tt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
