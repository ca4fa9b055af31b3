#!/usr/bin/env python3
"""Compares two builds of Tandem on one benchmark, in rounds that alternate them.

Runs `OLD BENCH_ARGS...` and `NEW BENCH_ARGS...` (each a `tandem` binary; the
arguments must include --json) one after the other, ROUNDS times, starting
with the old build, and reads their JSON lines. For every row (a size for
`bench ps`, a mode for `bench train`) and metric it prints the median of each
build, the spread of each build's own runs ((max - min) / median, the noise
of identical back-to-back runs), and whether the new build is slower than the
old one by more than the old build's spread plus a margin (2% by default).

Usage:
  bench_ab.py --old OLD_TANDEM --new NEW_TANDEM --rounds 5 --key size_bytes \\
      --metric push_us:lower --metric pull_us:lower --metric step_us:lower \\
      [--out results.jsonl] [--markdown table.md] -- bench ps --json ...

A metric is NAME:lower (times) or NAME:higher (rates). Exit status 0 when no
row is slower beyond its noise, 1 when one is, 2 on a failed run.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time


def run(binary, args, timeout):
    started = time.monotonic()
    try:
        p = subprocess.run([binary] + args, capture_output=True, text=True, timeout=timeout)
    except OSError as e:
        raise SystemExit(f"bench_ab: cannot run {binary}: {e.strerror}")
    except subprocess.TimeoutExpired:
        raise SystemExit(f"bench_ab: {binary} {' '.join(args)} ran past --timeout {timeout:g} s")
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-2000:] + p.stderr[-4000:])
        raise SystemExit(f"bench_ab: {binary} {' '.join(args)} exited with {p.returncode}")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise SystemExit(f"bench_ab: {binary} printed no JSON rows (is --json among the arguments?)")
    return rows, time.monotonic() - started


def spread(values):
    m = statistics.median(values)
    return (max(values) - min(values)) / m if m else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="the tandem binary of the build before")
    ap.add_argument("--new", required=True, help="the tandem binary of the build after")
    ap.add_argument("--rounds", type=int, default=5, help="runs of each build (alternating)")
    ap.add_argument("--key", required=True, help="the JSON field that names a row (size_bytes, mode)")
    ap.add_argument("--metric", action="append", required=True, help="NAME:lower or NAME:higher")
    ap.add_argument("--margin", type=float, default=0.02, help="allowed slowdown beyond the noise")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    ap.add_argument("--out", help="append every run's rows here (JSON lines, with build and round)")
    ap.add_argument("--markdown", help="write the table here too")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the tandem arguments")
    a = ap.parse_args()
    args = a.bench[1:] if a.bench and a.bench[0] == "--" else a.bench
    if not args:
        ap.error("give the benchmark's arguments after --")
    metrics = []
    for m in a.metric:
        name, _, better = m.partition(":")
        if better not in ("lower", "higher"):
            ap.error(f"--metric {m}: say NAME:lower or NAME:higher")
        metrics.append((name, better))

    values = {}  # (build, key, metric) -> [values]
    keys = []
    out = open(a.out, "a") if a.out else None
    for r in range(1, a.rounds + 1):
        for build, binary in (("old", a.old), ("new", a.new)):
            rows, seconds = run(binary, args, a.timeout)
            print(f"# round {r}/{a.rounds}, {build}: {len(rows)} rows in {seconds:.0f} s", file=sys.stderr, flush=True)
            for row in rows:
                k = row.get(a.key)
                if k not in keys:
                    keys.append(k)
                for name, _ in metrics:
                    if name in row and row[name] is not None:
                        values.setdefault((build, k, name), []).append(float(row[name]))
                if out:
                    out.write(json.dumps({"build": build, "round": r, **row}) + "\n")
    if out:
        out.close()

    lines = [f"| {a.key} | metric | old median | new median | new/old | old spread | new spread | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    slower = 0
    for k in keys:
        for name, better in metrics:
            old = values.get(("old", k, name))
            new = values.get(("new", k, name))
            if not old or not new:
                continue
            mo, mn = statistics.median(old), statistics.median(new)
            so, sn = spread(old), spread(new)
            ratio = mn / mo if mo else float("nan")
            worse = ratio - 1 if better == "lower" else 1 - ratio
            bad = worse > so + a.margin
            slower += bad
            verdict = "slower" if bad else ("faster" if worse < -(so + a.margin) else "same")
            lines.append(f"| {k} | {name} ({better} is better) | {mo:.4g} | {mn:.4g} | {ratio:.3f} | "
                         f"{so:.1%} | {sn:.1%} | {verdict} |")
    table = "\n".join(lines)
    print(table)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(table + "\n")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
