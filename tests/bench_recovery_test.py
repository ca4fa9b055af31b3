#!/usr/bin/env python3
"""scripts/bench_recovery.py: per-fault medians and ranges of detection and
recovery over canned summaries, the table, and the whole script run against
a stand-in tandem that writes a summary (no cluster)."""
import importlib.util
import json
import os
import stat
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "bench_recovery.py")
spec = importlib.util.spec_from_file_location("bench_recovery", SCRIPT)
br = importlib.util.module_from_spec(spec)
spec.loader.exec_module(br)


def injected(kind, process, planned, detected, recovered, detection, duration=0):
    return {"kind": kind, "process": process, "step": planned + 9, "planned_step": planned,
            "duration_seconds": duration, "at_seconds": 1.0, "detected_seconds": detected,
            "recovered_seconds": recovered, "detection": detection}


def summary(scale=1.0, completed=True, applied=300, partitions=True):
    """A summary as `tandem run --summary` writes it, its times multiplied by scale."""
    entries = [
        injected("kill", "worker-1", 10, 0.5 * scale, 1.5 * scale, "the coordinator declared worker-1 dead"),
        injected("kill", "server-1", 20, 0.25 * scale, 1.25 * scale, "the coordinator declared server-1 dead"),
        injected("kill", "coordinator", 30, 0.004, 1.0 * scale, "the supervisor saw it end"),
        injected("stop", "worker-2", 40, 2.75 * scale, 4.25 * scale, "the coordinator declared worker-2 dead"),
        injected("stop", "server-0", 50, 2.5 * scale, 3.75 * scale, "the coordinator declared server-0 dead"),
        injected("partition", "node-1", 60, None, 1.0, "ridden out in the same epoch", 1),
        injected("partition", "node-2", 70, 2.75 * scale, 7.5 * scale,
                 "the coordinator declared worker-%d dead" % (0 if scale < 1 else 1), 5),
        injected("slow", "worker-3", 80, 0.25 * scale, 3.0, "the coordinator named worker-3 a straggler", 3),
    ]
    if not partitions:
        entries = [e for e in entries if e["kind"] != "partition"]
    return {"completed": completed, "steps": 300, "server_steps_applied": applied, "elapsed_seconds": 30.0,
            "network": "netns" if partitions else "loopback",
            "restarts": {"coordinator": 1, "server": 3, "worker": 4}, "injected": entries}


