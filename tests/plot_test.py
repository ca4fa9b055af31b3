#!/usr/bin/env python3
"""scripts/plot.py draws what it is given: a run's progress with its epochs,
the all-reduce beside its baselines, the parameter server beside
ucx_perftest; bad input gets a message naming the file, not a traceback."""
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET

PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "plot.py")
SVG = "{http://www.w3.org/2000/svg}"


def run(*args):
    return subprocess.run([sys.executable, PLOT, *args], capture_output=True, text=True, timeout=60)


def texts(svg):
    return [t.text for t in svg.iter(SVG + "text")]


def polylines(svg):
    return [[tuple(map(float, p.split(","))) for p in line.get("points").split()] for line in svg.iter(SVG + "polyline")]


class PlotTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def path(self, name):
        return os.path.join(self.dir.name, name)

    def write(self, name, rows, junk=""):
        with open(self.path(name), "w") as f:
            f.write(junk)
            for r in rows:
                f.write(json.dumps(r) + "\n")
        return self.path(name)

    def test_a_run_shows_loss_step_time_and_every_epoch_change(self):
        rows = []
        for step in range(1, 31):
            epoch = 1 if step <= 10 else (2 if step <= 20 else 3)
            rows.append({"step": step, "epoch": epoch, "world_size": {1: 4, 2: 3, 3: 4}[epoch], "loss": 5.0 - step / 10,
                         "step_seconds": 0.1, "compute_seconds": 0.08, "exposed_seconds": 0.01 * (step % 3)})
        # The last line says training finished; it is not a step.
        rows.append({"finished": True, "steps": 30, "checkpoint": None, "time": 1.0})
        self.write("progress.jsonl", rows)
        r = run("run", self.dir.name, "-o", self.path("run.svg"))
        self.assertEqual(r.returncode, 0, r.stderr)
        svg = ET.parse(self.path("run.svg")).getroot()
        labels = texts(svg)
        for want in ("loss", "step", "compute", "exposed comm", "epoch 2: 3 workers", "epoch 3: 4 workers"):
            self.assertIn(want, labels)
        self.assertEqual(labels.count("epoch 2: 3 workers"), 2, "marked on both panels")
        lines = polylines(svg)
        self.assertEqual(len(lines), 4)  # loss; step, compute, exposed
        self.assertEqual([len(l) for l in lines], [30] * 4)
        # The loss falls: its line goes down the page (y grows) from left to right.
        loss = lines[0]
        self.assertTrue(all(b[0] > a[0] and b[1] > a[1] for a, b in zip(loss, loss[1:])))

    def test_allreduce_is_drawn_beside_the_baselines_of_its_process_count(self):
        rows = [{"collective": "allreduce", "np": 2, "backend": "shm", "size_bytes": s, "algbw_gbps": s / 1e5}
                for s in (4096, 65536, 1 << 20)]
        rows.append({"collective": "allreduce", "np": 4, "backend": "shm", "size_bytes": 4096, "algbw_gbps": 1})
        jsonl = self.write("allreduce.jsonl", rows)
        with open(self.path("raw.txt"), "w") as f:
            f.write("# date: today\n")
            for variant in ("shm-vader", "shm-vader-nocma", "tcp-lo"):
                for s in (4096, 65536, 1 << 20):
                    f.write(f"RESULT|mpi_allreduce|{variant}|2|{s}|0.0001|0.0001|0.0002|ok\n")
            f.write("RESULT|gloo_allreduce|gloo-tcp-lo|2|4096|0.001|0.001|0.002|ok\n")
            f.write("RESULT|mpi_allreduce|shm-vader|4|4096|0.0001|0.0001|0.0002|ok\n")
            f.write("RESULT|membw|copy|1|268435456|0.01|0.01|0.01|ok\n")
        r = run("allreduce", jsonl, "--baselines", self.path("raw.txt"), "-o", self.path("a.svg"))
        self.assertEqual(r.returncode, 0, r.stderr)
        svg = ET.parse(self.path("a.svg")).getroot()
        labels = texts(svg)
        for want in ("Tandem (shm)", "Open MPI", "Open MPI, no CMA", "gloo (torch)", "4 KiB", "1 MiB"):
            self.assertIn(want, labels)
        self.assertEqual(len(polylines(svg)), 4, "Tandem, two Open MPI variants, gloo; no TCP, no memory bandwidth")

    def test_ps_shows_push_pull_and_the_baseline(self):
        rows = [{"size_bytes": s, "push_gbps": 1.0, "pull_gbps": 2.0, "ucx_perftest_gbps": None if s == 65536 else 9.0,
                 "ucx_perftest_rtt_gbps": 8.0 if s < (4 << 20) else None}
                for s in (65536, 1 << 20, 4 << 20)]
        jsonl = self.write("ps.jsonl", rows, junk="bench ps: a progress line\n")
        r = run("ps", jsonl, "-o", self.path("ps.svg"))
        self.assertEqual(r.returncode, 0, r.stderr)
        svg = ET.parse(self.path("ps.svg")).getroot()
        self.assertEqual([len(l) for l in polylines(svg)], [3, 3, 2, 2], "a missing baseline point is left out")
        self.assertIn("UCX request/reply", texts(svg))

    def test_ps_results_without_the_request_reply_baseline_still_draw(self):
        rows = [{"size_bytes": s, "push_gbps": 1.0, "pull_gbps": 2.0, "ucx_perftest_gbps": 9.0} for s in (65536, 1 << 20)]
        r = run("ps", self.write("old.jsonl", rows), "-o", self.path("old.svg"))
        self.assertEqual(r.returncode, 0, r.stderr)
        svg = ET.parse(self.path("old.svg")).getroot()
        self.assertEqual(len(polylines(svg)), 3)
        self.assertNotIn("UCX request/reply", texts(svg))

    def test_bad_input_is_named(self):
        r = run("run", self.path("nowhere"))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("nowhere", r.stderr)
        self.assertNotIn("Traceback", r.stderr)
        bad = self.write("bad.jsonl", [], junk='{"step": 1,\n')
        r = run("ps", bad)
        self.assertNotEqual(r.returncode, 0)
        self.assertTrue(re.search(r"bad\.jsonl line 1 is not JSON", r.stderr), r.stderr)
        empty = self.write("empty.jsonl", [])
        r = run("ps", empty)
        self.assertIn("has no results", r.stderr)


if __name__ == "__main__":
    unittest.main()
