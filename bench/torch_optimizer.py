#!/usr/bin/env python3
"""The PyTorch baseline of `tandem bench optimizer` (cli/bench_optimizer.cc).

Times torch.optim.AdamW / Adam / SGD with foreach=True (the multi-tensor
path) on one flat fp32 parameter of each size, as a parameter-server
partition holds it, with the same hyperparameters and thread count as the
Tandem side (torch.set_num_threads). Prints one JSON object per size on
stdout:

  {"available": true, "torch_version": "...", "optimizer": "adamw",
   "params": N, "threads": T, "iters": I, "seconds_per_step": median,
   "best_seconds_per_step": min}

or, when torch cannot be imported, one line {"available": false, "reason":
"..."} and exit status 0, so the caller reports torch as unavailable.
Progress goes to stderr.
"""

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizer", choices=["adamw", "adam", "sgd"], default="adamw")
    p.add_argument("--params", default="1000000", help="comma-separated parameter counts")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--iters", type=int, default=10, help="timed steps per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per size (the first creates the state)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.01)
    args = p.parse_args()

    try:
        import torch
    except Exception as e:  # ImportError, or a broken installation
        print(json.dumps({"available": False, "reason": f"{sys.executable} cannot import torch: {e}"}), flush=True)
        return 0

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for n in [int(x) for x in args.params.split(",") if x]:
        param = torch.nn.Parameter(torch.randn(n, dtype=torch.float32))
        param.grad = torch.randn(n, dtype=torch.float32)
        if args.optimizer == "sgd":
            opt = torch.optim.SGD([param], lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                                  foreach=True)
        else:
            cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
            opt = cls([param], lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                      weight_decay=args.weight_decay, foreach=True)
        print(f"torch_optimizer: {args.optimizer}, {n} params, {torch.get_num_threads()} threads, "
              f"{args.warmup} + {args.iters} steps", file=sys.stderr, flush=True)
        for _ in range(args.warmup):
            opt.step()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        print(json.dumps({
            "available": True,
            "torch_version": torch.__version__,
            "optimizer": args.optimizer,
            "params": n,
            "threads": torch.get_num_threads(),
            "iters": args.iters,
            "seconds_per_step": statistics.median(times),
            "best_seconds_per_step": min(times),
        }), flush=True)
        del opt, param
    return 0


if __name__ == "__main__":
    sys.exit(main())
