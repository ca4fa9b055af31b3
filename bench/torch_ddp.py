#!/usr/bin/env python3
"""PyTorch DistributedDataParallel baseline of `tandem bench torch` (bench/torch_bench.py).

Trains one of the examples in examples/torch/ (their build_model,
make_optimizer, Data and loss_fn) with torch's own DistributedDataParallel
over the gloo backend, exactly as Tandem trains it: the same global batch
split contiguously over the ranks (global samples [(s-1)*B, s*B) in step s),
the same seed, optimizer, gradient clipping, learning-rate warmup and
micro-batches (DDP's no_sync for all but the last), fp32 gradients. DDP runs
with its defaults (25 MiB buckets: --bucket-cap-mb) but for
broadcast_buffers=False: the models' only buffer is a constant mask.

    /usr/bin/python3 bench/torch_ddp.py --example examples/torch/gpt.py --nprocs 4 -- --steps 40 --d-model 64

Without RANK in its environment it is the launcher: it starts --nprocs copies
of itself through env:// (MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK; not torch.distributed.run, which fails under Python
3.11 with torch 1.13), each pinned to its share of this process's CPUs the
way `tandem run` pins its workers (cli/local_cluster.cc: ShareOfCpus), waits
for them and prints rank 0's result as one JSON line: tokens_per_second
(tokens of the global batch over steps 2..N divided by the wall time from the
end of step 1 to the end of step N, as Tandem's summary measures it),
step_seconds_median, first_loss, last_loss, parameters, world_size, steps.
"""

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def share_of_cpus(allowed, index, count):
    """cli/local_cluster.cc's ShareOfCpus (common/cpus.cc): a contiguous block of
    the allowed CPUs per process (the first len % count get one more), or one
    CPU round robin when there are fewer CPUs than processes."""
    allowed = sorted(allowed)
    n = len(allowed)
    if n == 0 or count <= 0 or index < 0:
        return []
    i = index % count
    if n < count:
        return [allowed[index % n]]
    base, extra = divmod(n, count)
    begin = i * base + min(i, extra)
    size = base + (1 if i < extra else 0)
    return allowed[begin : begin + size]


