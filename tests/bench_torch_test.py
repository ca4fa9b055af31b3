#!/usr/bin/env python3
"""bench/torch_bench.py (`tandem bench torch`) and bench/torch_ddp.py without
running a benchmark (and without torch): the argument handling, the commands
of one round, the rows and their JSON keys, and the DDP ranks' CPUs and
samples, which must match `tandem run`'s (common/cpus.cc, the tandem
package's contiguous split)."""
import json
import os
import subprocess
import sys
import unittest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")
sys.path.insert(0, BENCH)

import torch_bench  # noqa: E402
import torch_ddp  # noqa: E402

SCRIPT = os.path.join(BENCH, "torch_bench.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60)


class ArgumentsTest(unittest.TestCase):
    def test_defaults(self):
        a = torch_bench.parse_args([])
        self.assertEqual(a.configs, ["default", "comm-heavy"])
        self.assertEqual(a.modes, ["hybrid", "allreduce", "ps"])
        self.assertEqual((a.rounds, a.nodes, a.workers_per_node, a.servers), (3, 2, 2, 2))
        self.assertEqual(a.extra, [])

    def test_bad_values_exit_2_naming_them(self):
        for args, word in [
            (["--modes", "hybrid,nope"], "nope"),
            (["--config", "huge"], "huge"),
            (["--steps", "1"], "--steps"),
            (["--rounds", "0"], "--rounds"),
            (["--frobnicate"], "--frobnicate"),
        ]:
            r = run("--dry-run", *args)
            self.assertEqual(r.returncode, 2, (args, r.stdout, r.stderr))
            self.assertIn(word, r.stderr, args)

    def test_dry_run_prints_the_commands_of_one_round(self):
        r = run("--dry-run", "--bin-dir", "/opt/tandem/bin", "--config", "comm-heavy", "--modes", "hybrid,allreduce",
                "--steps", "7", "--nodes", "3", "--servers", "1", "--", "--layers", "2")
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = [l for l in r.stdout.splitlines() if not l.startswith("#")]
        self.assertEqual(len(lines), 3, r.stdout)
        ddp, hybrid, allreduce = lines
        self.assertIn("torch_ddp.py", ddp)
        self.assertIn("--nprocs 6", ddp)
        for line in lines:
            # The example gets the same steps, batch, config flags and extra
            # arguments on both sides.
            tail = line.split(" -- ", 1)[1]
            self.assertEqual(tail, "--steps 7 --global-batch 8 --d-model 256 --context 8 --layers 2", line)
        self.assertTrue(hybrid.startswith("/opt/tandem/bin/tandem run --script "), hybrid)
        for want in ("--mode hybrid", "--nodes 3", "--workers-per-node 2", "--steps 7", "--train-global-batch 8",
                     "--servers 1", "--network loopback", "--summary "):
            self.assertIn(want, hybrid)
        self.assertIn("--mode allreduce", allreduce)
        self.assertNotIn("--servers", allreduce.split(" -- ")[0])

    def test_global_batch_overrides_the_config(self):
        a = torch_bench.parse_args(["--global-batch", "32", "--config", "default"])
        self.assertIn("--global-batch 32", " ".join(torch_bench.example_args(a, "default")))
        self.assertIn("--train-global-batch 32", " ".join(torch_bench.tandem_command(a, "default", "ps", "S")))


class RowsTest(unittest.TestCase):
    def rows(self, **kw):
        a = torch_bench.parse_args(["--modes", "hybrid,allreduce", "--rounds", "3"])
        ddp = [{"tokens_per_second": v, "step_seconds_median": 0.1, "last_loss": 2.5, "parameters": 867072}
               for v in (1000.0, 1200.0, 1100.0)]
        tandem = {
            "hybrid": [{"tokens_per_second": v, "exposed_comm_fraction": e, "step_seconds_median": 0.09,
                        "last_loss": 2.5} for v, e in ((1500.0, 0.2), (1300.0, 0.1), (1400.0, 0.3))],
            "allreduce": [],
        }
        return torch_bench.make_rows("default", a, kw.get("ddp", ddp), tandem, kw.get("failures", {}), "Test CPU")

    def test_medians_and_ratio(self):
        hybrid, allreduce = self.rows()
        self.assertEqual(tuple(hybrid), torch_bench.ROW_KEYS)
        self.assertEqual(hybrid["mode"], "hybrid")
        self.assertEqual(hybrid["model"], "gpt")
        self.assertEqual(hybrid["parameters"], 867072)
        self.assertEqual((hybrid["workers"], hybrid["servers"]), (4, 2))
        self.assertEqual(hybrid["tandem_tokens_per_second"], 1400.0)
        self.assertEqual(hybrid["ddp_tokens_per_second"], 1100.0)
        self.assertAlmostEqual(hybrid["ratio"], 1400 / 1100)
        self.assertAlmostEqual(hybrid["exposed_comm_fraction"], 0.2)
        # Each round's ratio: 1.5, 1.0833, 1.2727.
        self.assertAlmostEqual(hybrid["round_ratio"], 1400 / 1100)
        self.assertEqual(hybrid["tandem_runs"], [1500.0, 1300.0, 1400.0])
        self.assertEqual((hybrid["cpu"], hybrid["rounds"], hybrid["config"]), ("Test CPU", 3, "default"))
        # A mode with no successful run has nulls, not zeros.
        self.assertEqual(allreduce["servers"], 0)
        self.assertIsNone(allreduce["tandem_tokens_per_second"])
        self.assertIsNone(allreduce["ratio"])

    def test_a_failed_round_is_left_out_of_the_medians(self):
        a = torch_bench.parse_args(["--modes", "ps", "--rounds", "3"])
        ddp = [{"tokens_per_second": 100.0}, None, {"tokens_per_second": 300.0}]
        tandem = {"ps": [{"tokens_per_second": 150.0}, {"tokens_per_second": 900.0}, None]}
        (row,) = torch_bench.make_rows("comm-heavy", a, ddp, tandem, {"ddp": 1, "ps": 1}, "c")
        self.assertEqual(row["ddp_tokens_per_second"], 200.0)
        self.assertEqual(row["tandem_tokens_per_second"], 525.0)
        self.assertEqual(row["round_ratio"], 1.5)  # only round 1 has both
        self.assertEqual(row["tandem_runs"], [150.0, 900.0, None])
        self.assertEqual(row["ddp_runs"], [100.0, None, 300.0])
        self.assertEqual(row["failures"], 2)
        self.assertTrue(json.loads(torch_bench.format_json(row)))
        torch_bench.format_row(row)

    def test_json_and_table(self):
        for row in self.rows(failures={"allreduce": 3}):
            parsed = json.loads(torch_bench.format_json(row))
            for key in ("model", "parameters", "mode", "workers", "servers", "tandem_tokens_per_second",
                        "ddp_tokens_per_second", "ratio", "exposed_comm_fraction", "config", "cpu", "rounds"):
                self.assertIn(key, parsed)
            line = torch_bench.format_row(row)
            self.assertTrue(line.startswith(row["mode"]), line)
        self.assertIn("1.27x", torch_bench.format_row(self.rows()[0]))
        self.assertEqual(self.rows(failures={"allreduce": 3})[1]["failures"], 3)


class DdpRanksTest(unittest.TestCase):
    def test_cpus_as_tandem_run_binds_workers(self):
        # common/cpus.cc ShareOfCpus: contiguous blocks, the first n % k one more.
        self.assertEqual([torch_ddp.share_of_cpus(range(8), i, 3) for i in range(3)], [[0, 1, 2], [3, 4, 5], [6, 7]])
        # Fewer CPUs than ranks: one each, round robin.
        self.assertEqual([torch_ddp.share_of_cpus([0, 1], i, 4) for i in range(4)], [[0], [1], [0], [1]])
        self.assertEqual(torch_ddp.share_of_cpus([], 0, 4), [])

    def test_samples_split_contiguously(self):
        for batch, world in ((16, 4), (10, 4), (3, 4)):
            for step in (1, 2, 5):
                pieces = [torch_ddp.rank_samples(step, batch, r, world) for r in range(world)]
                flat = [i for p in pieces for i in p]
                self.assertEqual(flat, list(range((step - 1) * batch, step * batch)))
                self.assertLessEqual(max(map(len, pieces)) - min(map(len, pieces)), 1)


if __name__ == "__main__":
    unittest.main()
