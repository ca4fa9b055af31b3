#!/usr/bin/env python3
"""`tandem bench torch`: a PyTorch model trained by Tandem beside DistributedDataParallel.

For each config (a model of examples/torch/ and its flags) and each round, it
trains the model with torch's DistributedDataParallel over gloo
(bench/torch_ddp.py) and then with Tandem in each --modes
(`tandem run --script ... --summary FILE`), all with the same number of
processes (--nodes x --workers-per-node ranks), global batch, steps, seed,
optimizer (AdamW), gradient clipping and fp32 gradients, each rank pinned to
the same share of the CPUs (Tandem's servers run on the same cores, unpinned).
The runs alternate (DDP, hybrid, allreduce, ps, DDP, hybrid, ...) for
--rounds rounds; a row reports the medians over the rounds of Tandem's and
DDP's tokens/s (tokens of the global batch over steps 2..N divided by the wall
time from the end of step 1 to the end of step N, on both sides), their ratio
and Tandem's exposed-communication fraction (its summary's
exposed_comm_fraction).

Configs:
  default     examples/torch/gpt.py at its defaults: 4 layers, d_model 128,
              4 heads, context 64, global batch 16 (0.87 M parameters)
  comm-heavy  examples/torch/gpt.py with d_model 256, context 8, global batch 8
              (3.29 M parameters, 64 tokens per step): many parameters per unit
              of compute, so the step is mostly communication and optimizer
  all         both

Usually run through `tandem bench torch`, which passes --bin-dir. Arguments
after `--` go to the example on both sides (after the config's own).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(HERE)
EXAMPLES = os.path.join(SOURCE, "examples", "torch")
MODES = ("hybrid", "allreduce", "ps")

# name -> (model, example script, its flags, global batch, description)
CONFIGS = {
    "default": ("gpt", "gpt.py", [], 16, "gpt.py at its defaults: 4 layers, d_model 128, 4 heads, context 64"),
    "comm-heavy": (
        "gpt",
        "gpt.py",
        ["--d-model", "256", "--context", "8"],
        8,
        "gpt.py --d-model 256 --context 8: 4 layers, 4 heads",
    ),
}

# The keys of one JSON row, in order (tests/bench_torch_test.py checks them).
ROW_KEYS = (
    "config",
    "model",
    "parameters",
    "mode",
    "workers",
    "servers",
    "tandem_tokens_per_second",
    "ddp_tokens_per_second",
    "ratio",
    "round_ratio",
    "exposed_comm_fraction",
    "tandem_step_ms",
    "tandem_compute_ms",
    "ddp_step_ms",
    "tandem_last_loss",
    "ddp_last_loss",
    "tandem_runs",
    "ddp_runs",
    "failures",
    "ddp_bucket_cap_mb",
    "steps",
    "rounds",
    "cpu",
)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def parse_args(argv):
    argv = list(argv)
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        prog="tandem bench torch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--bin-dir", default=os.path.join(SOURCE, "build", "bin"), help="where `tandem` is (default %(default)s)")
    p.add_argument("--config", default="all", choices=list(CONFIGS) + ["all"], help="what to train (default all)")
    p.add_argument("--global-batch", type=int, default=0, help="sequences per step (default: the config's)")
    p.add_argument("--modes", default=",".join(MODES), help="Tandem's modes, comma-separated (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; rows show the medians (default 3)")
    p.add_argument("--steps", type=int, default=40, help="training steps of every run (tokens/s over 2..N; default 40)")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    p.add_argument("--workers-per-node", type=int, default=2, help="workers on each node (default 2)")
    p.add_argument("--servers", type=int, default=2, help="Tandem's parameter servers (hybrid and ps; default 2)")
    p.add_argument("--network", default="loopback", choices=("auto", "netns", "loopback"),
                   help="tandem run --network (default loopback, as gloo's DDP runs on loopback)")
    p.add_argument("--bind", type=int, default=1, choices=(0, 1), help="pin ranks to their share of the CPUs (default 1)")
    p.add_argument("--ddp-bucket-mb", type=float, default=25,
                   help="DistributedDataParallel's bucket_cap_mb (default 25, torch's default)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    p.add_argument("--json", action="store_true", help="one JSON object per config and mode instead of the table")
    p.add_argument("--dry-run", action="store_true", help="print the commands of one round and exit")
    p.add_argument("--verbose", action="store_true", help="progress of each run on stderr")
    args = p.parse_args(argv)
    args.extra = extra
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in MODES:
            p.error(f"--modes: '{m}' is not one of {', '.join(MODES)}")
    if args.global_batch < 0 or args.rounds < 1 or args.steps < 2 or args.nodes < 1 or args.workers_per_node < 1 or args.servers < 1:
        p.error("--rounds, --nodes, --workers-per-node and --servers must be at least 1, --steps at least 2")
    args.configs = list(CONFIGS) if args.config == "all" else [args.config]
    return args


def global_batch(args, config):
    return args.global_batch or CONFIGS[config][3]


def example_args(args, config):
    flags = CONFIGS[config][2]
    return ["--steps", str(args.steps), "--global-batch", str(global_batch(args, config))] + flags + args.extra


def ddp_command(args, config):
    script = os.path.join(EXAMPLES, CONFIGS[config][1])
    return [
        sys.executable,
        os.path.join(HERE, "torch_ddp.py"),
        "--example",
        script,
        "--nprocs",
        str(args.nodes * args.workers_per_node),
        "--workers-per-node",
        str(args.workers_per_node),
        "--bind",
        str(args.bind),
        "--timeout",
        str(args.timeout),
        "--bucket-cap-mb",
        f"{args.ddp_bucket_mb:g}",
        "--",
    ] + example_args(args, config)


def tandem_command(args, config, mode, summary):
    script = os.path.join(EXAMPLES, CONFIGS[config][1])
    cmd = [
        os.path.join(args.bin_dir, "tandem"),
        "run",
        "--script",
        script,
        "--python",
        sys.executable,
        "--mode",
        mode,
        "--nodes",
        str(args.nodes),
        "--workers-per-node",
        str(args.workers_per_node),
        "--steps",
        str(args.steps),
        "--train-global-batch",
        str(global_batch(args, config)),
        "--network",
        args.network,
        "--bind=" + ("true" if args.bind else "false"),
        "--summary",
        summary,
    ]
    if mode != "allreduce":
        cmd += ["--servers", str(args.servers)]
    return cmd + ["--"] + example_args(args, config)


def child_env(args):
    """The ranks import tandem (the built-in corpus) from the build tree's python/."""
    env = dict(os.environ)
    py = os.path.join(os.path.dirname(os.path.abspath(args.bin_dir)), "python")
    env["PYTHONPATH"] = py + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run(cmd, args, timeout):
    """(returncode, stdout, stderr); stderr goes through with --verbose."""
    try:
        p = subprocess.run(
            cmd,
            env=child_env(args),
            stdout=subprocess.PIPE,
            stderr=None if args.verbose else subprocess.PIPE,
            text=True,
            timeout=timeout,
        )
        return p.returncode, p.stdout, p.stderr or ""
    except subprocess.TimeoutExpired as e:
        return 124, e.stdout or "", f"timed out after {timeout:.0f} s"
    except OSError as e:
        return 127, "", f"cannot run {cmd[0]}: {e}"


