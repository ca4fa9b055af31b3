"""tandem.torch: train a PyTorch model on Tandem (docs/pytorch.md).

A training script becomes a Tandem worker with a few lines::

    import tandem.torch as tt
    tt.init()
    model = Net()
    opt = tt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
                                  named_parameters=model.named_parameters())
    for plan in tt.steps(1000, global_batch=64):
        x, y = batch(plan.samples)           # this rank's share of the step's global batch
        opt.zero_grad()
        loss = loss_fn(model(x), y)          # the mean over this rank's samples
        loss.backward()                      # gradients leave in buckets during backward
        tt.report(loss=loss.item(), samples=len(plan.samples))
        opt.step()                           # on the servers (hybrid, ps) or locally (allreduce)

Under ``tandem run --script`` (or with a coordinator named in the flags) the
process registers with the coordinator, serves gRPC health and /metrics and
joins the job's membership epochs like any tandem-worker. Without either it
runs alone (one process, the wrapped optimizer stepping locally), so the same
script trains unchanged as a single process.

Membership changes are hidden by ``steps()``: when a worker dies or joins,
the step in flight fails, the parameters are resynchronised (from the
servers, or from a surviving worker in allreduce mode, with the optimizer's
and the LR schedulers' state) and the same step is yielded again with the new
rank and world size, so no update is lost or applied twice and every sample
of the step is trained once.
"""

import atexit
import contextlib
import copy
import io
import json
import math
import os
import signal
import sys
import time
import warnings
import weakref

import torch

from . import TandemError, _tandem
from ._progress import Progress
from ._server_optimizer import optimizer_text
from . import builtin_corpus  # noqa: F401  (re-exported: tandem.torch.builtin_corpus)

__all__ = [
    "init",
    "shutdown",
    "config",
    "rank",
    "world_size",
    "is_distributed",
    "DistributedOptimizer",
    "steps",
    "report",
    "synchronize",
    "Plan",
    "Config",
    "TandemError",
    "builtin_corpus",
]

_MODES = ("hybrid", "allreduce", "ps")
# torch modules whose forward reads their children's parameters without
# calling the children (landing waits for the whole module's).
_READS_CHILDREN = (
    torch.nn.MultiheadAttention,
    torch.nn.TransformerEncoderLayer,
    torch.nn.TransformerDecoderLayer,
    torch.nn.TransformerEncoder,
    torch.nn.TransformerDecoder,
    torch.nn.Transformer,
)
# The learning rate a push carries for a step whose rate is exactly 0: the
# wire reserves 0 for "the servers' own schedule". In fp32 it rounds to 0.
_ZERO_LR = 5e-324


class Config:
    """The worker's train.* configuration (flags, YAML, or `tandem run`'s)."""

    def __init__(self, values):
        self._values = dict(values)
        for key, value in values.items():
            setattr(self, key, value)

    def __repr__(self):
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in sorted(self._values.items())) + ")"


# The defaults of a single process (train.* defaults of a tandem-worker).
_LOCAL_CONFIG = {
    "steps": 0,
    "mode": "hybrid",
    "data": "",
    "seed": 1,
    "global_batch": 16,
    "accumulation": 1,
    "consistency": "sync",
    "staleness_bound": 2,
    "max_grad_norm": 0.0,
    "bucket_bytes": 1 << 20,
    "gradient_wire": "fp32",
    "parameter_wire": "fp32",
    "step_timeout_ms": 60000,
    "epoch_wait_ms": 60000,
    "progress_file": "",
    "params_out": "",
    "sample_log": "",
    "checkpoint_dir": "",
    "checkpoint_every": 0,
    "resume_from": "",
}


class _Session:
    def __init__(self, worker, cfg, describe):
        self.worker = worker  # None: a single process
        self.config = cfg
        self.describe = describe  # TANDEM_DESCRIBE: write the model's size and exit
        self.optimizer = None
        self.plan = None
        self.last_plan = None
        self.exit_code = None


_session = None


def _flags_from_env():
    text = os.environ.get("TANDEM_WORKER_FLAGS")
    if not text:
        return None
    try:
        flags = json.loads(text)
    except ValueError as e:
        raise ValueError(f"TANDEM_WORKER_FLAGS is not a JSON array of strings: {e}") from None
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise ValueError("TANDEM_WORKER_FLAGS is not a JSON array of strings")
    return flags


def init(args=None):
    """Makes this process a Tandem worker, or a single process.

    ``args`` are tandem-worker flags (``["--coordinator-address", "host:7400",
    "--config", "worker.yaml", ...]``; ``tandem-worker --help`` lists them),
    added after those in the environment variable ``TANDEM_WORKER_FLAGS``
    (a JSON array, set by ``tandem run --script``). With neither, the process
    trains alone. Returns the configuration (as ``config()``).
    """
    global _session
    if _session is not None:
        return _session.config
    flags = _flags_from_env()
    if args is not None:
        flags = (flags or []) + [str(a) for a in args]
    describe = os.environ.get("TANDEM_DESCRIBE") or None
    if flags is None or describe:
        cfg = dict(_LOCAL_CONFIG)
        if flags and describe:
            # Describing the model for the launcher: the train.* flags that
            # shape it, without starting a worker.
            cfg.update(_train_flags(flags))
        _session = _Session(None, Config(cfg), describe)
        return _session.config
    worker = _tandem.Worker(["tandem-worker (python)"] + flags)
    if not worker.running:  # --help or --version
        print(worker.help, end="")
        sys.exit(0)
    _session = _Session(worker, Config(worker.train_config()), None)
    _install_signal_handlers(worker)
    atexit.register(_shutdown_at_exit)
    return _session.config


