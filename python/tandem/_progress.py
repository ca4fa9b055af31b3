"""Global rank 0's progress file and the tandem_train_* metrics of tandem.torch's training loop."""

import json
import os
import time
import warnings

from . import TandemError


class Progress:
    """Global rank 0's progress file and the tandem_train_* metrics."""

    def __init__(self, s, opt):
        self.s = s
        self.opt = opt
        cfg = s.config
        self.progress_file = cfg.progress_file
        self.sample_file = None
        if cfg.sample_log:
            self.sample_file = open(cfg.sample_log, "a")
        self.last_checkpoint = None
        self.records = []

    def sample_log(self, plan):
        if self.sample_file is None:
            return
        # Before the gradients leave: a step cannot complete without its line.
        line = {
            "step": plan.step,
            "epoch": plan.epoch,
            "dp_rank": plan.dp_rank,
            "dp_size": plan.dp_size,
            "start": time.time(),
            "time": time.time(),
            "samples": list(plan.samples),
        }
        self.sample_file.write(json.dumps(line) + "\n")
        self.sample_file.flush()

    def record(self, plan, seconds):
        rep = plan.reported  # (loss or None, samples, tokens), or None
        result = plan.result
        nan = float("nan")
        if rep is None:
            rep = (None, len(plan.samples), 0)
        if self.s.worker is None:
            loss, samples, tokens = (rep[0] if rep[0] is not None else nan), rep[1], rep[2]
        elif self.s.config.consistency != "sync":
            # Asynchronous modes: no collective between steps; this worker's own figures.
            loss = rep[0] if rep[0] is not None else nan
            samples, tokens = rep[1] * plan.dp_size, rep[2] * plan.dp_size
        else:
            # The figures reported before opt.step() were summed with the
            # step (_DistributedOptimizer.step). Every rank sees the same
            # count of ranks that had not reported by then: when it is not
            # zero, every rank (whether it reports late or not at all) takes
            # part in one more small sum of what came after.
            total_loss, shares, samples, tokens, late = plan.summed
            if late > 0:
                early = plan.reported_at_step
                mine = [0.0, 0.0, 0.0, 0.0]
                if early is None:  # reported after opt.step(), or not at all (its samples, no loss)
                    mine = [(rep[0] or 0.0) * plan.share, plan.share if rep[0] is not None else 0.0, float(rep[1]),
                            float(rep[2])]
                try:
                    self.opt._land_all()  # nothing else in flight beside the sum
                except TandemError as e:
                    if e.fatal:
                        raise
                    # Every rank takes part in the sum all the same (it fails
                    # at once if the epoch is over); the next step resyncs.
                try:
                    more = self.s.worker.allreduce_between_steps(mine)
                    total_loss, shares, samples, tokens = (a + b for a, b in
                                                           zip((total_loss, shares, samples, tokens), more))
                except TandemError:
                    shares = 0.0
            loss = total_loss / shares if shares > 0 else nan
        exposed = result.exposed_seconds if result is not None else 0.0
        record = {
            "step": plan.step,
            "epoch": plan.epoch,
            "loss": float(loss),
            "tokens": int(tokens),
            "samples": int(samples),
            "step_seconds": seconds,
            "compute_seconds": max(0.0, seconds - exposed),
            "comm_seconds": result.comm_seconds if result is not None else 0.0,
            "exposed_seconds": exposed,
            "world_size": plan.world_size,
            "rank": plan.rank,
            "retries": plan.attempt,
            "resynced": plan.resynced,
            "parameter_bytes": self.opt._flat_params.numel() * 4,
        }
        self.records.append(record)
        if self.s.worker is None:
            return
        line = self.s.worker.record_step(record)
        if plan.rank == 0 and self.progress_file:
            with open(self.progress_file, "a") as f:
                f.write(line + "\n")

    def rollback(self, rollback, rank):
        # The epoch's rank 0 tells the progress file (`tandem run` counts
        # rollbacks and steps redone from it).
        if rank == 0 and self.progress_file:
            with open(self.progress_file, "a") as f:
                f.write(rollback["line"] + "\n")

    def checkpoint(self, plan, total):
        cfg = self.s.config
        if (
            plan.rank != 0
            or not cfg.checkpoint_dir
            or cfg.checkpoint_every <= 0
            or self.opt._mode == "allreduce"
            or plan.step % cfg.checkpoint_every != 0
            or plan.step == total
        ):
            return
        try:
            self.last_checkpoint = self.s.worker.save_checkpoint(cfg.checkpoint_dir, plan.step, 600.0)
        except TandemError as e:
            if e.fatal:
                raise
            warnings.warn(f"step {plan.step}: the checkpoint was not saved: {e.message}")

    def finish(self, total):
        s = self.s
        cfg = s.config
        if self.sample_file is not None:
            self.sample_file.close()
        if s.worker is None:
            return
        plan = s.last_plan
        if plan is None or plan.rank != 0:
            return
        if cfg.params_out:
            tmp = cfg.params_out + ".tmp"
            with open(tmp, "wb") as f:
                f.write(self.opt._flat_params.numpy().tobytes())
            os.replace(tmp, cfg.params_out)
        if cfg.checkpoint_dir and self.opt._mode != "allreduce":
            self.last_checkpoint = s.worker.save_checkpoint(cfg.checkpoint_dir, total, 600.0)
        if self.progress_file:
            with open(self.progress_file, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "finished": True,
                            "steps": s.worker.completed_steps(),
                            "checkpoint": self.last_checkpoint,
                            "time": time.time(),
                        }
                    )
                    + "\n"
                )