def tail(text, lines=15):
    return "\n".join(text.strip().splitlines()[-lines:])


def measure_ddp(args, config):
    rc, out, err = run(ddp_command(args, config), args, args.timeout + 60)
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                r = json.loads(line)
            except ValueError:
                break
            if rc == 0 and r.get("tokens_per_second"):
                return r, None
    return None, f"DDP exited with {rc}: {tail(err or out)}"


def measure_tandem(args, config, mode):
    with tempfile.TemporaryDirectory(prefix="tandem-bench-torch-") as tmp:
        summary = os.path.join(tmp, "summary.json")
        rc, out, err = run(tandem_command(args, config, mode, summary), args, args.timeout + 120)
        s = None
        if os.path.exists(summary):
            try:
                with open(summary) as f:
                    s = json.load(f)
            except ValueError:
                s = None
    if s is None or not s.get("tokens_per_second") or (s.get("steps") or 0) < args.steps:
        why = (s or {}).get("failure") or tail(err or out)
        return None, f"tandem run --mode {mode} exited with {rc}: {why}"
    if rc != 0 or not s.get("completed", True):
        # Every step trained, but the end was not clean: the figures stand.
        print(f"tandem bench torch: tandem run --mode {mode} trained all {args.steps} steps but exited with {rc}: "
              f"{s.get('failure')}", file=sys.stderr, flush=True)
    return s, None


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def exposed(summary):
    v = summary.get("exposed_comm_fraction")
    return summary.get("exposed_fraction") if v is None else v