def _train_flags(flags):
    """The train.* values among tandem-worker flags (for describe mode)."""
    out = {}
    i = 0
    while i < len(flags):
        flag = flags[i]
        value = None
        if flag.startswith("--train-"):
            if "=" in flag:
                flag, value = flag.split("=", 1)
            elif i + 1 < len(flags):
                value = flags[i + 1]
                i += 1
            key = flag[len("--train-") :].replace("-", "_")
            if key in _LOCAL_CONFIG and value is not None:
                kind = type(_LOCAL_CONFIG[key])
                try:
                    out[key] = kind(value) if kind is not bool else value == "true"
                except ValueError:
                    pass
        i += 1
    return out


def _install_signal_handlers(worker):
    if os.name != "posix":
        return
    try:
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:
        # Not the main thread: signals keep Python's handlers.
        return
    worker.watch_wakeup_fd(r)

    def on_signal(signum, frame):
        # The runtime is already stopped (the C++ side watches the wakeup
        # fd); end the training loop here.
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def shutdown():
    """Leaves the job and stops the worker (also at exit). Returns the exit code a tandem-worker would give."""
    global _session
    s = _session
    if s is None or s.worker is None:
        return 0
    if s.exit_code is None:
        # A SIGTERM now (`tandem run` stopping the cluster) finds the worker
        # leaving already: nothing more to interrupt.
        # Ignored (not a Python handler): Python's finalisation puts its own
        # handlers back to the default, which a late SIGTERM would die of.
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        s.exit_code = s.worker.shutdown()
    return s.exit_code


def _shutdown_at_exit():
    if shutdown() != 0:
        # The daemon stopped for a failure: exit 1 as a tandem-worker would.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _require_session():
    if _session is None:
        init()
    return _session


def config():
    """The worker's train.* configuration (steps, global_batch, seed, data, mode, ...)."""
    return _require_session().config


def is_distributed():
    """Whether this process is a worker of a Tandem job (False: a single process)."""
    return _require_session().worker is not None


def rank():
    """This worker's global rank in the current step's epoch (0 alone)."""
    p = _require_session().last_plan
    return p.rank if p is not None else 0


def world_size():
    """Workers in the current step's epoch (1 alone)."""
    p = _require_session().last_plan
    return p.world_size if p is not None else 1


class Plan:
    """One step as ``steps()`` yields it.

    ``step`` (1-based), ``epoch``, ``rank`` and ``world_size`` (this
    worker's), ``dp_rank``/``dp_size`` (its data-parallel rank and size),
    ``samples`` (a ``range`` of global sample indices: this rank's contiguous
    share of the step's global batch ``[(step-1)*B, step*B)``), ``share``
    (``len(samples) / B``), ``resynced`` (parameters were reloaded for this
    step: after a membership change), ``attempt`` (0, or how many times
    this step failed before) and ``rolled_back`` (None, or a dict with
    ``from``, ``to`` and ``checkpoint`` when the job just went back to a
    checkpoint because partitions lost both copies: the steps after ``to``
    are yielded again, so a loop that reads ``plan.samples`` trains the
    same samples).
    """

    def __init__(self, step, epoch, rank, world_size, dp_rank, dp_size, global_batch, resynced, attempt):
        self.step = step
        self.epoch = epoch
        self.rank = rank
        self.world_size = world_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.global_batch = global_batch
        first = (step - 1) * global_batch
        self.samples = range(
            first + global_batch * dp_rank // dp_size, first + global_batch * (dp_rank + 1) // dp_size
        )
        self.share = len(self.samples) / global_batch
        self.resynced = resynced
        self.attempt = attempt
        self.rolled_back = None
        # Filled in during the step.
        self.completed = False
        self.failed = False
        self.landing_failed = False
        self.reported = None  # (loss, samples, tokens)
        self.reported_at_step = None  # what opt.step() sent with the step
        self.summed = None  # (loss x share, shares, samples, tokens, ranks not yet reported): the world's sums
        self.result = None

    def __repr__(self):
        return (
            f"Plan(step={self.step}, epoch={self.epoch}, rank={self.rank}, world_size={self.world_size}, "
            f"samples=range({self.samples.start}, {self.samples.stop}))"
        )


def report(loss=None, samples=None, tokens=None):
    """This rank's figures for the current step: its loss (the mean over its
    samples), samples and tokens. They feed the progress line, the
    tandem_train_* metrics and `tandem run`'s summary. Call it once per step,
    before or after ``opt.step()``; after the step one small all-reduce over
    the workers sums every rank's figures (a rank that does not report counts
    as no loss and no samples)."""
    s = _require_session()
    plan = s.plan
    if plan is None:
        raise RuntimeError("tandem.torch.report() outside a step: call it inside `for plan in tandem.torch.steps(...)`")
    if loss is not None:
        loss = float(loss.item() if isinstance(loss, torch.Tensor) else loss)
    n = len(plan.samples) if samples is None else int(samples)
    plan.reported = (loss, n, int(tokens or 0))


def synchronize():
    """Waits until the parameters of the last step have all landed.

    In the server modes the parameters of step N arrive from the servers
    while step N+1's forward runs: a module's forward waits for its own
    parameters only (``DistributedOptimizer(..., overlap_landing=True)``, the
    default). The model's forward, ``model.state_dict()``, the wrapper's
    ``state_dict()`` and the end of ``steps()`` wait by themselves; call this
    before reading parameters any other way between steps (``p.data``,
    ``p.clone()``, a hand-written copy)."""
    s = _require_session()
    if s.optimizer is not None:
        s.optimizer._land_all()


