"""The training script of the PyTorch front end's tests (tests/python/torch_test.py).

A small tanh MLP regression on deterministic data, trained through
tandem.torch; run alone it trains the unwrapped torch optimizer in one
process, under `tandem run --script` it is a worker. Writes the final
parameters (rank 0, or alone) to --out as raw fp32 in named_parameters order.

  --optimizer sgd|adamw|rmsprop   SGD with momentum 0.9 and Nesterov, AdamW with a
                                  no-decay group (biases) at twice the lr, or RMSprop
  --schedule                      a LambdaLR warmup stepping the wrapped optimizer
  --decay                         with --schedule: the lr also decays by 10% every step after it
  --fail-at STEP                  raise ValueError on rank 1 at that step
  --bad NAME                      a bad input (see the --bad cases in main)
  --step-sleep S                  sleep S seconds in every step (membership changes land mid-run)
  --losses FILE                   alone: write the loss of every step to FILE (a JSON list)
  --load-params FILE              start from these parameters (raw fp32, as --out writes them)
  --load-state FILE               opt.load_state_dict(torch.load(FILE)) before the first step
  --save-state FILE               alone: torch.save(opt.state_dict(), FILE) after the last step
  --first-sample N                the loop's sample indices start at N (a run that continues another)
  --report-first                  tt.report() before opt.step() (default: after it)
  --hidden N                      the hidden layer's width (default 16; wider makes many buckets
                                  with small partitions, so parameters land during the next forward)
"""
import argparse
import json
import os
import sys
import time

import torch

import tandem.torch as tt

DIM, OUT = 8, 4


def sample(i):
    g = torch.Generator().manual_seed(1000003 * (i + 1))
    x = torch.randn(DIM, generator=g)
    y = torch.stack([torch.sin(x[:4].sum()), torch.cos(x[4:].sum()), x[0] * x[1], torch.tanh(x).mean()])
    return x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--schedule", action="store_true")
    ap.add_argument("--decay", action="store_true")
    ap.add_argument("--fail-at", type=int, default=0)
    ap.add_argument("--bad", default="")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--mode", default=None)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--report-first", action="store_true")
    ap.add_argument("--losses", default="")
    ap.add_argument("--load-params", default="")
    ap.add_argument("--load-state", default="")
    ap.add_argument("--save-state", default="")
    ap.add_argument("--first-sample", type=int, default=0)
    args = ap.parse_args()

    cfg = tt.init()
    steps = args.steps or cfg.steps or 8
    batch = args.batch or cfg.global_batch or 16
    torch.manual_seed(7)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, OUT))
    if args.bad == "fp64":
        model = model.double()
    if args.bad == "noncontiguous":
        model[0].weight.data = model[0].weight.data.t().contiguous().t()
    if args.load_params:
        with open(args.load_params, "rb") as f:
            flat = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
        torch.nn.utils.vector_to_parameters(flat, model.parameters())
    root = model
    if args.bad == "unused":
        # A parameter the forward never uses.
        root = torch.nn.Module()
        root.net = model
        root.extra = torch.nn.Linear(2, 2)
    named = list(root.named_parameters())
    decay = [p for n, p in named if n.endswith("weight")]
    no_decay = [p for n, p in named if not n.endswith("weight")]
    if args.optimizer == "sgd":
        inner = torch.optim.SGD(root.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    elif args.optimizer == "adamw":
        inner = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-2}],
            lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
        )
    elif args.optimizer == "rmsprop":
        inner = torch.optim.RMSprop(model.parameters(), lr=1e-2)
    elif args.optimizer == "amsgrad":
        inner = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    elif args.optimizer == "betas":
        inner = torch.optim.Adam(
            [{"params": decay}, {"params": no_decay, "betas": (0.8, 0.9)}], lr=1e-2)
    else:
        raise SystemExit(f"unknown --optimizer {args.optimizer}")
    opt = tt.DistributedOptimizer(inner, named_parameters=root.named_parameters(), mode=args.mode)
    sched = None
    if args.schedule:
        decay = 0.9 if args.decay else 1.0
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * decay ** max(0, s - 3))
    if args.load_state:
        opt.load_state_dict(torch.load(args.load_state))
    if args.bad == "resize":
        model[2].bias.data = torch.zeros(OUT)
    if args.bad == "add_group":
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})

    losses = []
    for plan in tt.steps(steps, batch):
        if args.fail_at and plan.step == args.fail_at and plan.rank == 1:
            raise ValueError(f"the test script fails at step {plan.step} on purpose")
        idx = [args.first_sample + i for i in plan.samples]
        time.sleep(args.step_sleep)
        opt.zero_grad()
        micro = [idx[k::args.accumulate] for k in range(args.accumulate)]
        total_loss = 0.0
        if args.bad == "nan" and plan.step == 2:
            idx = []
        for k, part in enumerate(micro):
            xs, ys = zip(*(sample(i) for i in part))
            x, y = torch.stack(xs), torch.stack(ys)
            if args.bad == "outside":
                # The parameters read in a forward of their own instead of their modules'.
                h = torch.tanh(torch.nn.functional.linear(x, model[0].weight, model[0].bias))
                pred = torch.nn.functional.linear(h, model[2].weight, model[2].bias)
            else:
                pred = model(x)
            loss = torch.nn.functional.mse_loss(pred, y, reduction="sum") / (len(idx) * OUT)
            if args.bad == "nan" and plan.step == 2:
                loss = loss * float("nan")
            ctx = opt.no_sync() if k < len(micro) - 1 else _nullcontext()
            with ctx:
                loss.backward()
                if args.bad == "twice" and k == len(micro) - 1:
                    loss2 = torch.nn.functional.mse_loss(model(x), y)
                    loss2.backward()
            total_loss += loss.item()
        if args.bad == "skip_backward_rank1" and plan.rank == 1:
            pass
        if args.report_first:
            tt.report(loss=total_loss, samples=len(idx))
        opt.step()
        if sched is not None:
            sched.step()
        if not args.report_first:
            tt.report(loss=total_loss, samples=len(idx))
        losses.append(total_loss)
    if args.save_state and not tt.is_distributed():
        torch.save(opt.state_dict(), args.save_state)
    if args.losses and not tt.is_distributed():
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    if args.out and tt.rank() == 0:
        with open(args.out + ".tmp", "wb") as f:
            f.write(opt._flat_params.numpy().tobytes())
        os.replace(args.out + ".tmp", args.out)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