def make_rows(config, args, ddp_runs, tandem_runs, failures, cpu):
    """One row per mode: medians over the rounds. ddp_runs: [result dict or None (failed)],
    one per round; tandem_runs: {mode: [summary dict or None]} likewise; failures:
    {'ddp' or mode: count}. `ratio` is the median of Tandem's over the median of DDP's;
    `round_ratio` the median over the rounds of each round's Tandem / DDP (drift of the
    machine's speed between rounds cancels in it)."""
    model = CONFIGS[config][0]
    ddp_ok = [r for r in ddp_runs if r]
    ddp_tps = median([r["tokens_per_second"] for r in ddp_ok])
    ddp_step = median([r.get("step_seconds_median") for r in ddp_ok])
    params = next((r.get("parameters") for r in ddp_ok if r.get("parameters")), None)
    rows = []
    for mode in args.modes:
        all_runs = tandem_runs.get(mode, [])
        runs = [s for s in all_runs if s]
        tps = median([s["tokens_per_second"] for s in runs])
        step = median([s.get("step_seconds_median") for s in runs])
        compute = median([s.get("compute_seconds_median") for s in runs])
        per_round = [t["tokens_per_second"] / d["tokens_per_second"] for t, d in zip(all_runs, ddp_runs) if t and d]
        if params is None:
            params = next((s.get("parameters") for s in runs if s.get("parameters")), None)
        row = {
            "config": config,
            "model": model,
            "parameters": params,
            "mode": mode,
            "workers": args.nodes * args.workers_per_node,
            "servers": 0 if mode == "allreduce" else args.servers,
            "tandem_tokens_per_second": tps,
            "ddp_tokens_per_second": ddp_tps,
            "ratio": tps / ddp_tps if tps and ddp_tps else None,
            "round_ratio": median(per_round),
            "exposed_comm_fraction": median([exposed(s) for s in runs]),
            "tandem_step_ms": step * 1e3 if step is not None else None,
            "tandem_compute_ms": compute * 1e3 if compute is not None else None,
            "ddp_step_ms": ddp_step * 1e3 if ddp_step is not None else None,
            "tandem_last_loss": median([s.get("last_loss") for s in runs]),
            "ddp_last_loss": median([r.get("last_loss") for r in ddp_ok]),
            "tandem_runs": [s["tokens_per_second"] if s else None for s in all_runs],
            "ddp_runs": [r["tokens_per_second"] if r else None for r in ddp_runs],
            "failures": failures.get(mode, 0) + failures.get("ddp", 0),
            "ddp_bucket_cap_mb": args.ddp_bucket_mb,
            "steps": args.steps,
            "rounds": args.rounds,
            "cpu": cpu,
        }
        rows.append({k: row[k] for k in ROW_KEYS})
    return rows


def _round(v, digits):
    if isinstance(v, float):
        return float(f"{v:.{digits}g}")
    if isinstance(v, list):
        return [_round(x, digits) for x in v]
    return v


def format_json(row):
    return json.dumps({k: _round(v, 6) for k, v in row.items()})


def table_header(args, config, cpu):
    return (
        f"# tandem bench torch: config {config} ({CONFIGS[config][4]}, global batch {global_batch(args, config)}"
        + (f", plus {' '.join(args.extra)}" if args.extra else "")
        + f"); {args.nodes} node(s) x {args.workers_per_node} worker(s), {args.servers} server(s), {args.steps} steps, "
        f"median of {args.rounds} round(s); DDP buckets {args.ddp_bucket_mb:g} MiB; CPU {cpu}, "
        f"{len(os.sched_getaffinity(0))} CPUs\n"
        "# tokens/s: the global batch's tokens over steps 2..N, both sides; ratio: Tandem's median over DDP's median;\n"
        "# rounds: the median of each round's ratio; exposed: share of Tandem's step time waiting for communication;\n"
        "# step, compute: Tandem's median step and step less exposed communication (forward, backward and, in\n"
        "# allreduce mode, the local optimizer); DDP ms: DDP's median step; loss: the last step's\n"
        f"{'mode':<10} {'params':>7} {'workers':>7} {'servers':>7} {'tandem tok/s':>12} {'DDP tok/s':>10} "
        f"{'ratio':>6} {'rounds':>6} {'exposed':>8} {'step ms':>8} {'compute':>8} {'DDP ms':>7} {'loss':>7} {'DDP loss':>8}"
    )