def rank_samples(step, global_batch, rank, world_size):
    """This rank's global sample indices in `step` (1-based): its contiguous piece of
    [(step-1)*B, step*B), as tandem.torch's Plan.samples splits it."""
    first = (step - 1) * global_batch
    return range(first + global_batch * rank // world_size, first + global_batch * (rank + 1) // world_size)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_example(path):
    path = os.path.abspath(path)
    spec = importlib.util.spec_from_file_location("tandem_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(path))
    spec.loader.exec_module(module)
    return module


def worker(opts, example_args):
    """One DDP rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set)."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    ex = load_example(opts.example)
    args = ex.add_arguments(argparse.ArgumentParser()).parse_args(example_args)
    ex.resolve(args, None)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = ex.build_model(args)
    # The models' only buffers are constants (the causal mask): no need to
    # broadcast them before every forward.
    ddp = DDP(model, broadcast_buffers=False, bucket_cap_mb=opts.bucket_cap_mb)
    opt = ex.make_optimizer(model, args)
    warmup = getattr(ex, "warmup_lambda", None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup(args)) if warmup else None
    data = ex.Data(args)
    params = [p for p in model.parameters() if p.requires_grad]
    ends, step_s, losses = [], [], []
    dist.barrier()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        idx = rank_samples(step, args.global_batch, rank, world)
        opt.zero_grad(set_to_none=True)
        pieces = ex.micro_batches(idx, args.accumulation) if len(idx) else []
        loss_sum = 0.0
        if not pieces:  # more ranks than samples: zero gradients, but take part
            loss = sum(p.sum() for p in params).mul(0.0)
            loss.backward()
        for k, piece in enumerate(pieces):
            with (contextlib.nullcontext() if k == len(pieces) - 1 else ddp.no_sync()):
                x, y = data.batch(piece)
                loss = ex.loss_fn(ddp, x, y) * (len(piece) / len(idx))
                loss.backward()
            loss_sum += loss.item()
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        t1 = time.perf_counter()
        ends.append(t1)
        step_s.append(t1 - t0)
        losses.append(loss_sum)
    # The mean loss over the ranks, weighted by their samples.
    mean = torch.tensor(losses, dtype=torch.float64) * len(rank_samples(1, args.global_batch, rank, world))
    dist.all_reduce(mean)
    mean /= args.global_batch
    if rank == 0:
        wall = ends[-1] - ends[0]
        tokens = (args.steps - 1) * args.global_batch * args.context
        result = {
            "tokens_per_second": tokens / wall if wall > 0 and args.steps > 1 else None,
            "step_seconds_median": statistics.median(step_s[1:] or step_s),
            "first_loss": float(mean[0]),
            "last_loss": float(mean[-1]),
            "parameters": sum(p.numel() for p in model.parameters()),
            "world_size": world,
            "steps": args.steps,
            "global_batch": args.global_batch,
            "torch": torch.__version__,
        }
        with open(opts.result, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def launch(opts, example_args):
    """Starts --nprocs ranks, waits, prints rank 0's result; the exit status is the first failure's."""
    allowed = sorted(os.sched_getaffinity(0))
    port = opts.master_port or free_port()
    with tempfile.TemporaryDirectory(prefix="tandem-ddp-") as tmp:
        result = os.path.join(tmp, "result.json")
        procs = []
        for rank in range(opts.nprocs):
            env = dict(os.environ)
            env.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(opts.nprocs),
                LOCAL_RANK=str(rank % opts.workers_per_node),
                GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"),
                OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
            )
            cpus = share_of_cpus(allowed, rank, opts.nprocs) if opts.bind else []
            cmd = [sys.executable, os.path.abspath(__file__), "--example", opts.example, "--result", result,
                   "--bucket-cap-mb", str(opts.bucket_cap_mb), "--"]
            log = open(os.path.join(tmp, f"rank-{rank}.log"), "w+")
            procs.append(
                (
                    subprocess.Popen(
                        cmd + example_args,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        preexec_fn=(lambda c=cpus: os.sched_setaffinity(0, c)) if cpus else None,
                    ),
                    log,
                )
            )
        deadline = time.monotonic() + opts.timeout
        failed = None
        try:
            while any(p.poll() is None for p, _ in procs):
                bad = [(r, p.returncode) for r, (p, _) in enumerate(procs) if p.returncode not in (None, 0)]
                if bad or time.monotonic() > deadline:
                    failed = bad[0] if bad else ("all", "timeout")
                    break
                time.sleep(0.05)
            if failed is None:
                bad = [(r, p.returncode) for r, (p, _) in enumerate(procs) if p.returncode != 0]
                failed = bad[0] if bad else None
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p, _ in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if failed is not None or not os.path.exists(result):
            rank = failed[0] if failed else 0
            log = procs[rank if isinstance(rank, int) else 0][1]
            log.seek(0)
            tail = log.read()[-3000:]
            print(
                f"torch_ddp: rank {rank} failed ({failed[1] if failed else 'no result'}); its log ends:\n{tail}",
                file=sys.stderr,
            )
            return 1
        with open(result) as f:
            out = json.load(f)
        out["cpus"] = [share_of_cpus(allowed, r, opts.nprocs) for r in range(opts.nprocs)] if opts.bind else None
        print(json.dumps(out), flush=True)
        return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        cut = argv.index("--")
        argv, example_args = argv[:cut], argv[cut + 1 :]
    else:
        example_args = []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--example", required=True, help="the example script (examples/torch/gpt.py)")
    p.add_argument("--nprocs", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--workers-per-node", type=int, default=2, help="ranks per simulated node, for LOCAL_RANK (default 2)")
    p.add_argument("--master-port", type=int, default=0, help="rendezvous port (default: a free one)")
    p.add_argument("--bind", type=int, default=1, choices=(0, 1), help="pin each rank to its share of the CPUs (default 1)")
    p.add_argument("--bucket-cap-mb", type=float, default=25,
                   help="DistributedDataParallel's gradient bucket size in MiB (default 25, torch's default)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before giving up (default 900)")
    p.add_argument("--result", help=argparse.SUPPRESS)  # set for the ranks
    opts = p.parse_args(argv)
    if "RANK" in os.environ and opts.result:
        return worker(opts, example_args)
    if opts.nprocs < 1 or opts.workers_per_node < 1:
        p.error("--nprocs and --workers-per-node must be at least 1")
    return launch(opts, example_args)


if __name__ == "__main__":
    sys.exit(main())