def steps(total_steps=None, global_batch=None):
    """Yields a ``Plan`` for each step 1..total_steps (default: the
    configuration's train.steps and train.global_batch).

    A step whose ``opt.step()`` failed (a worker died or joined) is yielded
    again after the parameters are resynchronised, with its new rank and
    share; the loop body should read ``plan.samples`` every time.
    """
    s = _require_session()
    total = int(total_steps if total_steps is not None else s.config.steps)
    batch = int(global_batch if global_batch is not None else s.config.global_batch)
    if total <= 0:
        raise ValueError("steps(): total_steps must be > 0 (or give train.steps, `tandem run --steps`)")
    if batch <= 0:
        raise ValueError("steps(): global_batch must be > 0")
    opt = s.optimizer
    if opt is None:
        raise RuntimeError("steps(): create the tandem.torch.DistributedOptimizer before the training loop")
    if s.worker is None:
        yield from _local_steps(s, opt, total, batch)
    else:
        yield from _distributed_steps(s, opt, total, batch)


def _local_steps(s, opt, total, batch):
    progress = Progress(s, opt)
    for step in range(1, total + 1):
        plan = Plan(step, 1, 0, 1, 0, 1, batch, False, 0)
        s.plan = s.last_plan = plan
        opt._begin(plan)
        started = time.monotonic()
        yield plan
        s.plan = None
        if not plan.completed:
            raise RuntimeError(f"step {step}: the loop body did not call opt.step()")
        progress.record(plan, time.monotonic() - started)
    progress.finish(total)


def _distributed_steps(s, opt, total, batch):
    w = s.worker
    progress = Progress(s, opt)
    attempts = {}
    while True:
        try:
            raw = w.begin_step()
        except TandemError as e:
            _raise_stopped(s, e)
            raise
        if raw.step > total:
            try:
                # Waits for the last step's parameters, here and on every
                # other worker (none leaves while a peer's are landing).
                w.finish_run()
                opt._landed = opt._count
            except TandemError as e:
                _raise_stopped(s, e)
                if e.fatal:
                    raise
                continue
            break
        rollback = w.take_rollback()
        if rollback is not None:
            attempts.clear()
            progress.rollback(rollback, raw.rank)
        attempt = attempts.get(raw.step, 0)
        plan = Plan(
            raw.step, raw.epoch, raw.rank, raw.world_size, raw.dp_rank, raw.dp_size, batch, raw.resynced, attempt
        )
        plan.rolled_back = rollback
        s.plan = s.last_plan = plan
        opt._begin(plan)
        progress.sample_log(plan)
        started = time.monotonic()
        yield plan
        s.plan = None
        if plan.failed:
            attempts[plan.step] = attempt + 1
            w.record_failure()
            continue
        if not plan.completed:
            w.abandon_step(f"step {plan.step}: the loop body did not call opt.step()")
            raise RuntimeError(f"step {plan.step}: the loop body did not call opt.step()")
        progress.record(plan, time.monotonic() - started)
        progress.checkpoint(plan, total)
    progress.finish(total)


def _raise_stopped(s, error):
    """A runtime stopped by SIGTERM or the daemon: end the loop as the daemon asks."""
    if s.worker is not None and s.worker.shutdown_requested:
        failure = s.worker.failure()
        if failure:
            raise TandemError("ABORTED", f"the worker is shutting down after a failure: {failure}") from error
        raise SystemExit(0)


# --- LR schedulers ------------------------------------------------------------
#
# Schedulers built on a DistributedOptimizer are recorded on it, so that a step
# that failed leaves them where they were, a joining worker's catch up, and
# (allreduce mode) their state travels with the optimizer's.
_scheduler_base = getattr(torch.optim.lr_scheduler, "LRScheduler", None) or torch.optim.lr_scheduler._LRScheduler
_scheduler_init = _scheduler_base.__init__


def _recording_scheduler_init(self, optimizer, *args, **kwargs):
    _scheduler_init(self, optimizer, *args, **kwargs)
    schedulers = getattr(optimizer, "_tandem_schedulers", None)
    if schedulers is not None:
        schedulers.append(weakref.ref(self))
        # Where a rollback to a checkpoint starts them over from.
        optimizer._tandem_scheduler_initial[self] = self.state_dict()
        optimizer._tandem_initial_lrs = [g["lr"] for g in optimizer.param_groups]


if not getattr(_scheduler_base.__init__, "_tandem", False):
    _recording_scheduler_init._tandem = True
    _scheduler_base.__init__ = _recording_scheduler_init


