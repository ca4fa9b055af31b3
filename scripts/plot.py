#!/usr/bin/env python3
"""Charts of Tandem's results as SVG files (Python's standard library only).

  plot.py run WORK_DIR|progress.jsonl [-o run.svg]
      a `tandem run`: loss, step time and exposed communication per step, with
      the membership epochs marked (rank 0's progress.jsonl in the work dir)
  plot.py allreduce allreduce.jsonl [--baselines raw-results.txt] [--np 2] [-o allreduce.svg]
      `tandem bench allreduce --json`: algorithm bandwidth by size, beside the
      Open MPI and gloo baselines of ../shared/baselines when given
  plot.py ps ps.jsonl [-o ps.svg]
      `tandem bench ps --json`: push and pull goodput by size, beside ucx_perftest

`make bench` writes the benchmark charts next to their results in build/bench.
"""
import argparse
import html
import json
import math
import os
import sys

WIDTH, HEIGHT = 720, 300
LEFT, RIGHT, TOP, BOTTOM = 70, 170, 34, 46
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#7f7f7f", "#17becf"]


def human_bytes(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:g} {unit}" if v != int(v) else f"{int(v)} {unit}"
    return f"{int(n)} B"


def nice_ticks(lo, hi, count=5):
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks = [round(first, 10)]
    while ticks[-1] < hi - step * 1e-9:
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


