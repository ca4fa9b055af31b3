#!/usr/bin/env python3
"""How fast Tandem detects each kind of failure and recovers from it.

Runs ROUNDS times one `tandem run` (2 nodes of 2 workers, 2 servers, a small
model, 300 steps) that injects one fault of each kind, one at a time (each
once the cluster is whole again after the one before): a worker, a server and
the coordinator killed (SIGKILL), a worker and a server stopped (SIGSTOP: a
hung process), a node cut off for 1 s (shorter than the coordinator's 3 s
heartbeat deadline) and for 5 s, and a worker slowed to a quarter of its speed
for 3 s. Partitions need network namespaces (root); without them the run is on
loopback and their rows say so. Every worker sleeps 40 ms per step
(TANDEM_FAILPOINTS=train.step_delay_ms=40) so that the run outlasts its faults.

From each run's --summary it reads, per fault:
- detection: seconds from the injection until the coordinator declared the
  process dead (for the coordinator itself: until the supervisor saw it end;
  for a slow worker: until the coordinator named it a straggler), and what
  detected it;
- recovery: seconds from the injection until every process was up again and
  in the active membership epoch, with every parameter partition backed up.
It prints, per fault, the median and min-max of both over the rounds, and
whether every round completed with the servers having applied every step.

Usage:
  bench_recovery.py [--rounds 3] [--tandem build/bin/tandem] [--markdown FILE] [--json FILE]

Exit status 0 when every round completed, 1 when one did not complete every
step, 2 when a run failed.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

FAILPOINTS = "train.step_delay_ms=40"
# Three nodes: servers on node-0 and node-1; node-2 holds workers only, so
# cutting it off for longer than the heartbeat deadline loses no server
# with its workers (tandem run refuses that; docs/failures.md).
CLUSTER = ["--nodes", "3", "--workers-per-node", "2", "--servers", "2", "--steps", "300",
           "--restart-delay", "200ms", "--partition-size", "16KiB", "--train-optimizer", "sgd",
           "--train-layers", "2", "--train-d-model", "32", "--train-heads", "2", "--train-context", "16",
           "--train-global-batch", "8"]
# (row label, --inject entry); a fault is found in the summary by its kind and planned step.
FAULTS = [
    ("kill worker", "kill:worker-1@10"),
    ("kill server", "kill:server-1@20"),
    ("kill coordinator", "kill:coordinator@30"),
    ("stop worker", "stop:worker-2@40"),
    ("stop server", "stop:server-0@50"),
    ("partition 1 s", "partition:node-1@60/1s"),
    ("partition 5 s", "partition:node-2@70/5s"),
    ("slow worker (3 s)", "slow:worker-3@80/3s"),
]
NEEDS_NETNS = "needs network namespaces"


def parse_fault(spec):
    """'partition:node-1@60/1s' -> ('partition', 60)."""
    kind, _, rest = spec.partition(":")
    return kind, int(rest.partition("@")[2].partition("/")[0])


def faults_for(network):
    """The faults a run on this network injects (partitions only in namespaces)."""
    return [(label, spec) for label, spec in FAULTS if network == "netns" or not spec.startswith("partition:")]


def command(tandem, network, summary):
    specs = ",".join(spec for _, spec in faults_for(network))
    return [tandem, "run"] + CLUSTER + ["--network", network, "--inject", specs, "--summary", summary]


def run_round(tandem, network, timeout):
    """One `tandem run`; its summary (a dict). Exits with status 2 and the end
    of its output when it fails."""
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as d:
        summary = os.path.join(d, "summary.json")
        cmd = command(tandem, network, summary)
        env = dict(os.environ, TANDEM_FAILPOINTS=FAILPOINTS)
        try:
            p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=timeout + 60)
        except OSError as e:
            raise SystemExit(f"bench_recovery: cannot run {tandem}: {e.strerror}")
        except subprocess.TimeoutExpired as e:
            fail(cmd, f"ran past {timeout + 60:g} s", e.output or "")
        if p.returncode != 0:
            fail(cmd, f"exited with status {p.returncode}", p.stdout)
        try:
            with open(summary) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            fail(cmd, f"left no readable summary ({e})", p.stdout)


def fail(cmd, what, output):
    tail = "\n".join(output.rstrip().splitlines()[-25:])
    sys.stderr.write(f"bench_recovery: TANDEM_FAILPOINTS={FAILPOINTS} {' '.join(cmd)}\n{what}; "
                     f"the end of its output:\n{tail}\n")
    sys.exit(2)


def round_ok(summary):
    """Did the run complete, with the servers having applied every step?"""
    return bool(summary.get("completed")) and summary.get("server_steps_applied") == summary.get("steps")


def aggregate(summaries, network):
    """One row per fault of FAULTS over the rounds' summaries: label,
    detected and recovered (lists of seconds, None where not seen), detection
    (the distinct texts, in order of first appearance), complete (rounds in
    which the fault was injected and the run completed every step), rounds,
    and note (why a fault was not run)."""
    rows = []
    for label, spec in FAULTS:
        row = {"fault": label, "inject": spec, "detected": [], "recovered": [], "detection": [], "complete": 0,
               "rounds": len(summaries), "note": None}
        if network != "netns" and spec.startswith("partition:"):
            row["note"] = NEEDS_NETNS
            row["rounds"] = 0
            rows.append(row)
            continue
        kind, planned = parse_fault(spec)
        for s in summaries:
            entry = next((i for i in s.get("injected") or []
                          if i.get("kind") == kind and i.get("planned_step") == planned), None)
            if entry is None:
                row["detected"].append(None)
                row["recovered"].append(None)
                continue
            row["detected"].append(entry.get("detected_seconds"))
            row["recovered"].append(entry.get("recovered_seconds"))
            text = entry.get("detection") or "not seen"
            if text not in row["detection"]:
                row["detection"].append(text)
            row["complete"] += round_ok(s)
        rows.append(row)
    return rows


def spread(values):
    """'0.50 (0.25–0.61)' over the values seen; '—' when none was; ', n of m
    rounds' when some were not."""
    seen = [v for v in values if v is not None]
    if not seen:
        return "—"
    text = f"{statistics.median(seen):.2f} ({min(seen):.2f}–{max(seen):.2f})"
    if len(seen) < len(values):
        text += f", {len(seen)} of {len(values)} rounds"
    return text


