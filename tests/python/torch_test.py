"""Tests of the PyTorch front end (tandem.torch): bad input in one process,
and training on local clusters started by `tandem run --script`.

Run by ctest (tests/CMakeLists.txt) as
  /usr/bin/python3 tests/python/torch_test.py [TestClass]
with TANDEM_BUILD_DIR set to the build tree. Each cluster run bounds its own
time (`tandem run --timeout`) and `tandem run` stops every process it started.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fit_script.py")
BUILD = os.environ.get("TANDEM_BUILD_DIR", os.path.join(HERE, "..", "..", "build"))
TANDEM = os.path.join(BUILD, "bin", "tandem")
PYTHON = "/usr/bin/python3"


def env(**extra):
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(BUILD, "python") + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("TANDEM_WORKER_FLAGS", None)
    e.pop("TANDEM_DESCRIBE", None)
    e.update(extra)
    return e


def run_alone(*args, timeout=120, **extra):
    return subprocess.run([PYTHON, SCRIPT, *args], env=env(**extra), capture_output=True, text=True, timeout=timeout)


def params(path):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.float32)


def run_cluster(work, script_args, *, nodes=2, per_node=1, servers=2, mode="hybrid", steps=8, extra=(), timeout=240):
    summary = os.path.join(work, "summary.json")
    cmd = [
        TANDEM, "run", "--script", SCRIPT, "--nodes", str(nodes), "--workers-per-node", str(per_node),
        "--servers", str(servers), "--mode", mode, "--steps", str(steps), "--summary", summary,
        "--timeout", f"{timeout - 20}s", "--network", "loopback", *extra, "--", *script_args,
    ]
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    result = None
    if os.path.exists(summary):
        with open(summary) as f:
            result = json.load(f)
    return p, result


# Partitions and buckets of 4 KiB: a model of a few thousand parameters
# travels in many buckets.
SMALL_BUCKETS = ("--partition-size", "4KiB", "--train-bucket-bytes", "4KiB")


class BadInputTest(unittest.TestCase):
    """Every bad input gets an exception that names what is wrong (one process)."""

    def expect(self, args, error, text, mode_flags=None):
        extra = {}
        if mode_flags:
            # As `tandem run` looks at a script: its train flags, describe mode.
            extra = {"TANDEM_WORKER_FLAGS": json.dumps(mode_flags),
                     "TANDEM_DESCRIBE": os.path.join(tempfile.mkdtemp(), "d.json")}
        p = run_alone(*args, **extra)
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn(error, p.stderr)
        self.assertIn(text, p.stderr)

    def test_parameter_not_fp32(self):
        self.expect(["--bad", "fp64"], "TypeError", "is torch.float64, not torch.float32")

    def test_parameter_not_contiguous(self):
        self.expect(["--bad", "noncontiguous"], "ValueError", "'0.weight' is not a dense contiguous tensor")

    def test_parameter_resized_after_the_optimizer(self):
        self.expect(["--bad", "resize"], "RuntimeError", "'2.bias' was replaced or resized after the DistributedOptimizer was created")

    def test_parameter_group_added_after_the_optimizer(self):
        self.expect(["--bad", "add_group"], "RuntimeError", "parameters were added to the optimizer")

    def test_parameter_without_gradient(self):
        self.expect(["--bad", "unused"], "RuntimeError", "backward gave no gradient to extra.weight, extra.bias")

    def test_second_backward_without_no_sync(self):
        self.expect(["--bad", "twice"], "RuntimeError", "got a second gradient in step 1")

    def test_optimizers_the_servers_do_not_run(self):
        flags = ["--train-mode", "ps"]
        self.expect(["--optimizer", "rmsprop"], "TypeError", "torch.optim.rmsprop.RMSprop is not an optimizer", flags)
        self.expect(["--optimizer", "amsgrad"], "ValueError", "amsgrad=True is set", flags)
        self.expect(["--optimizer", "betas"], "ValueError", "param_groups[1]['betas'] = (0.8, 0.9) differs", flags)

    def test_non_finite_gradient_is_skipped_or_fails(self):
        p = run_alone("--bad", "nan", "--steps", "3")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("step 2: the averaged gradient holds NaN or Inf; the update is skipped", p.stderr)

    def test_describe_mode_writes_the_parameter_count(self):
        out = os.path.join(tempfile.mkdtemp(), "d.json")
        p = run_alone(TANDEM_DESCRIBE=out)
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(out) as f:
            self.assertEqual(json.load(f), {"parameters": 8 * 16 + 16 + 16 * 4 + 4, "tensors": 4})

    def test_alone_with_accumulation_equals_alone_without(self):
        d = tempfile.mkdtemp()
        a, b = os.path.join(d, "a"), os.path.join(d, "b")
        self.assertEqual(run_alone("--out", a, "--steps", "4").returncode, 0)
        p = run_alone("--out", b, "--steps", "4", "--accumulate", "2")
        self.assertEqual(p.returncode, 0, p.stderr)
        torch.testing.assert_close(params(a), params(b), rtol=1e-5, atol=1e-6)


class ClusterTest(unittest.TestCase):
    """N workers train to the parameters one process reaches with the unwrapped optimizer.

    Tolerance: the workers sum their shares of the batch in another order
    than one process does (fp32 rounding, ~1e-7 relative per step); over 8
    steps of SGD or AdamW on this smooth problem the difference stays below
    1e-5 relative, and an error in the update (a gradient not scaled by its
    share, a missed group override, an lr not forwarded) shows at 1e-2 or more.
    """

    def reference(self, work, args):
        out = os.path.join(work, "alone.bin")
        p = run_alone(*args, "--out", out, "--losses", os.path.join(work, "alone.losses"))
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(os.path.join(work, "alone.losses")) as f:
            self.ref_losses = json.load(f)
        return params(out)

    def check_modes(self, args, per_node, extra=()):
        work = tempfile.mkdtemp(prefix="tandem-torch-test-")
        ref = self.reference(work, args + ["--steps", "8"])
        for mode in ("allreduce", "hybrid", "ps"):
            with self.subTest(mode=mode):
                out = os.path.join(work, f"{mode}.bin")
                p, summary = run_cluster(work, args + ["--out", out], per_node=per_node, mode=mode, extra=extra)
                self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
                self.assertTrue(summary["completed"], summary)
                self.assertEqual(summary["steps"], 8)
                self.assertEqual(summary["world_size"], 2 * per_node)
                if mode != "allreduce":
                    self.assertEqual(summary["server_steps_applied"], 8)
                torch.testing.assert_close(params(out), ref, rtol=1e-5, atol=1e-6)
                # The progress figures: every rank's loss weighted by its share,
                # summed with the step (reported before opt.step()) or after it.
                torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(self.ref_losses),
                                           rtol=1e-4, atol=1e-6)

    def test_two_workers_sgd_momentum(self):
        self.check_modes(["--optimizer", "sgd"], per_node=1)

    def test_four_workers_adamw_with_groups_and_a_scheduler(self):
        # 13 partitions of 1,024 parameters, a bucket each: in the server modes
        # all but the first land while the next step's forward runs.
        self.check_modes(["--optimizer", "adamw", "--schedule", "--hidden", "1024", "--report-first"], per_node=2, extra=SMALL_BUCKETS)

    def test_a_torch_optimizer_state_loads_into_the_servers(self):
        """Steps 1-4 alone, saved as torch saves them (parameters, AdamW's
        state_dict); steps 5-8 on 2 workers in hybrid and ps modes after
        load_state_dict: the parameters of 8 steps alone (moments and update
        count carried over)."""
        work = tempfile.mkdtemp(prefix="tandem-torch-test-")
        args = ["--optimizer", "adamw"]
        ref = self.reference(work, args + ["--steps", "8"])
        half, state = os.path.join(work, "half.bin"), os.path.join(work, "half.state")
        p = run_alone(*args, "--steps", "4", "--out", half, "--save-state", state)
        self.assertEqual(p.returncode, 0, p.stderr)
        for mode in ("hybrid", "ps"):
            with self.subTest(mode=mode):
                out = os.path.join(work, f"{mode}.bin")
                p, summary = run_cluster(
                    work, args + ["--load-params", half, "--load-state", state, "--first-sample", str(4 * 16),
                                  "--out", out], mode=mode, steps=4)
                self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
                # The servers count updates: the 4 the loaded state had seen and 4 more.
                self.assertEqual(summary["server_steps_applied"], 8)
                self.assertEqual(summary["steps"], 4)
                torch.testing.assert_close(params(out), ref, rtol=1e-5, atol=1e-6)

    def test_a_parameter_read_outside_its_module_is_refused(self):
        """With parameters landing during the forward, a parameter the forward
        reads without its module's forward (where Tandem waits for it) fails
        the run, naming it, rather than train on an old value."""
        work = tempfile.mkdtemp(prefix="tandem-torch-test-")
        # Without restarts: a restarted worker would meet the same error later.
        p, _ = run_cluster(work, ["--bad", "outside", "--report-first"], steps=4, extra=("--restarts", "0"))
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("parameter '2.bias' was used in step 2 outside the forward of the module that holds it",
                      p.stdout + p.stderr)


class ElasticTest(unittest.TestCase):
    def test_killed_and_added_worker(self):
        """A worker killed with SIGKILL and one added later: every step applied
        once, every sample of the run trained once, the same result as one process."""
        self.check_elastic("hybrid", ["--optimizer", "adamw", "--hidden", "1024", "--report-first"], SMALL_BUCKETS)

    def test_killed_and_added_worker_in_allreduce_mode(self):
        """The same without servers: the optimizer's and the scheduler's state
        travel from a survivor to the worker that joins."""
        self.check_elastic("allreduce", ["--optimizer", "adamw", "--schedule"])

    def test_every_server_killed_rolls_the_job_back_to_its_checkpoint(self):
        """Both servers killed at once: every partition loses both copies,
        and the workers roll the job back to its latest checkpoint (every 4
        steps) and train the steps since again, with the same samples and
        the learning-rate schedule back where it was: the result of one
        process."""
        work = tempfile.mkdtemp(prefix="tandem-torch-rollback-")
        args = ["--optimizer", "adamw", "--schedule", "--decay"]
        ref_out = os.path.join(work, "alone.bin")
        self.assertEqual(run_alone(*args, "--steps", "16", "--out", ref_out).returncode, 0)
        out = os.path.join(work, "rollback.bin")
        p, summary = run_cluster(
            work, args + ["--out", out, "--step-sleep", "0.1"], steps=16,
            extra=["--train-checkpoint-every", "4", "--train-checkpoint-dir", os.path.join(work, "ckpt"),
                   "--inject", "kill:servers@10"],
        )
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        self.assertTrue(summary["completed"], summary)
        self.assertEqual(summary["rollbacks"], 1, summary)
        self.assertGreaterEqual(summary["steps_redone"], 1, summary)
        self.assertEqual(summary["server_steps_applied"], 16)
        self.assertIn("rolled the job back from step", p.stdout + p.stderr)
        torch.testing.assert_close(params(out), params(ref_out), rtol=1e-4, atol=1e-5)

    def check_elastic(self, mode, args, extra=()):
        work = tempfile.mkdtemp(prefix="tandem-torch-elastic-")
        log = os.path.join(work, "samples.jsonl")
        out = os.path.join(work, f"{mode}.bin")
        ref_out = os.path.join(work, "alone.bin")
        self.assertEqual(run_alone(*args, "--steps", "12", "--out", ref_out).returncode, 0)
        p, summary = run_cluster(
            work, args + ["--out", out, "--step-sleep", "0.1"], per_node=2, steps=12, mode=mode,
            extra=["--kill-worker-at", "4", "--add-worker-at", "8", "--train-sample-log", log, *extra],
        )
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        self.assertTrue(summary["completed"], summary)
        self.assertEqual(summary["faults"], 1)
        self.assertEqual(summary["workers_added"], 1)
        if mode != "allreduce":
            self.assertEqual(summary["server_steps_applied"], 12)
        self.assertGreaterEqual(summary["epochs"], 3)
        # The attempts that completed: for each step, the lines of the last epoch that trained it.
        with open(log) as f:
            lines = [json.loads(x) for x in f]
        trained = []
        for step in range(1, 13):
            attempts = [x for x in lines if x["step"] == step]
            last = max(x["epoch"] for x in attempts)
            for x in attempts:
                if x["epoch"] == last:
                    trained.extend(x["samples"])
        self.assertEqual(sorted(trained), list(range(12 * 16)))
        torch.testing.assert_close(params(out), params(ref_out), rtol=1e-4, atol=1e-5)


class FailingScriptTest(unittest.TestCase):
    def test_a_script_that_raises_fails_the_run_naming_it(self):
        # Without restarts (the supervisor would otherwise start it again):
        # the run fails, naming the worker, its rank and its exception.
        work = tempfile.mkdtemp(prefix="tandem-torch-fail-")
        p, summary = run_cluster(work, ["--fail-at", "3"], steps=6, extra=("--restarts", "0"))
        self.assertNotEqual(p.returncode, 0)
        text = p.stdout + p.stderr
        self.assertIn("ValueError: the test script fails at step 3 on purpose", text)
        self.assertIn("rank 1", text)


if __name__ == "__main__":
    unittest.main(verbosity=2)