def format_row(row):
    def num(v, fmt, width):
        return f"{v:{width}{fmt}}" if v is not None else f"{'-':>{width}}"

    params = f"{row['parameters'] / 1e6:.2f}M" if row["parameters"] else "-"
    ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
    rratio = f"{row['round_ratio']:.2f}x" if row["round_ratio"] is not None else "-"
    exp = f"{row['exposed_comm_fraction'] * 100:.1f}%" if row["exposed_comm_fraction"] is not None else "-"
    return (
        f"{row['mode']:<10} {params:>7} {row['workers']:>7} {row['servers']:>7} "
        f"{num(row['tandem_tokens_per_second'], '.0f', 12)} {num(row['ddp_tokens_per_second'], '.0f', 10)} "
        f"{ratio:>6} {rratio:>6} {exp:>8} {num(row['tandem_step_ms'], '.1f', 8)} {num(row['tandem_compute_ms'], '.1f', 8)} "
        f"{num(row['ddp_step_ms'], '.1f', 7)} "
        f"{num(row['tandem_last_loss'], '.4f', 7)} {num(row['ddp_last_loss'], '.4f', 8)}"
    )


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    tandem = os.path.join(args.bin_dir, "tandem")
    if args.dry_run:
        for config in args.configs:
            print(f"# {config}")
            print(shlex.join(ddp_command(args, config)))
            for mode in args.modes:
                print(shlex.join(tandem_command(args, config, mode, "SUMMARY.json")))
        return 0
    if not os.access(tandem, os.X_OK):
        print(f"tandem bench torch: no tandem binary at {tandem} (--bin-dir)", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401  (only to say early that it is missing)
    except ImportError as e:
        print(f"tandem bench torch: {sys.executable} cannot import torch ({e}); name one that can with --python",
              file=sys.stderr)
        return 2
    cpu = cpu_model()
    failed = False
    for config in args.configs:
        ddp_runs, tandem_runs, failures = [], {m: [] for m in args.modes}, {}
        for r in range(1, args.rounds + 1):
            t = time.monotonic()
            res, err = measure_ddp(args, config)
            ddp_runs.append(res)
            if res:
                print(f"[{config} round {r}/{args.rounds}] DDP: {res['tokens_per_second']:.0f} tokens/s, "
                      f"loss {res['last_loss']:.4f} ({time.monotonic() - t:.0f} s)", file=sys.stderr, flush=True)
            else:
                failures["ddp"] = failures.get("ddp", 0) + 1
                print(f"[{config} round {r}/{args.rounds}] DDP failed: {err}", file=sys.stderr, flush=True)
            for mode in args.modes:
                t = time.monotonic()
                s, err = measure_tandem(args, config, mode)
                tandem_runs[mode].append(s)
                if s:
                    ex = exposed(s)
                    print(f"[{config} round {r}/{args.rounds}] tandem {mode}: {s['tokens_per_second']:.0f} tokens/s, "
                          f"exposed {ex * 100 if ex is not None else float('nan'):.1f}%, loss "
                          f"{s.get('last_loss') or float('nan'):.4f} ({time.monotonic() - t:.0f} s)",
                          file=sys.stderr, flush=True)
                else:
                    failures[mode] = failures.get(mode, 0) + 1
                    print(f"[{config} round {r}/{args.rounds}] tandem {mode} failed: {err}", file=sys.stderr,
                          flush=True)
        rows = make_rows(config, args, ddp_runs, tandem_runs, failures, cpu)
        failed = failed or any(r["failures"] for r in rows) or not any(ddp_runs)
        if args.json:
            for row in rows:
                print(format_json(row), flush=True)
        else:
            print(table_header(args, config, cpu))
            for row in rows:
                print(format_row(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