def table(rows):
    """The Markdown table of the rows."""
    lines = ["| fault | detected after, s: median (min–max) | recovered after, s: median (min–max) "
             "| detected by | rounds complete |",
             "|---|---|---|---|---|"]
    for r in rows:
        if r["note"]:
            lines.append(f"| {r['fault']} | {r['note']} | | | |")
            continue
        lines.append(f"| {r['fault']} | {spread(r['detected'])} | {spread(r['recovered'])} "
                     f"| {'; '.join(r['detection'])} | {r['complete']}/{r['rounds']} |")
    return "\n".join(lines)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} CPUs"


def report(rows, summaries, tandem, network, rounds, date, cpu):
    """The whole Markdown fragment: how it was measured, then the table."""
    shown = command(tandem, network, "FILE")
    ok = sum(round_ok(s) for s in summaries)
    return "\n".join([
        f"{rounds} rounds, {date}, {cpu}, network {network}. Each round is one run with every fault below, "
        f"one at a time; every worker sleeps 40 ms per step (TANDEM_FAILPOINTS={FAILPOINTS}) so that the run "
        "outlasts its faults:",
        "",
        "```sh",
        f"TANDEM_FAILPOINTS={FAILPOINTS} {' '.join(shown)}",
        "```",
        "",
        table(rows),
        "",
        f"Rounds that completed with server_steps_applied == steps: {ok} of {len(summaries)}.",
        "",
    ])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="runs, each with one fault of each kind (default 3)")
    ap.add_argument("--tandem", default="build/bin/tandem", help="the tandem binary (default build/bin/tandem)")
    ap.add_argument("--network", choices=["auto", "netns", "loopback"], default="auto",
                    help="auto: network namespaces when root (partitions need them), else loopback")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one run may take (default 300)")
    ap.add_argument("--markdown", help="write the table here as a Markdown fragment")
    ap.add_argument("--json", help="write the rows and the rounds' summaries here")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    network = a.network if a.network != "auto" else ("netns" if os.geteuid() == 0 else "loopback")
    date = datetime.date.today().isoformat()
    cpu = cpu_name()

    summaries = []
    for r in range(1, a.rounds + 1):
        s = run_round(a.tandem, network, a.timeout)
        summaries.append(s)
        print(f"# round {r}/{a.rounds}: {s.get('steps')} steps in {s.get('elapsed_seconds')} s, "
              f"restarts {s.get('restarts')}{'' if round_ok(s) else ', INCOMPLETE'}", file=sys.stderr, flush=True)

    rows = aggregate(summaries, network)
    text = report(rows, summaries, a.tandem, network, a.rounds, date, cpu)
    print(text, end="")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": date, "cpu": cpu, "network": network, "failpoints": FAILPOINTS,
                       "command": command(a.tandem, network, "FILE"), "rows": rows,
                       "rounds": [{k: s.get(k) for k in ("completed", "steps", "server_steps_applied",
                                                         "elapsed_seconds", "restarts", "injected")}
                                  for s in summaries]}, f, indent=1)
            f.write("\n")
    return 0 if all(round_ok(s) for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