def fake_tandem(dir_, summary_, rc=0):
    """A stand-in tandem that records its arguments and TANDEM_FAILPOINTS,
    writes summary_ to --summary and exits with rc."""
    path = os.path.join(dir_, "tandem")
    with open(path, "w") as f:
        f.write(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
open({path!r} + ".args", "w").write(" ".join(args) + "\\n" + os.environ.get("TANDEM_FAILPOINTS", ""))
for i in range(40):
    print("step", i)
if {rc!r}:
    print("worker-1 could not rejoin")
    sys.exit({rc!r})
json.dump({summary_!r}, open(args[args.index("--summary") + 1], "w"))
""")
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


def read(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


class AggregateTest(unittest.TestCase):
    def rows(self, summaries, network="netns"):
        return {r["fault"]: r for r in br.aggregate(summaries, network)}

    def test_medians_ranges_and_detection_over_rounds(self):
        rows = self.rows([summary(1.0), summary(0.8), summary(1.2)])
        self.assertEqual(list(rows), [label for label, _ in br.FAULTS])
        kill = rows["kill worker"]
        self.assertEqual(kill["detected"], [0.5, 0.4, 0.6])
        self.assertEqual(br.spread(kill["detected"]), "0.50 (0.40–0.60)")
        self.assertEqual(br.spread(kill["recovered"]), "1.50 (1.20–1.80)")
        self.assertEqual(kill["detection"], ["the coordinator declared worker-1 dead"])
        self.assertEqual((kill["complete"], kill["rounds"]), (3, 3))
        # A short partition is ridden out: never detected, whole again after it.
        short = rows["partition 1 s"]
        self.assertEqual(br.spread(short["detected"]), "—")
        self.assertEqual(br.spread(short["recovered"]), "1.00 (1.00–1.00)")
        # Distinct detection texts, in order of first appearance.
        self.assertEqual(rows["partition 5 s"]["detection"],
                         ["the coordinator declared worker-1 dead", "the coordinator declared worker-0 dead"])

    def test_a_fault_not_seen_in_every_round_says_so(self):
        partial = summary()
        partial["injected"][3]["detected_seconds"] = None
        missing = summary()
        del missing["injected"][3]
        row = self.rows([summary(), partial, missing])["stop worker"]
        self.assertEqual(br.spread(row["detected"]), "2.75 (2.75–2.75), 1 of 3 rounds")
        self.assertEqual(row["complete"], 2)  # the round without it does not count for it

    def test_an_incomplete_round_is_counted(self):
        rows = self.rows([summary(), summary(applied=299), summary(completed=False)])
        self.assertEqual(rows["slow worker (3 s)"]["complete"], 1)

    def test_loopback_leaves_partitions_out(self):
        rows = self.rows([summary(partitions=False)], "loopback")
        self.assertEqual(rows["partition 5 s"]["note"], br.NEEDS_NETNS)
        self.assertEqual(rows["kill server"]["complete"], 1)
        self.assertNotIn("partition:", " ".join(br.command("tandem", "loopback", "s.json")))
        self.assertIn("partition:node-2@70/5s", " ".join(br.command("tandem", "netns", "s.json")))

    def test_table(self):
        lines = br.table(br.aggregate([summary(), summary(2.0)], "netns")).splitlines()
        self.assertEqual(len(lines), 2 + len(br.FAULTS))
        self.assertEqual(lines[1], "|---|---|---|---|---|")
        self.assertEqual(lines[2], "| kill worker | 0.75 (0.50–1.00) | 2.25 (1.50–3.00) "
                                   "| the coordinator declared worker-1 dead | 2/2 |")
        self.assertIn("| kill coordinator | 0.00 (0.00–0.00) |", lines[4])
        loop = br.table(br.aggregate([summary(partitions=False)], "loopback")).splitlines()
        self.assertEqual(loop[7], "| partition 1 s | needs network namespaces | | | |")


class ScriptTest(unittest.TestCase):
    def run_script(self, summary_, rc=0, *extra):
        with tempfile.TemporaryDirectory() as d:
            tandem = fake_tandem(d, summary_, rc)
            md, js = os.path.join(d, "t.md"), os.path.join(d, "t.json")
            p = subprocess.run([sys.executable, SCRIPT, "--rounds", "2", "--tandem", tandem, "--network", "netns",
                                "--markdown", md, "--json", js, *extra], capture_output=True, text=True, timeout=60)
            return p, read(tandem + ".args"), (read(md), json.loads(read(js) or "null"))

    def test_rounds_table_markdown_and_json(self):
        p, args, (md, js) = self.run_script(summary())
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        argv, failpoints = args.split("\n")
        self.assertEqual(failpoints, "train.step_delay_ms=40")
        self.assertTrue(argv.startswith("run --nodes 3 --workers-per-node 2 --servers 2 --steps 300"), argv)
        self.assertIn("--network netns --inject kill:worker-1@10,kill:server-1@20,", argv)
        self.assertEqual(p.stderr.count("# round "), 2)
        self.assertEqual(md, p.stdout)
        self.assertIn("| stop server | 2.50 (2.50–2.50) | 3.75 (3.75–3.75) "
                      "| the coordinator declared server-0 dead | 2/2 |", md)
        self.assertIn("TANDEM_FAILPOINTS=train.step_delay_ms=40 ", md)
        self.assertIn("network netns", md)
        self.assertIn("server_steps_applied == steps: 2 of 2", md)
        self.assertEqual(len(js["rows"]), len(br.FAULTS))
        self.assertEqual(len(js["rounds"]), 2)
        self.assertEqual(js["rounds"][0]["restarts"]["server"], 3)

    def test_an_incomplete_round_exits_1(self):
        p, _, (md, _) = self.run_script(summary(applied=290))
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn("INCOMPLETE", p.stderr)
        self.assertIn("| 0/2 |", md)

    def test_a_failed_run_exits_2_and_quotes_its_output(self):
        p, _, (md, _) = self.run_script(summary(), 3)
        self.assertEqual(p.returncode, 2)
        self.assertIn("exited with status 3", p.stderr)
        self.assertIn("worker-1 could not rejoin", p.stderr)
        self.assertIn("step 39", p.stderr)
        self.assertNotIn("step 5\n", p.stderr)  # only the end of the output
        self.assertIsNone(md)


if __name__ == "__main__":
    unittest.main()
