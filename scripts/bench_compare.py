#!/usr/bin/env python3
"""Tandem's collective benchmarks beside the baselines measured in the same run.

Reads the baselines' raw-results.txt (RESULT|... lines) and the JSON lines of
`tandem bench allreduce --json`, prints the side-by-side table with ratios and
the data-plane targets, and writes the same as Markdown.

Usage: bench_compare.py RAW_RESULTS TANDEM_JSONL [OUT_MD]
       bench_compare.py --rounds ROUNDS [OUT_MD]

With --rounds, ROUNDS holds rounds that alternate the baselines and Tandem
(`make bench` writes it): each round starts with a line "# round K" and holds
the RESULT lines of the Open MPI variants and the JSON lines of `tandem bench
allreduce`, measured one right after the other. Each round's ratio compares
Tandem with the best Open MPI variant of that round; the table gives every
round's ratio and their median, so one slow moment of the host does not
decide a size.
"""
import json
import sys
from collections import defaultdict

MiB = 1 << 20


def human(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def load_baselines(path_or_lines):
    mpi = defaultdict(dict)  # (ranks, bytes) -> {variant: seconds}
    gloo = {}  # (ranks, bytes) -> seconds
    membw = {}  # (op, threads) -> STREAM-counted bytes/s
    lines = open(path_or_lines) if isinstance(path_or_lines, str) else path_or_lines
    for line in lines:
        if not line.startswith("RESULT|"):
            continue
        f = line.strip().split("|")
        if f[1] == "mpi_allreduce" and f[8] == "ok":
            mpi[(int(f[3]), int(f[4]))][f[2]] = float(f[5])
        elif f[1] == "gloo_allreduce":
            gloo[(int(f[3]), int(f[4]))] = float(f[5])
        elif f[1] == "membw":
            membw[(f[2], int(f[3]))] = int(f[4]) * float(f[8]) / float(f[5])
    return mpi, gloo, membw


def load_tandem(path_or_lines):
    rows = {}
    lines = open(path_or_lines) if isinstance(path_or_lines, str) else path_or_lines
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        rows[(r["np"], r["size_bytes"])] = r
    return rows


def load_rounds(path):
    """[(mpi, tandem)] per round of a --rounds file."""
    chunks = []
    for line in open(path):
        if line.startswith("# round"):
            chunks.append([])
        elif chunks:
            chunks[-1].append(line)
    return [(load_baselines(c)[0], load_tandem(c)) for c in chunks]


def median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def compare_rounds(path, out_path=None):
    rounds = load_rounds(path)
    if not rounds:
        print(f"bench_compare: {path} holds no rounds ('# round K' lines)", file=sys.stderr)
        return 1
    out = [f"\n### allreduce, float32 sum, 2 ranks: {len(rounds)} rounds, each Open MPI then Tandem\n",
           "| size | Tandem us (median) | best Open MPI us (median) | x Open MPI per round | median | rounds at 1.5x |",
           "|---|---|---|---|---|---|"]
    failures = []
    sizes = sorted({size for mpi, ours in rounds for (ranks, size) in mpi if ranks == 2 and (2, size) in ours})
    for size in sizes:
        ratios, ours_us, mpi_us = [], [], []
        for mpi, ours in rounds:
            variants = mpi.get((2, size))
            t = ours.get((2, size))
            if not variants or t is None:
                continue
            best = min(variants.values())
            ratios.append(best * 1e6 / t["time_us"])
            ours_us.append(t["time_us"])
            mpi_us.append(best * 1e6)
            if t["wrong"]:
                failures.append(f"{human(size)}: {t['wrong']} wrong elements")
        if not ratios:
            continue
        met = sum(r >= 1.5 for r in ratios)
        mid = median(ratios)
        out.append(f"| {human(size)} | {median(ours_us):.1f} | {median(mpi_us):.1f} | "
                   f"{', '.join(f'{r:.2f}' for r in ratios)} | **{mid:.2f}** | {met} of {len(ratios)} |")
        if MiB <= size <= 64 * MiB and mid < 1.5:
            failures.append(f"{human(size)}: median {mid:.3f}x the best Open MPI (target 1.5x)")
    out.append("\n**Target (1.5x the best Open MPI, 1-64 MiB, median of the rounds):** " +
               ("met." if not failures else "missed: " + "; ".join(failures) + "."))
    text = "\n".join(out) + "\n"
    print(text)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)
    return 0


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--rounds":
        return compare_rounds(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    mpi, gloo, membw = load_baselines(sys.argv[1])
    ours = load_tandem(sys.argv[2])
    out = []
    failures = []
    copy_bw = membw.get(("copy", 1))
    for ranks in sorted({k[0] for k in mpi}):
        out.append(f"\n### allreduce, float32 sum, {ranks} ranks\n")
        out.append("| size | Tandem GB/s | Tandem us | best Open MPI GB/s (variant) | x Open MPI | gloo GB/s | x gloo |")
        out.append("|---|---|---|---|---|---|---|")
        for size in sorted({k[1] for k in mpi if k[0] == ranks}):
            t = ours.get((ranks, size))
            variants = mpi[(ranks, size)]
            best_variant = min(variants, key=variants.get)
            best_mpi = size / variants[best_variant] / 1e9
            g = gloo.get((ranks, size))
            gbw = size / g / 1e9 if g else None
            if t is None:
                out.append(f"| {human(size)} | (not run) | | {best_mpi:.3f} ({best_variant}) | | | |")
                continue
            ratio = t["algbw_gbps"] / best_mpi
            gr = t["algbw_gbps"] / gbw if gbw else None
            out.append(
                f"| {human(size)} | {t['algbw_gbps']:.3f} | {t['time_us']:.1f} | {best_mpi:.3f} ({best_variant}) | "
                f"**{ratio:.2f}** | {gbw:.3f} | {gr:.1f} |" if gbw else
                f"| {human(size)} | {t['algbw_gbps']:.3f} | {t['time_us']:.1f} | {best_mpi:.3f} ({best_variant}) | "
                f"**{ratio:.2f}** | | |")
            if t["wrong"]:
                failures.append(f"{ranks} ranks {human(size)}: {t['wrong']} wrong elements")
            if ranks == 2:
                if MiB <= size <= 64 * MiB and ratio < 1.5:
                    failures.append(f"2 ranks {human(size)}: {ratio:.2f}x the best Open MPI (target 1.5x)")
                if gr is not None and size >= MiB and gr < 10:
                    failures.append(f"2 ranks {human(size)}: {gr:.1f}x gloo (target 10x)")
                if size <= 4096:
                    best_time_us = variants[best_variant] * 1e6
                    if t["time_us"] > best_time_us:
                        failures.append(
                            f"2 ranks {human(size)}: p50 {t['time_us']:.2f} us, Open MPI {best_time_us:.2f} us")
        # Memory bound at 64 MiB: two ranks move at least 5 S bytes.
        t = ours.get((ranks, 64 * MiB))
        if ranks == 2 and t and copy_bw:
            bound = copy_bw / 5 / 1e9
            frac = t["algbw_gbps"] / bound
            out.append(
                f"\nMemory bound at 64 MiB: memcpy moves {copy_bw / 1e9:.1f} GB/s (read + write, one thread), so "
                f"5 S bytes bound algbw at {bound:.2f} GB/s; Tandem reaches {t['algbw_gbps']:.2f} GB/s = "
                f"**{frac:.2f}** of it.")
            if frac < 0.5:
                failures.append(f"64 MiB: {frac:.2f} of the memory bound (target 0.5)")
    # Sizes the baselines did not measure.
    extra = sorted(k for k in ours if k not in mpi)
    if extra:
        out.append("\n### Tandem at the other sizes\n")
        out.append("| ranks | size | time us | algbw GB/s | busbw GB/s | #wrong |")
        out.append("|---|---|---|---|---|---|")
        for k in extra:
            r = ours[k]
            out.append(f"| {k[0]} | {human(k[1])} | {r['time_us']:.2f} | {r['algbw_gbps']:.3f} | "
                       f"{r['busbw_gbps']:.3f} | {r['wrong']} |")
    out.append("\n**Targets:** " + ("all met." if not failures else "missed: " + "; ".join(failures) + "."))
    text = "\n".join(out) + "\n"
    print(text)
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
