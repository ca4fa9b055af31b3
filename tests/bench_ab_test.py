#!/usr/bin/env python3
"""scripts/bench_ab.py: alternating runs of two builds, medians, spreads and
the verdict, with stand-in binaries that print fixed JSON rows."""
import json
import os
import stat
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "bench_ab.py")


def fake(dir_, name, values):
    """A stand-in tandem that prints row i of `values` on its i-th run and
    records its arguments."""
    path = os.path.join(dir_, name)
    state = os.path.join(dir_, name + ".count")
    with open(path, "w") as f:
        f.write(f"""#!{sys.executable}
import json, os, sys
values = {values!r}
n = int(open({state!r}).read()) if os.path.exists({state!r}) else 0
open({state!r}, "w").write(str(n + 1))
open({path!r} + ".args", "w").write(" ".join(sys.argv[1:]))
for size, us in values[n % len(values)]:
    print(json.dumps({{"size_bytes": size, "push_us": us, "tokens_per_second": 1e6 / us}}))
""")
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


class BenchAbTest(unittest.TestCase):
    def run_ab(self, old_values, new_values, *metrics):
        with tempfile.TemporaryDirectory() as d:
            old = fake(d, "old", old_values)
            new = fake(d, "new", new_values)
            out = os.path.join(d, "rows.jsonl")
            p = subprocess.run([sys.executable, SCRIPT, "--old", old, "--new", new, "--rounds", "3", "--key",
                                "size_bytes", *sum((["--metric", m] for m in metrics), []), "--out", out, "--",
                                "bench", "ps", "--json"], capture_output=True, text=True, timeout=60)
            rows = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
            args = open(old + ".args").read()
            return p, rows, args

    def test_same_within_the_noise(self):
        old = [[(65536, 10.0), (1 << 20, 100.0)], [(65536, 11.0), (1 << 20, 110.0)], [(65536, 12.0), (1 << 20, 90.0)]]
        new = [[(65536, 11.5), (1 << 20, 100.0)], [(65536, 11.0), (1 << 20, 105.0)], [(65536, 10.5), (1 << 20, 95.0)]]
        p, rows, args = self.run_ab(old, new, "push_us:lower")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(args, "bench ps --json")
        self.assertEqual(len(rows), 12)  # 3 rounds x 2 builds x 2 sizes
        self.assertEqual([r["build"] for r in rows[:4]], ["old", "old", "new", "new"])  # alternating, old first
        line = next(l for l in p.stdout.splitlines() if l.startswith("| 65536 |"))
        # medians 11 and 11: ratio 1.000, the old build's spread (12-10)/11.
        self.assertIn("| 11 | 11 | 1.000 | 18.2% |", line)
        self.assertTrue(line.endswith("| same |"))

    def test_slower_beyond_the_noise_fails_and_faster_is_said(self):
        old = [[(65536, 10.0)], [(65536, 10.1)], [(65536, 10.0)]]
        new = [[(65536, 12.0)], [(65536, 12.0)], [(65536, 12.1)]]
        p, _, _ = self.run_ab(old, new, "push_us:lower", "tokens_per_second:higher")
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        lines = [l for l in p.stdout.splitlines() if l.startswith("| 65536 |")]
        self.assertTrue(lines[0].endswith("| slower |"), lines[0])
        self.assertTrue(lines[1].endswith("| slower |"), lines[1])  # fewer tokens/s
        p, _, _ = self.run_ab(new, old, "push_us:lower")
        self.assertEqual(p.returncode, 0)
        self.assertTrue(next(l for l in p.stdout.splitlines() if l.startswith("| 65536 |")).endswith("| faster |"))

    def test_bad_arguments_are_named(self):
        with tempfile.TemporaryDirectory() as d:
            old = fake(d, "old", [[(1, 1.0)]])
            p = subprocess.run([sys.executable, SCRIPT, "--old", old, "--new", old, "--key", "size_bytes", "--metric",
                                "push_us:sideways", "--", "bench"], capture_output=True, text=True, timeout=60)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("NAME:lower or NAME:higher", p.stderr)
            p = subprocess.run([sys.executable, SCRIPT, "--old", os.path.join(d, "missing"), "--new", old, "--key",
                                "size_bytes", "--metric", "push_us:lower", "--", "bench"], capture_output=True,
                               text=True, timeout=60)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("cannot run", p.stderr)


if __name__ == "__main__":
    unittest.main()