# --- the optimizer ------------------------------------------------------------


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods of the class DistributedOptimizer builds (a subclass of the wrapped optimizer's class)."""

    _tandem_wrapped = True

    def _tandem_setup(self, named, mode, find_unused_parameters, max_grad_norm, bucket_bytes, gradient_wire,
                      parameter_wire, non_finite, lr_schedule, resume_from, overlap_landing):
        s = _require_session()
        if s.optimizer is not None:
            raise RuntimeError("a DistributedOptimizer exists already: Tandem trains one model per worker")
        cfg = s.config
        self._mode = mode or cfg.mode
        if self._mode not in _MODES:
            raise ValueError(f"mode {self._mode!r} is not one of {', '.join(_MODES)}")
        if non_finite not in ("skip", "fail"):
            raise ValueError(f"non_finite {non_finite!r} is not 'skip' or 'fail'")
        self._session = s
        self._find_unused = bool(find_unused_parameters)
        self._max_grad_norm = float(max_grad_norm if max_grad_norm is not None else cfg.max_grad_norm)
        if self._max_grad_norm < 0 or not math.isfinite(self._max_grad_norm):
            raise ValueError(f"max_grad_norm {self._max_grad_norm} must be >= 0 and finite")
        self._non_finite = non_finite
        self._tandem_schedule = bool(lr_schedule)
        self._tandem_schedulers = []
        self._tandem_scheduler_initial = weakref.WeakKeyDictionary()
        self._tandem_initial_lrs = None
        self._sync = True
        self._plan = None
        self._overlap = False
        self._landed = 0
        self._grads_held = False

        # The parameters, in the order the model names them; the flat buffer
        # holds them in that order, so backward (which ends with the first
        # layers) makes the end of the buffer ready first.
        names = {}
        if named is not None:
            for name, p in named:
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"named_parameters: {name!r} is not a tensor")
                names.setdefault(id(p), name)
        ordered = []
        group_of = {}
        seen = set()
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if id(p) in seen:
                    raise ValueError(f"parameter {names.get(id(p), '?')!r} is in the optimizer twice")
                seen.add(id(p))
                group_of[id(p)] = gi
                if named is not None and id(p) not in names:
                    raise ValueError(
                        f"param_groups[{gi}] holds a parameter of shape {tuple(p.shape)} that named_parameters does "
                        "not name: pass the model's named_parameters()"
                    )
                ordered.append(p)
        if named is not None:
            order = {pid: i for i, pid in enumerate(names)}
            ordered.sort(key=lambda p: order[id(p)])
        else:
            for i, p in enumerate(ordered):
                names[id(p)] = f"param.{i}"
        params = []
        for p in ordered:
            name = names[id(p)]
            if not p.requires_grad:
                continue  # frozen: not trained, not on the servers
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {name!r} is {p.dtype}, not torch.float32: Tandem trains fp32 parameters")
            if p.device.type != "cpu":
                raise ValueError(f"parameter {name!r} is on {p.device}: tandem.torch trains tensors on the CPU")
            if p.is_sparse or not p.is_contiguous():
                raise ValueError(f"parameter {name!r} is not a dense contiguous tensor")
            params.append((name, p))
        if not params:
            raise ValueError("the optimizer has no parameter that requires a gradient")
        self._params = params
        self._names = [n for n, _ in params]
        count = sum(p.numel() for _, p in params)
        self._count = count

        if s.describe:
            if self._mode != "allreduce":
                gn = {gi: ("" if gi == 0 else f"group{gi}") for gi in range(len(self.param_groups))}
                optimizer_text(self, self._mode, gn, self._max_grad_norm, non_finite, lr_schedule)
            with open(s.describe, "w") as f:
                json.dump({"parameters": count, "tensors": len(params)}, f)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

        group_names = {gi: ("" if gi == 0 else f"group{gi}") for gi in range(len(self.param_groups))}
        tensors = self._lay_out(params, count, group_of, group_names)
        self._landed = count
        self._tensor_table = tensors
        self._group_names = group_names
        self._lr_schedule = lr_schedule
        self._resume_from = resume_from or cfg.resume_from
        self._begun = False
        self._param_ptrs = [p.data_ptr() for _, p in params]
        self._grad_views = [p.grad for _, p in params]
        self._param_total = sum(len(g["params"]) for g in self.param_groups)
        self._ready = [False] * len(params)
        self._watermark = len(params)
        self._backward_queued = False
        self._hooks = []
        self._note_group_lrs()

        # Every backward reports each parameter's gradient (alone too, so a
        # script's mistakes show before it runs on a cluster).
        for i, (name, p) in enumerate(params):
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(self._make_hook(i))
            self._hooks.append(acc)
        explicit_mode = mode is not None or s.describe
        if s.worker is None:
            if explicit_mode and self._mode != "allreduce":
                # The servers' checks, so that a single run (and `tandem run`'s
                # look at the script) finds what a cluster would refuse.
                optimizer_text(self, self._mode, group_names, self._max_grad_norm, non_finite, lr_schedule)
            s.optimizer = self
            return
        s.optimizer = self

        runtime_options = {
            "mode": self._mode,
            "bucket_bytes": int(bucket_bytes if bucket_bytes is not None else cfg.bucket_bytes),
            "gradient_wire": gradient_wire or cfg.gradient_wire,
            "parameter_wire": parameter_wire or cfg.parameter_wire,
            "timeout_ms": int(cfg.step_timeout_ms),
            "epoch_wait_ms": int(cfg.epoch_wait_ms),
            "consistency": cfg.consistency,
            "staleness_bound": int(cfg.staleness_bound),
            "resume_from": resume_from or cfg.resume_from,
            # Where the synchronous server modes roll back to when both copies of partitions are lost.
            "checkpoint_dir": cfg.checkpoint_dir,
        }
        # Server modes: opt.step() returns once the parameters the next
        # forward reads first have landed; the rest land while it runs.
        self._overlap = self._mode != "allreduce" and bool(overlap_landing)
        runtime_options["overlap_parameter_landing"] = self._overlap
        if self._overlap:
            self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)
            self._state_dict_modules = weakref.WeakSet()
        if self._mode == "allreduce":
            # The torch optimizer steps locally; the runtime only checks this.
            runtime_options["optimizer"] = "sgd { lr: 1 } reduction: GRADIENT_REDUCTION_SUM"
            runtime_options["save_state"] = self._save_local_state
            runtime_options["load_state"] = self._load_local_state
        else:
            runtime_options["optimizer"] = optimizer_text(
                self, self._mode, group_names, self._max_grad_norm, non_finite, lr_schedule
            )
        s.worker.create_runtime(runtime_options)
        s.worker.attach(self._flat_params.data_ptr(), self._flat_grads.data_ptr(), count, tensors)

    def _lay_out(self, params, count, group_of, group_names):
        """Moves the parameters into one flat buffer (their tensors become
        views into it, as their gradients into another) and returns the
        runtime's tensor table: (name, shape, offset, group) each."""
        # One flat buffer each for parameters and gradients; the model's
        # tensors become views into them.
        self._flat_params = torch.zeros(count, dtype=torch.float32)
        self._flat_grads = torch.zeros(count, dtype=torch.float32)
        self._offsets = []
        self._shapes = []
        tensors = []
        offset = 0
        with torch.no_grad():
            for name, p in params:
                n = p.numel()
                self._flat_params[offset : offset + n].copy_(p.detach().reshape(-1))
                p.data = self._flat_params[offset : offset + n].view(p.shape)
                p.grad = self._flat_grads[offset : offset + n].view(p.shape)
                self._offsets.append(offset)
                self._shapes.append(tuple(p.shape))
                tensors.append((name, list(p.shape), offset, group_names[group_of[id(p)]]))
                offset += n
        # Where each parameter ends in the flat buffer: the parameters of the
        # last step land in buffer order, so a module's forward waits up to
        # the end of its last one (_before_forward).
        self._ends = [o + p.numel() for o, (_, p) in zip(self._offsets, params)]
        self._end_of = {id(p): e for e, (_, p) in zip(self._ends, params)}
        return tensors

    # -- during a step ------------------------------------------------------

    def _note_group_lrs(self):
        # Group 0's lr travels with each step; the other groups keep their ratio to it.
        self._base_lr = float(self.param_groups[0]["lr"])
        self._lr_ratios = [float(g["lr"]) / self._base_lr if self._base_lr > 0 else 1.0 for g in self.param_groups]

    def _begin(self, plan):
        self._begun = True
        self._grads_held = False  # BeginStep resynchronised (and pushed a kept gradient again) if it had to
        self._begin_schedulers(plan)
        self._forward_step_lr()

    def _begin_schedulers(self, plan):
        self._plan = plan
        self._ready = [False] * len(self._params)
        self._watermark = len(self._params)
        self._backward_queued = False
        self._scale = plan.share
        schedulers = self._schedulers()
        if self._session.worker is None or not schedulers:
            return
        if getattr(self, "_pending_restore", False):
            # The last attempt failed after the loop stepped its schedulers:
            # back to where they were before it.
            self._pending_restore = False
            for sch, sd in zip(schedulers, self._scheduler_states):
                sch.load_state_dict(sd)
            for g, lr in zip(self.param_groups, self._group_lrs):
                g["lr"] = lr
        if plan.rolled_back is not None:
            # The job went back to a checkpoint: the schedulers start over
            # and catch up to its step, as a worker that joins does.
            for sch in schedulers:
                initial = self._tandem_scheduler_initial.get(sch)
                if initial is not None:
                    sch.load_state_dict(initial)
            if self._tandem_initial_lrs is not None:
                for g, lr in zip(self.param_groups, self._tandem_initial_lrs):
                    g["lr"] = lr
        if plan.resynced and self._mode != "allreduce":
            self._catch_up(schedulers, plan.step - 1)
        self._scheduler_states = [sch.state_dict() for sch in schedulers]
        self._group_lrs = [g["lr"] for g in self.param_groups]

    def _forward_step_lr(self):
        # Before backward: the runtime takes the step's learning rate with
        # its first gradients.
        if self._session.worker is not None and self._mode != "allreduce" and not self._tandem_schedule:
            self._forward_lr(self._session.worker)

    def _schedulers(self):
        alive = [r() for r in self._tandem_schedulers]
        return [sch for sch in alive if sch is not None]

    def _catch_up(self, schedulers, steps_done):
        # A worker that joined (or resynchronised) moves its schedulers to the
        # job's position: they are deterministic in their step count.
        for sch in schedulers:
            behind = steps_done - (sch.last_epoch if sch.last_epoch >= 0 else 0)
            if behind <= 0:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(behind):
                    sch.step()

    # -- parameters landing during the next forward (server modes) ----------

    def _before_forward(self, module, inputs):
        # Every module's forward (a global hook): one that holds parameters of
        # this optimizer waits until they have landed. Modules of torch's that
        # read their children's parameters in their own forward
        # (MultiheadAttention's out_proj, the Transformer layers' fast path)
        # wait for those too.
        params = module.parameters() if isinstance(module, _READS_CHILDREN) else module._parameters.values()
        end = 0
        for p in params:
            e = self._end_of.get(id(p)) if p is not None else None
            if e is not None and e > end:
                end = e
        if end == 0:
            return
        if module not in self._state_dict_modules:
            # model.state_dict() between steps waits for the parameters too.
            self._state_dict_modules.add(module)
            module._register_state_dict_hook(self._before_state_dict)
        if end > self._landed:
            self._land(end)

    def _before_state_dict(self, module, state_dict, prefix, local_metadata):
        self._land_all()

    def _land(self, end):
        plan = self._plan
        try:
            self._session.worker.acquire(0, end)
            self._landed = end
        except TandemError as e:
            _raise_stopped(self._session, e)
            self._landed = self._count  # nothing more will land: the parameters are resynchronised
            # Until the resync (the next steps() iteration) the runtime may
            # push the last step's gradient again: nothing writes the buffer.
            self._grads_held = True
            if e.fatal or plan is None or plan.completed or plan.failed:
                raise
            # The last step's parameters did not all arrive (a membership
            # change): this step fails and steps() yields it again after the
            # resync. Its forward and backward go on, their result unused.
            self._session.worker.abandon_step(f"step {plan.step}: {e.message}")
            plan.failed = plan.landing_failed = True

    def _land_all(self):
        if self._overlap and self._landed < self._count:
            self._land(self._count)

    def _make_hook(self, i):
        def hook(*unused):
            if not self._sync or self._plan is None:
                return
            self._on_ready(i)

        return hook

    def _on_ready(self, i):
        if self._plan.failed:
            return  # the step is yielded again; the buffer may still hold a gradient to push again
        name, p = self._params[i]
        if p.data_ptr() != self._param_ptrs[i] or tuple(p.shape) != self._shapes[i]:
            raise RuntimeError(
                f"parameter {name!r} was replaced or resized after the DistributedOptimizer was created (it was "
                f"{self._shapes[i]}, now {tuple(p.shape)}): create the optimizer after the model is final"
            )
        if self._ends[i] > self._landed and not self._plan.failed:
            raise RuntimeError(
                f"parameter {name!r} was used in step {self._plan.step} outside the forward of the module that holds "
                "it, so Tandem could not wait for its update from the servers to land: use it inside its module's "
                "forward, or pass overlap_landing=False to DistributedOptimizer"
            )
        if self._ready[i]:
            raise RuntimeError(
                f"parameter {name!r} got a second gradient in step {self._plan.step}: accumulate micro-batches "
                "inside `with opt.no_sync():` (all but the last)"
            )
        if self._landed < self._count:
            self._land_all()  # the runtime lets go of the last step's gradient once everything landed
        view = self._grad_views[i]
        g = p.grad
        # The runtime sums the ranks' gradients: each is scaled by the rank's
        # share of the global batch, in the same pass that puts it in the
        # flat buffer when it is elsewhere.
        scale = self._scale if self._session.worker is not None else 1.0
        if g is None or g.data_ptr() != view.data_ptr():
            # The gradient went elsewhere (zero_grad while the parameters
            # were landing, or set_to_none since): into the flat buffer.
            with torch.no_grad():
                if g is None:
                    view.zero_()
                elif scale != 1.0:
                    torch.mul(g, scale, out=view)
                else:
                    view.copy_(g)
            p.grad = view
        elif scale != 1.0:
            with torch.no_grad():
                view.mul_(scale)
        self._ready[i] = True
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        self._advance()

    def _advance(self):
        w = self._watermark
        while w > 0 and self._ready[w - 1]:
            w -= 1
        if w == self._watermark:
            return
        lo = self._offsets[w]
        self._watermark = w
        if self._session.worker is not None:
            self._session.worker.gradients_ready(lo)

    def _on_backward_end(self):
        missing = [i for i, r in enumerate(self._ready) if not r]
        if not missing:
            return
        if not self._find_unused:
            names = ", ".join(self._names[i] for i in missing[:10])
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise RuntimeError(
                f"step {self._plan.step}: backward gave no gradient to {names}{more}; every rank must send every "
                "gradient. Pass find_unused_parameters=True to DistributedOptimizer to send zeros for parameters a "
                "step does not use"
            )
        with torch.no_grad():
            for i in missing:
                self._grad_views[i].zero_()
                self._ready[i] = True
        self._advance()

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches of gradient accumulation: backward inside this block
        only accumulates (no communication); the step's last micro-batch runs
        outside it."""
        before = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = before

    def zero_grad(self, set_to_none=False):
        """Zeroes the gradients in place (the flat buffer the runtime sends
        from); ``set_to_none`` is ignored, since the gradients are views into
        that buffer."""
        if self._overlap and (self._landed < self._count or self._grads_held):
            # The last step's parameters are still landing, and until they
            # all have, the runtime keeps its gradient (to push it again if a
            # server fails). Backward starts from no gradient instead, and the
            # first one lands in the flat buffer (_on_ready).
            for _, p in self._params:
                p.grad = None
            return
        with torch.no_grad():
            self._flat_grads.zero_()
        for i, (_, p) in enumerate(self._params):
            if p.grad is None or p.grad.data_ptr() != self._grad_views[i].data_ptr():
                p.grad = self._grad_views[i]

    def step(self, closure=None):
        """Finishes the step: sends what backward left, then updates the
        parameters (from the servers, or with the wrapped optimizer on the
        averaged gradients in allreduce mode). Returns the closure's loss.
        After a membership change the step is marked failed and ``steps()``
        yields it again."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        s = self._session
        plan = self._plan
        if sum(len(g["params"]) for g in self.param_groups) != self._param_total:
            raise RuntimeError(
                "parameters were added to the optimizer (add_param_group) after the DistributedOptimizer was "
                "created: Tandem lays the parameters out once"
            )
        if plan is None or s.plan is not plan:
            if s.worker is None:
                self._local_step()  # alone, outside steps(): a plain optimizer step
                return loss
            raise RuntimeError("opt.step() outside a step: call it inside `for plan in tandem.torch.steps(...)`")
        if plan.failed and plan.landing_failed and not plan.completed:
            plan.completed = True  # the step failed in its forward (_land): steps() yields it again
            self._restore_schedulers()
            return loss
        if plan.completed or plan.failed:
            raise RuntimeError(f"opt.step() twice in step {plan.step}")
        if not all(self._ready):
            missing = [self._names[i] for i, r in enumerate(self._ready) if not r]
            raise RuntimeError(
                f"step {plan.step}: opt.step() before backward gave every gradient (missing: "
                f"{', '.join(missing[:10])}); call loss.backward() outside opt.no_sync() first"
            )
        if s.worker is None:
            self._local_step()
            plan.completed = True
            return loss
        rep = plan.reported
        plan.reported_at_step = rep
        if rep is None:
            figures = (0.0, 0, 0, [0.0, 1.0])
        else:
            reported = rep[0] is not None
            figures = ((rep[0] if reported else 0.0) * plan.share, rep[1], rep[2],
                       [plan.share if reported else 0.0, 0.0])
        try:
            plan.result, more = s.worker.end_step(*figures)
            plan.summed = (plan.result.loss, more[0], float(plan.result.samples), float(plan.result.tokens), more[1])
            if self._overlap:
                self._landed = 0  # the parameters land during the next forward (_before_forward)
        except TandemError as e:
            _raise_stopped(s, e)
            if e.fatal:
                raise
            plan.failed = True
            self._restore_schedulers()
            return loss
        if self._mode == "allreduce":
            self._local_step()
        plan.completed = True
        return loss

    def _forward_lr(self, worker):
        lr = float(self.param_groups[0]["lr"])
        for i, g in enumerate(self.param_groups[1:], 1):
            want = lr * self._lr_ratios[i]
            if not math.isclose(float(g["lr"]), want, rel_tol=1e-6, abs_tol=1e-12):
                raise ValueError(
                    f"param_groups[{i}]['lr'] is {g['lr']}, but the servers scale param_groups[0]'s lr {lr} by "
                    f"{self._lr_ratios[i]} for it: a scheduler may change every group's lr by the same factor only"
                )
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"param_groups[0]['lr'] is {lr}: a learning rate is >= 0 and finite")
        worker.set_step_learning_rate(lr if lr > 0 else _ZERO_LR)

    def _restore_schedulers(self):
        # The step is retried: a scheduler.step() the loop makes after the
        # failed opt.step() is undone when the step begins again.
        if getattr(self, "_scheduler_states", None):
            self._pending_restore = True

    def _local_step(self):
        sup = super(self.__class__, self)
        if self._max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in self._params], self._max_grad_norm)
        if not bool(torch.isfinite(self._flat_grads).all()):
            step = self._plan.step if self._plan else "?"
            if self._non_finite == "fail":
                raise FloatingPointError(f"step {step}: the averaged gradient holds NaN or Inf")
            warnings.warn(f"step {step}: the averaged gradient holds NaN or Inf; the update is skipped")
            return
        sup.step()

    # -- allreduce mode: the state that travels on a resync -------------------

    def _save_local_state(self):
        buf = io.BytesIO()
        torch.save(
            {
                "optimizer": super(self.__class__, self).state_dict(),
                "schedulers": [sch.state_dict() for sch in self._schedulers()],
            },
            buf,
        )
        return buf.getvalue()

    def _load_local_state(self, data):
        state = torch.load(io.BytesIO(data))
        super(self.__class__, self).load_state_dict(state["optimizer"])
        for sch, sd in zip(self._schedulers(), state["schedulers"]):
            sch.load_state_dict(sd)

    # -- checkpoints -------------------------------------------------------

    def state_dict(self):
        """A plain torch optimizer state_dict. In allreduce mode the wrapped
        optimizer's; in the server modes the servers' optimizer state (their
        moments and step count, read from a checkpoint they write under
        train.checkpoint_dir or a temporary directory on a filesystem this
        process shares with them), in the layout the wrapped optimizer's class
        uses."""
        sup = super(self.__class__, self)
        s = self._session
        if self._mode == "allreduce" or s.worker is None:
            return sup.state_dict()
        self._land_all()
        return self._server_state_dict(sup.state_dict())

    def _server_state_dict(self, base):
        import tempfile

        s = self._session
        directory = s.config.checkpoint_dir or tempfile.mkdtemp(prefix="tandem-state-")
        step = s.worker.completed_steps()
        path = s.worker.save_checkpoint(directory, step, 600.0)
        meta, _, state0, state1 = _tandem.read_checkpoint(path)
        m0 = torch.frombuffer(bytearray(state0), dtype=torch.float32) if state0 else None
        m1 = torch.frombuffer(bytearray(state1), dtype=torch.float32) if state1 else None
        state = {}
        # state_dict() numbers the parameters in param_groups order.
        position = {}
        k = 0
        for g in self.param_groups:
            for p in g["params"]:
                position[id(p)] = k
                k += 1
        for i, (_, p) in enumerate(self._params):
            lo, n = self._offsets[i], p.numel()
            entry = {}
            if isinstance(self, torch.optim.SGD):
                if m0 is not None:
                    entry["momentum_buffer"] = m0[lo : lo + n].clone().view(p.shape)
            else:
                entry["step"] = torch.tensor(float(max(0, meta["version"] - 1)))  # the updates applied
                entry["exp_avg"] = m0[lo : lo + n].clone().view(p.shape)
                entry["exp_avg_sq"] = m1[lo : lo + n].clone().view(p.shape)
            if entry:
                state[position[id(p)]] = entry
        return {"state": state, "param_groups": base["param_groups"]}

    def load_state_dict(self, state_dict):
        """Loads a torch optimizer state_dict (torch's own, or this wrapper's
        ``state_dict()``). Allreduce mode and alone: into the wrapped
        optimizer. Server modes: before the first step, it becomes the
        servers' initial state: their configuration from the loaded
        param_groups, their moments from its state, the model's current
        parameters as the weights (load the model's state first), and the
        update count from its ``step`` (Adam, AdamW); the loop still starts
        at step 1. After training began the servers hold the state: resume
        from one of their checkpoints instead (``resume_from``)."""
        sup = super(self.__class__, self)
        s = self._session
        if self._mode == "allreduce" or s.worker is None:
            sup.load_state_dict(state_dict)
            return
        if self._begun:
            raise RuntimeError(
                "load_state_dict in a server mode sets the servers' initial state: call it before the first step. "
                "Once training began the servers hold the optimizer state; resume from one of their checkpoints "
                "with train.resume_from (tandem run --train-resume-from DIR) or DistributedOptimizer(..., "
                "resume_from=DIR)"
            )
        if self._resume_from:
            raise ValueError(
                f"load_state_dict with resume_from={self._resume_from!r}: the servers start from one or the other"
            )
        before = copy.deepcopy(sup.state_dict())
        sup.load_state_dict(state_dict)  # torch checks the groups' sizes and moves the state onto the parameters
        try:
            self._load_into_servers(s)
        except BaseException:
            # The wrapper as it was: nothing reached the servers.
            sup.load_state_dict(before)
            raise

    def _load_into_servers(self, s):
        import tempfile

        text = optimizer_text(self, self._mode, self._group_names, self._max_grad_norm, self._non_finite,
                              self._lr_schedule)
        sgd = isinstance(self, torch.optim.SGD)
        buffers = 2 if not sgd else (1 if float(self.param_groups[0].get("momentum", 0.0)) > 0 else 0)
        state0 = torch.zeros(self._count, dtype=torch.float32) if buffers >= 1 else None
        state1 = torch.zeros(self._count, dtype=torch.float32) if buffers >= 2 else None
        counts = {}
        for i, (name, p) in enumerate(self._params):
            st = self.state.get(p) or {}
            lo, n = self._offsets[i], p.numel()
            if sgd:
                buf = st.get("momentum_buffer")
                if buf is not None and state0 is not None:
                    state0[lo : lo + n].copy_(buf.reshape(-1))
                    counts[name] = 1  # SGD's state keeps no count: updated at least once
                else:
                    counts[name] = 0
                continue
            if not st:
                counts[name] = 0
                continue
            missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in st]
            if missing:
                raise ValueError(f"the state of parameter {name!r} has no {', '.join(missing)}")
            state0[lo : lo + n].copy_(st["exp_avg"].reshape(-1))
            state1[lo : lo + n].copy_(st["exp_avg_sq"].reshape(-1))
            counts[name] = int(float(st["step"]))
        updates = set(counts.values())
        if len(updates) > 1:
            some = ", ".join(f"{n!r}: {c}" for n, c in list(counts.items())[:6])
            raise ValueError(
                f"the state's parameters have seen different numbers of updates ({some}, ...): the parameter servers "
                "keep one count for the model"
            )
        updates = updates.pop()
        directory = ""
        if updates > 0 or any(self.state.get(p) for _, p in self._params):
            directory = tempfile.mkdtemp(prefix="tandem-torch-state-", dir=s.config.checkpoint_dir or None)
            kinds = {torch.optim.SGD: "sgd", torch.optim.AdamW: "adamw", torch.optim.Adam: "adam"}
            kind = next(v for k, v in kinds.items() if isinstance(self, k))
            _tandem.write_checkpoint(
                directory, self._tensor_table, self._flat_params.data_ptr(), self._count,
                state0.data_ptr() if state0 is not None else 0, state1.data_ptr() if state1 is not None else 0,
                buffers, kind, 0, updates + 1,
            )
        s.worker.set_initial_state(directory, text)  # no directory: the hyperparameters only
        self._note_group_lrs()  # the learning rates the steps forward are relative to the loaded groups


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    mode=None,
    find_unused_parameters=False,
    max_grad_norm=None,
    bucket_bytes=None,
    gradient_wire=None,
    parameter_wire=None,
    non_finite="skip",
    lr_schedule=None,
    resume_from=None,
    overlap_landing=True,
):
    """Wraps a torch optimizer so that training runs on Tandem.

    ``mode``: ``"hybrid"`` (default: the configuration's train.mode),
    ``"allreduce"`` or ``"ps"``. In the server modes the parameter servers
    run the update (SGD with momentum/Nesterov, Adam, AdamW, with per-group
    lr and weight_decay); the wrapped optimizer never steps. In allreduce
    mode the wrapped optimizer (any torch optimizer) steps on every worker on
    the averaged gradients.

    ``named_parameters``: the model's ``named_parameters()``, for names in
    errors and the layout. ``find_unused_parameters``: parameters that get no
    gradient in a step count as zero gradients (otherwise an error names
    them). ``max_grad_norm``: clip the global gradient norm (the servers'
    clipping, or torch's after the reduction in allreduce mode).
    ``gradient_wire``/``parameter_wire``: ``"fp32"`` or ``"bf16"`` on the
    wire. ``non_finite``: ``"skip"`` a step whose gradient holds NaN/Inf, or
    ``"fail"``. ``lr_schedule``: Tandem's own schedule on the servers
    (``{"kind": "cosine", "warmup_steps": 100, "total_steps": 5000,
    "min_lr_ratio": 0.1}``) instead of forwarding the torch lr every step.
    ``resume_from``: a parameter-server checkpoint to start from (server modes).
    ``overlap_landing`` (server modes): ``opt.step()`` returns once the
    parameters the next forward reads first have arrived from the servers,
    and each module's forward waits for its own (``synchronize()`` waits for
    all); ``False`` waits for every parameter in ``opt.step()``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if getattr(optimizer, "_tandem_wrapped", False):
        raise TypeError("the optimizer is a DistributedOptimizer already")
    base = type(optimizer)
    # An instance of a subclass of the wrapped optimizer's class (as Horovod
    # does): LR schedulers and isinstance checks see the optimizer they know,
    # and in allreduce mode the class's own step() runs the update.
    members = {k: v for k, v in _DistributedOptimizer.__dict__.items() if k not in ("__dict__", "__weakref__")}
    members["__module__"] = base.__module__
    members["__qualname__"] = base.__qualname__
    cls = type(base.__name__, (base,), members)
    named = list(named_parameters) if named_parameters is not None else None
    state = optimizer.state_dict() if optimizer.state else None
    wrapped = cls.__new__(cls)
    # The wrapped optimizer's groups carry every hyperparameter (lr, betas, ...).
    torch.optim.Optimizer.__init__(wrapped, [dict(g) for g in optimizer.param_groups], dict(optimizer.defaults))
    wrapped._tandem_setup(named, mode, find_unused_parameters, max_grad_norm, bucket_bytes, gradient_wire,
                          parameter_wire, non_finite, lr_schedule, resume_from, overlap_landing)
    if state:
        # As load_state_dict: in the server modes the state becomes the servers'.
        wrapped.load_state_dict(state)
    return wrapped