class Chart:
    """One panel: x and y axes (x linear or log2), lines with markers, a legend."""

    def __init__(self, title, xlabel, ylabel, xlog=False, top=0):
        self.title, self.xlabel, self.ylabel, self.xlog, self.top = title, xlabel, ylabel, xlog, top
        self.series = []  # (name, points, color, dashed)
        self.vlines = []  # (x, label)

    def line(self, name, points, dashed=False):
        points = [(x, y) for x, y in points if y is not None and x is not None and (not self.xlog or x > 0)]
        if points:
            self.series.append((name, sorted(points), COLORS[len(self.series) % len(COLORS)], dashed))

    def mark(self, x, label):
        self.vlines.append((x, label))

    def render(self):
        out = []
        y0 = self.top
        out.append(f'<text x="{LEFT}" y="{y0 + 20}" font-size="14" font-weight="bold">{html.escape(self.title)}</text>')
        if not self.series:
            out.append(f'<text x="{LEFT}" y="{y0 + 60}" font-size="12">no data</text>')
            return out
        xs = [x for _, pts, _, _ in self.series for x, _ in pts]
        ys = [y for _, pts, _, _ in self.series for _, y in pts]
        fx = (lambda v: math.log2(v)) if self.xlog else (lambda v: v)
        xmin, xmax = fx(min(xs)), fx(max(xs))
        if xmax == xmin:
            xmax = xmin + 1
        yticks = nice_ticks(0, max(ys) * 1.02)
        ymax = yticks[-1]
        pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

        def px(v):
            return LEFT + (fx(v) - xmin) / (xmax - xmin) * pw

        def py(v):
            return y0 + TOP + ph - v / ymax * ph

        out.append(f'<rect x="{LEFT}" y="{y0 + TOP}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
        for t in yticks:
            out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#eee"/>')
            out.append(f'<text x="{LEFT - 6}" y="{py(t) + 4:.1f}" font-size="11" text-anchor="end">{t:g}</text>')
        if self.xlog:
            xticks = sorted(set(xs))
            if len(xticks) > 10:
                xticks = xticks[:: math.ceil(len(xticks) / 10)]
            labels = [human_bytes(v) for v in xticks]
        else:
            xticks = [t for t in nice_ticks(min(xs), max(xs), 8) if min(xs) <= t <= max(xs)]
            labels = [f"{t:g}" for t in xticks]
        for t, label in zip(xticks, labels):
            out.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{y0 + TOP + ph}" y2="{y0 + TOP + ph + 4}" stroke="#999"/>')
            out.append(f'<text x="{px(t):.1f}" y="{y0 + TOP + ph + 16}" font-size="11" text-anchor="middle">{label}</text>')
        out.append(f'<text x="{LEFT + pw / 2}" y="{y0 + HEIGHT - 8}" font-size="12" text-anchor="middle">{html.escape(self.xlabel)}</text>')
        out.append(f'<text x="16" y="{y0 + TOP + ph / 2}" font-size="12" text-anchor="middle" '
                   f'transform="rotate(-90 16 {y0 + TOP + ph / 2})">{html.escape(self.ylabel)}</text>')
        for x, label in self.vlines:
            out.append(f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{y0 + TOP}" y2="{y0 + TOP + ph}" stroke="#aaa" stroke-dasharray="3,3"/>')
            out.append(f'<text x="{px(x) + 3:.1f}" y="{y0 + TOP + 12}" font-size="10" fill="#666">{html.escape(label)}</text>')
        for i, (name, pts, color, dashed) in enumerate(self.series):
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            dash = ' stroke-dasharray="6,4"' if dashed else ""
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
            if len(pts) <= 40:
                for x, y in pts:
                    out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}"/>')
            ly = y0 + TOP + 10 + i * 18
            out.append(f'<line x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 32}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>')
            out.append(f'<text x="{WIDTH - RIGHT + 36}" y="{ly + 4}" font-size="11">{html.escape(name)}</text>')
        return out


def write_svg(path, charts):
    height = HEIGHT * len(charts)
    body = []
    for i, chart in enumerate(charts):
        chart.top = i * HEIGHT
        body.extend(chart.render())
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">\n'
           f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")
    with open(path, "w") as f:
        f.write(svg)
    print(f"plot: wrote {path}", file=sys.stderr)


def read_jsonl(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or not line.startswith("{"):
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"plot: {path} line {n} is not JSON: {e}")
    if not rows:
        sys.exit(f"plot: {path} has no results")
    return rows


def plot_run(args):
    path = args.input
    if os.path.isdir(path):
        path = os.path.join(path, "progress.jsonl")
    # Step lines only (the last line says training finished).
    rows = [r for r in read_jsonl(path) if "step" in r]
    steps = [r["step"] for r in rows]
    loss = Chart("Loss", "step", "loss")
    loss.line("loss", [(r["step"], r.get("loss")) for r in rows])
    time = Chart("Step time", "step", "milliseconds")
    time.line("step", [(r["step"], r["step_seconds"] * 1e3) for r in rows])
    time.line("compute", [(r["step"], r["compute_seconds"] * 1e3) for r in rows])
    time.line("exposed comm", [(r["step"], r["exposed_seconds"] * 1e3) for r in rows], dashed=True)
    last_epoch = None
    for r in rows:
        if last_epoch is not None and r["epoch"] != last_epoch:
            label = f"epoch {r['epoch']}: {r['world_size']} workers"
            loss.mark(r["step"], label)
            time.mark(r["step"], label)
        last_epoch = r["epoch"]
    loss.title = f"Loss, steps {min(steps)}-{max(steps)}"
    write_svg(args.output or "run.svg", [loss, time])


# The all-reduce baselines of ../shared/baselines/run.sh that are drawn.
LABELS = {
    "mpi_allreduce": {"shm-vader": "Open MPI", "shm-vader-nocma": "Open MPI, no CMA", "shm-vader-ring": "Open MPI, ring"},
    "gloo_allreduce": {"gloo-tcp-lo": "gloo (torch)"},
}


def load_baselines(path):
    """RESULT|mpi_allreduce|variant|np|bytes|median|min|max|ok -> {(label, np): {bytes: GB/s}}"""
    out = {}
    with open(path) as f:
        for line in f:
            parts = line.strip().split("|")
            if len(parts) < 6 or parts[0] != "RESULT":
                continue
            name, variant = parts[1], parts[2]
            if name not in LABELS or variant not in LABELS[name]:
                continue  # memory bandwidth, Open MPI over TCP
            n, size, median = int(parts[3]), int(parts[4]), float(parts[5])
            if median > 0:
                out.setdefault((LABELS[name][variant], n), {})[size] = size / median / 1e9
    return out


def plot_allreduce(args):
    rows = [r for r in read_jsonl(args.input) if r.get("collective") == "allreduce" and r.get("np") == args.np]
    chart = Chart(f"All-reduce, float32 sum, {args.np} processes", "message size", "algorithm bandwidth (GB/s)",
                  xlog=True)
    chart.line(f"Tandem ({rows[0]['backend'] if rows else 'shm'})",
               [(r["size_bytes"], r["algbw_gbps"]) for r in rows if r["size_bytes"] > 0])
    if args.baselines:
        for (label, n), points in sorted(load_baselines(args.baselines).items()):
            if n == args.np:
                chart.line(label, sorted(points.items()), dashed=True)
    write_svg(args.output or "allreduce.svg", [chart])


def plot_ps(args):
    rows = read_jsonl(args.input)
    chart = Chart("Parameter server: one step's gradient pushed, parameters pulled", "size per step",
                  "goodput (GB/s)", xlog=True)
    chart.line("push", [(r["size_bytes"], r["push_gbps"]) for r in rows])
    # Back to back: each push also waits for the previous step's update
    # (absent from results of builds before it was measured).
    chart.line("push, back to back", [(r["size_bytes"], r.get("push_b2b_gbps")) for r in rows], dashed=True)
    chart.line("pull", [(r["size_bytes"], r["pull_gbps"]) for r in rows])
    chart.line("ucx_perftest (same run)", [(r["size_bytes"], r.get("ucx_perftest_gbps")) for r in rows], dashed=True)
    # One request/reply on UCX itself (sizes of one message; absent from
    # results of builds before it was measured).
    chart.line("UCX request/reply", [(r["size_bytes"], r.get("ucx_perftest_rtt_gbps")) for r in rows],
               dashed=True)
    write_svg(args.output or "ps.svg", [chart])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("run", help="a tandem run's progress")
    p.add_argument("input", help="the run's work directory or its progress.jsonl")
    p.add_argument("-o", "--output")
    p.set_defaults(func=plot_run)
    p = sub.add_parser("allreduce", help="tandem bench allreduce --json")
    p.add_argument("input")
    p.add_argument("--baselines", help="raw-results.txt of ../shared/baselines/run.sh")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("-o", "--output")
    p.set_defaults(func=plot_allreduce)
    p = sub.add_parser("ps", help="tandem bench ps --json")
    p.add_argument("input")
    p.add_argument("-o", "--output")
    p.set_defaults(func=plot_ps)
    args = parser.parse_args()
    try:
        args.func(args)
    except (OSError, KeyError) as e:
        sys.exit(f"plot: {e}")


if __name__ == "__main__":
    main()
