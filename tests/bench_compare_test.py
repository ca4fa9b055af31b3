#!/usr/bin/env python3
"""scripts/bench_compare.py judges Tandem's all-reduce against the baselines:
in one run (the table of `make bench`) and in alternating rounds, where each
round's ratio uses that round's best Open MPI variant and a size is judged by
the median of the rounds."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "bench_compare.py")
MiB = 1 << 20


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60)


def mpi(variant, size, seconds):
    return f"RESULT|mpi_allreduce|{variant}|2|{size}|{seconds:.9f}|{seconds:.9f}|{seconds:.9f}|ok\n"


def tandem(size, us, wrong=0):
    return json.dumps({"collective": "allreduce", "np": 2, "size_bytes": size, "time_us": us,
                       "algbw_gbps": size / us / 1e3, "busbw_gbps": size / us / 1e3, "wrong": wrong}) + "\n"


class BenchCompareTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def write(self, name, text):
        path = os.path.join(self.dir.name, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_rounds_use_each_rounds_best_variant_and_the_median(self):
        text = ""
        # 1 MiB: Open MPI's best variant changes between rounds; ratios 2.0, 1.0, 3.0 (median 2.0).
        # 16 MiB: ratios 1.2, 1.4, 2.0 (median 1.4): missed.
        for r, (nocma, ring, ours, ours16) in enumerate([(100e-6, 200e-6, 50, 1200),
                                                         (300e-6, 60e-6, 60, 1000),
                                                         (90e-6, 95e-6, 30, 700)], 1):
            text += f"# round {r}\n"
            text += mpi("shm-vader-nocma", MiB, nocma) + mpi("shm-vader-ring", MiB, ring)
            text += mpi("shm-vader-nocma", 16 * MiB, 1440e-6 if r == 1 else 1400e-6)
            text += "bench: a progress line\n" + tandem(MiB, ours) + tandem(16 * MiB, ours16)
        out_md = os.path.join(self.dir.name, "rounds.md")
        r = run("--rounds", self.write("rounds.txt", text), out_md)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("| 1 MiB | 50.0 | 90.0 | 2.00, 1.00, 3.00 | **2.00** | 2 of 3 |", r.stdout)
        self.assertIn("| 16 MiB | 1000.0 | 1400.0 | 1.20, 1.40, 2.00 | **1.40** | 1 of 3 |", r.stdout)
        self.assertIn("missed: 16 MiB: median 1.400x the best Open MPI (target 1.5x).", r.stdout)
        self.assertNotIn("1 MiB: median", r.stdout)
        with open(out_md) as f:
            self.assertEqual(f.read(), r.stdout.rstrip("\n") + "\n")

    def test_wrong_results_are_named(self):
        text = "# round 1\n" + mpi("shm-vader", MiB, 100e-6) + tandem(MiB, 40, wrong=3)
        r = run("--rounds", self.write("rounds.txt", text))
        self.assertIn("1 MiB: 3 wrong elements", r.stdout)

    def test_a_file_without_rounds_is_an_error(self):
        r = run("--rounds", self.write("empty.txt", mpi("shm-vader", MiB, 1e-4)))
        self.assertEqual(r.returncode, 1)
        self.assertIn("holds no rounds", r.stderr)

    def test_one_run_table_names_the_missed_targets(self):
        raw = self.write("raw.txt", mpi("shm-vader", MiB, 100e-6) + mpi("shm-vader-nocma", MiB, 80e-6))
        ours = self.write("ours.jsonl", tandem(MiB, 60))
        r = run(raw, ours)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("(shm-vader-nocma) | **1.33**", r.stdout)
        self.assertIn("2 ranks 1 MiB: 1.33x the best Open MPI (target 1.5x)", r.stdout)


if __name__ == "__main__":
    unittest.main()
