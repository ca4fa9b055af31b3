// tandem._tandem: the C++ side of the PyTorch front end (docs/pytorch.md).
//
// A Python training process becomes a tandem-worker: Worker starts the same
// daemon `tandem-worker` runs (flags and YAML, gRPC health, /metrics, the
// member session with the coordinator, the data plane) on threads of its
// own, and the Python main thread drives the worker runtime
// (worker/runtime/runtime.h) over buffers it hands over by address. Nothing
// here includes torch's headers: tensors arrive as (address, element count)
// of contiguous fp32 memory, so the module works with any torch version.
//
// Blocking calls release the GIL. The runtime is driven from one Python
// thread (the training loop's); the daemon's own threads never call into
// Python except through the optimizer-state hooks, which run on the training
// thread inside begin_step.
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <google/protobuf/text_format.h>
#include <prometheus/counter.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <spdlog/spdlog.h>

#include "common/daemon.h"
#include "common/mutex.h"
#include "server/checkpoint/checkpoint.h"
#include "tandem/config.h"
#include "worker/data/dataset.h"
#include "worker/runtime/runtime.h"
#include "worker/runtime/trainer.h"
#include "worker/worker_daemon.h"

namespace py = pybind11;

namespace tandem::python {
namespace {

// The Python exception type (tandem.TandemError) that a failed Status
// becomes: TandemError(code, message, fatal).
py::object& ErrorType() {
  static auto* type = new py::object();
  return *type;
}

struct StatusError {
  Status status;
  bool fatal = true;
};

[[noreturn]] void Throw(const Status& status, bool fatal = true) {
  throw StatusError{status, fatal};
}

void Check(const Status& status) {
  if (!status.ok()) Throw(status);
}

std::string CodeName(StatusCode code) {
  return std::string(StatusCodeName(code));
}

// The model's tensors as Python gives them: (name, shape, flat_offset, group).
using TensorTable = std::vector<std::tuple<std::string, std::vector<int64_t>, size_t, std::string>>;

std::vector<v1::TensorSpec> Specs(const TensorTable& tensors) {
  std::vector<v1::TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& [name, shape, offset, group] : tensors) {
    v1::TensorSpec& t = specs.emplace_back();
    t.set_name(name);
    t.set_dtype(v1::DTYPE_FLOAT32);
    for (int64_t d : shape) t.add_shape(d);
    t.set_flat_offset(offset);
    if (!group.empty()) t.set_group(group);
  }
  return specs;
}

// The daemon of a Python worker, and the runtime its training loop drives.
class Worker {
 public:
  explicit Worker(std::vector<std::string> args) {
    if (args.empty()) args.emplace_back("tandem-worker");
    // The daemon's training loop only hands its context over and parks: the
    // Python main thread trains.
    auto loop = [this](worker::WorkerContext& context) -> Status {
      MutexLock lock(&mu_);
      context_ = &context;
      cv_.NotifyAll();
      while (!released_ && !context.stopping()) cv_.WaitFor(lock, std::chrono::milliseconds(50));
      context_ = nullptr;
      return Status::Ok();
    };
    spec_ = worker::MakeDaemonSpec(loop);
    std::string output;
    auto running = RunningDaemon::Start(
        args, spec_, [this] { OnShutdownRequest(); }, &output);
    if (!running.ok()) Throw(running.status());
    if (*running == nullptr) {
      // --help or --version: not an error, but there is no worker either.
      help_ = output;
      return;
    }
    daemon_ = std::move(*running);
    MutexLock lock(&mu_);
    if (!cv_.WaitFor(lock, std::chrono::seconds(30),
                     [&]() TANDEM_REQUIRES(mu_) { return context_ != nullptr || shutdown_requested_; })) {
      lock.Unlock();
      Shutdown();
      Throw(DeadlineExceeded("the worker daemon did not start its training loop within 30 s"));
    }
    if (context_ == nullptr) {
      lock.Unlock();
      Status why = daemon_->daemon().failure();
      Shutdown();
      Throw(why.ok() ? Cancelled("the worker was asked to shut down while starting") : why);
    }
  }

  ~Worker() { Shutdown(); }

  const std::string& help() const { return help_; }
  bool running() const { return daemon_ != nullptr; }

  worker::WorkerContext& context() {
    if (context_ == nullptr) Throw(FailedPrecondition("the worker is not running (shut down, or started with --help)"));
    return *context_;
  }

  // The train.* configuration, as the flags and YAML gave it.
  py::dict Train() {
    const worker::TrainConfig& t = context().train;
    py::dict d;
    d["steps"] = t.steps;
    d["mode"] = t.mode;
    d["data"] = t.data;
    d["seed"] = t.seed;
    d["global_batch"] = t.global_batch;
    d["accumulation"] = t.accumulation;
    d["consistency"] = t.consistency;
    d["staleness_bound"] = t.staleness_bound;
    d["optimizer"] = t.optimizer;
    d["lr"] = t.lr;
    d["weight_decay"] = t.weight_decay;
    d["max_grad_norm"] = t.max_grad_norm;
    d["bucket_bytes"] = t.bucket_bytes;
    d["gradient_wire"] = t.gradient_wire;
    d["parameter_wire"] = t.parameter_wire;
    d["step_timeout_ms"] = t.step_timeout.count();
    d["epoch_wait_ms"] = t.epoch_wait.count();
    d["progress_file"] = t.progress_file;
    d["params_out"] = t.params_out;
    d["sample_log"] = t.sample_log;
    d["checkpoint_dir"] = t.checkpoint_dir;
    d["checkpoint_every"] = t.checkpoint_every;
    d["resume_from"] = t.resume_from;
    return d;
  }

  std::string grpc_address() { return Daemon().grpc_address(); }
  std::string metrics_address() { return Daemon().metrics_address(); }

  // Whether the daemon asked to stop (SIGTERM through the wakeup fd, a
  // failure, or request_shutdown).
  bool shutdown_requested() const { return shutdown_requested_; }
  std::string failure() {
    if (daemon_ == nullptr) return "";
    Status f = daemon_->daemon().failure();
    return f.ok() ? "" : f.ToString();
  }

  void RequestShutdown(const std::string& failure) {
    if (daemon_ == nullptr) return;
    daemon_->daemon().RequestShutdown(failure.empty() ? Status::Ok() : Internal("{}", failure));
  }

  // Stops the runtime, leaves the job and stops the daemon. Returns the
  // exit code a tandem-worker would: 0 clean, 1 after a failure.
  int Shutdown() {
    std::unique_ptr<worker::Runtime> runtime;
    {
      MutexLock lock(&mu_);
      if (runtime_ != nullptr) runtime_->Stop();
      runtime = std::move(runtime_);
      released_ = true;
      cv_.NotifyAll();
    }
    // Before the data plane it uses goes, with the GIL held: its options
    // hold Python callables (the optimizer-state hooks).
    runtime.reset();
    // The metrics live in the daemon's registry: they do not outlive it (a
    // record_step after shutdown records nothing).
    metrics_.reset();
    py::gil_scoped_release release;
    int code = 0;
    if (daemon_ != nullptr) {
      code = daemon_->Shutdown().ok() ? 0 : 1;
      daemon_.reset();
    }
    StopWakeupWatch();
    return code;
  }

  // Watches the read end of a pipe whose write end is Python's
  // signal.set_wakeup_fd: a signal (SIGTERM, SIGINT) stops the runtime at
  // once, so that a training loop blocked in a step returns, and the daemon
  // shuts down; the Python handler then ends the loop.
  void WatchWakeupFd(int fd) {
    StopWakeupWatch();
    if (::pipe(stop_pipe_) != 0) Throw(Internal("pipe: {}", std::strerror(errno)));
    wakeup_thread_ = std::thread([this, fd] {
      fd_set set;
      while (true) {
        FD_ZERO(&set);
        FD_SET(fd, &set);
        FD_SET(stop_pipe_[0], &set);
        const int n = ::select(std::max(fd, stop_pipe_[0]) + 1, &set, nullptr, nullptr, nullptr);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 || FD_ISSET(stop_pipe_[0], &set)) return;
        // The signal number is left in the pipe: nothing else reads it.
        spdlog::info("signal received: stopping the training loop");
        OnShutdownRequest();
        return;
      }
    });
  }

  // --- the runtime -------------------------------------------------------

  void CreateRuntime(const py::dict& o) {
    if (runtime_ != nullptr) Throw(FailedPrecondition("this worker already has a runtime (one optimizer per worker)"));
    worker::RuntimeOptions options;
    auto str = [&](const char* key, const std::string& fallback) {
      return o.contains(key) ? o[key].cast<std::string>() : fallback;
    };
    auto mode = worker::ParseTrainingMode(str("mode", "hybrid"));
    if (!mode.ok()) Throw(mode.status());
    options.mode = *mode;
    if (o.contains("bucket_bytes")) options.bucket_bytes = o["bucket_bytes"].cast<size_t>();
    auto wire = [](const std::string& name, const char* what) {
      if (name == "fp32") return v1::WIRE_DTYPE_FP32;
      if (name == "bf16") return v1::WIRE_DTYPE_BF16;
      Throw(InvalidArgument("{}: '{}' is not fp32 or bf16", what, name));
    };
    options.gradient_wire = wire(str("gradient_wire", "fp32"), "gradient_wire");
    options.parameter_wire = wire(str("parameter_wire", "fp32"), "parameter_wire");
    const std::string text = str("optimizer", "");
    if (!google::protobuf::TextFormat::ParseFromString(text, &options.optimizer)) {
      Throw(InvalidArgument("the optimizer configuration does not parse: {}", text));
    }
    if (o.contains("timeout_ms")) options.timeout = std::chrono::milliseconds(o["timeout_ms"].cast<int64_t>());
    if (o.contains("epoch_wait_ms")) {
      options.epoch_wait = std::chrono::milliseconds(o["epoch_wait_ms"].cast<int64_t>());
    }
    options.resume_from = str("resume_from", "");
    options.checkpoint_dir = str("checkpoint_dir", "");
    if (o.contains("overlap_parameter_landing")) {
      options.overlap_parameter_landing = o["overlap_parameter_landing"].cast<bool>();
    }
    const std::string consistency = str("consistency", "sync");
    if (consistency == "sync") {
      options.consistency.set_mode(v1::CONSISTENCY_MODE_SYNC);
    } else if (consistency == "async") {
      options.consistency.set_mode(v1::CONSISTENCY_MODE_ASYNC);
    } else if (consistency == "bounded") {
      options.consistency.set_mode(v1::CONSISTENCY_MODE_BOUNDED_STALENESS);
      options.consistency.set_staleness_bound(
          static_cast<uint32_t>(o.contains("staleness_bound") ? o["staleness_bound"].cast<int64_t>() : 2));
    } else {
      Throw(InvalidArgument("consistency: '{}' is not sync, async or bounded", consistency));
    }
    if (o.contains("save_state") && !o["save_state"].is_none()) {
      // Called on the training thread inside BeginStep, with the GIL released
      // around it: take it back for Python.
      py::function save = o["save_state"].cast<py::function>();
      py::function load = o["load_state"].cast<py::function>();
      worker::RuntimeOptions::ExternalOptimizer external;
      external.save = [save]() -> Result<std::string> {
        py::gil_scoped_acquire gil;
        try {
          return save().cast<std::string>();
        } catch (const py::error_already_set& e) {
          return Internal("{}", e.what());
        }
      };
      external.load = [load](std::string_view bytes) -> Status {
        py::gil_scoped_acquire gil;
        try {
          load(py::bytes(bytes.data(), bytes.size()));
          return Status::Ok();
        } catch (const py::error_already_set& e) {
          return Internal("{}", e.what());
        }
      };
      options.external_optimizer = std::move(external);
    }
    auto runtime = std::make_unique<worker::Runtime>(options, context().data_plane);
    if (metrics_ == nullptr) metrics_ = std::make_unique<worker::TrainMetrics>(context().registry);
    MutexLock lock(&mu_);
    if (shutdown_requested_) runtime->Stop();
    runtime_ = std::move(runtime);
  }

  worker::Runtime& runtime() {
    if (runtime_ == nullptr) Throw(FailedPrecondition("no runtime: create_runtime first"));
    return *runtime_;
  }

  void Attach(uintptr_t params, uintptr_t grads, size_t count, const TensorTable& tensors) {
    Check(runtime().Attach(std::span<float>(reinterpret_cast<float*>(params), count),
                           std::span<float>(reinterpret_cast<float*>(grads), count), Specs(tensors)));
  }

  // Server modes, before the first step: the servers start from the
  // checkpoint in `dir` with this optimizer configuration (text format).
  void SetInitialState(const std::string& dir, const std::string& optimizer) {
    v1::OptimizerConfig config;
    if (!google::protobuf::TextFormat::ParseFromString(optimizer, &config)) {
      Throw(InvalidArgument("the optimizer configuration does not parse: {}", optimizer));
    }
    Check(runtime().SetInitialState(dir, std::move(config)));
  }

  worker::StepPlan BeginStep() {
    Result<worker::StepPlan> plan = [&] {
      py::gil_scoped_release release;
      return runtime().BeginStep();
    }();
    if (!plan.ok()) Throw(plan.status(), runtime().Fatal(plan.status()));
    return *plan;
  }

  void GradientsReady(size_t from) { runtime().GradientsReady(from); }

  void SetStepLearningRate(double lr) { runtime().SetStepLearningRate(lr); }

  // Returns the step's result and `more` summed over the world (see
  // Runtime::EndStep).
  std::pair<worker::StepResult, std::vector<float>> EndStep(double loss_share, uint64_t samples, uint64_t tokens,
                                                            std::vector<float> more) {
    Result<worker::StepResult> result = [&] {
      py::gil_scoped_release release;
      return runtime().EndStep(loss_share, samples, tokens, more);
    }();
    if (!result.ok()) Throw(result.status(), runtime().Fatal(result.status()));
    return {*result, std::move(more)};
  }

  // Waits until the last step's parameters in [begin, end) of the flat
  // buffer have landed (overlap_parameter_landing); at once when they have.
  void Acquire(size_t begin, size_t end) {
    Status s = [&] {
      py::gil_scoped_release release;
      return runtime().Acquire({begin, end}, {0, 0});
    }();
    if (!s.ok()) Throw(s, runtime().Fatal(s));
  }

  void WaitForParameters() {
    Status s = [&] {
      py::gil_scoped_release release;
      return runtime().WaitForParameters();
    }();
    if (!s.ok()) Throw(s, runtime().Fatal(s));
  }

  void AbandonStep(const std::string& why) {
    py::gil_scoped_release release;
    runtime().AbandonStep(Aborted("{}", why));
  }

  void FinishRun() {
    Status s = [&] {
      py::gil_scoped_release release;
      return runtime().FinishRun();
    }();
    if (!s.ok()) Throw(s, runtime().Fatal(s));
  }

  std::vector<float> AllReduceBetweenSteps(std::vector<float> values) {
    Status s = [&] {
      py::gil_scoped_release release;
      return runtime().AllReduceBetweenSteps(values.data(), values.size());
    }();
    if (!s.ok()) Throw(s, false);
    return values;
  }

  // Has the servers save the state after `step`; waits until written.
  // Returns the checkpoint's directory.
  std::string SaveCheckpoint(const std::string& directory, uint64_t step, double timeout_seconds) {
    Result<std::string> dir = [&]() -> Result<std::string> {
      py::gil_scoped_release release;
      auto infos = runtime().SaveCheckpoint(directory, step);
      if (!infos.ok()) return infos.status();
      if (infos->empty()) return Internal("no parameter server saved a checkpoint");
      const auto deadline =
          std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
      TANDEM_RETURN_IF_ERROR(runtime().WaitForCheckpoint(infos->front().checkpoint_id(), deadline));
      return infos->front().path();
    }();
    if (!dir.ok()) Throw(dir.status(), runtime().Fatal(dir.status()));
    return *dir;
  }

  // A completed step: the tandem_train_* metrics, and its progress line.
  std::string RecordStep(const py::dict& r) {
    worker::StepRecord record;
    record.step = r["step"].cast<uint64_t>();
    record.epoch = r["epoch"].cast<uint64_t>();
    record.loss = r["loss"].cast<double>();
    record.tokens = r["tokens"].cast<uint64_t>();
    record.samples = r["samples"].cast<uint64_t>();
    record.step_seconds = r["step_seconds"].cast<double>();
    record.compute_seconds = r["compute_seconds"].cast<double>();
    record.comm_seconds = r["comm_seconds"].cast<double>();
    record.exposed_seconds = r["exposed_seconds"].cast<double>();
    record.world_size = r["world_size"].cast<uint32_t>();
    record.rank = r["rank"].cast<uint32_t>();
    record.retries = r["retries"].cast<uint64_t>();
    record.resynced = r["resynced"].cast<bool>();
    record.parameter_bytes = r["parameter_bytes"].cast<uint64_t>();
    if (metrics_ != nullptr) metrics_->Record(record);
    return worker::ToJson(record);
  }

  // A rollback to a checkpoint since the last call (see
  // Runtime::TakeRollback), counted in the metrics: None, or a dict of
  // from, to, checkpoint and its progress line.
  py::object TakeRollback() {
    auto rollback = runtime().TakeRollback();
    if (!rollback) return py::none();
    if (metrics_ != nullptr) metrics_->Record(*rollback);
    py::dict d;
    d["from"] = rollback->from;
    d["to"] = rollback->to;
    d["checkpoint"] = rollback->checkpoint;
    d["line"] = worker::ToJson(*rollback);
    return d;
  }

  void RecordFailure() {
    if (metrics_ != nullptr) metrics_->failures.Increment();
  }

 private:
  tandem::Daemon& Daemon() {
    if (daemon_ == nullptr) Throw(FailedPrecondition("the worker is not running"));
    return daemon_->daemon();
  }

  void OnShutdownRequest() {
    shutdown_requested_ = true;
    // Any thread: Runtime::Stop is thread-safe, and mu_ keeps Shutdown from
    // destroying the runtime meanwhile.
    MutexLock lock(&mu_);
    if (runtime_ != nullptr) runtime_->Stop();
    cv_.NotifyAll();
  }

  void StopWakeupWatch() {
    if (wakeup_thread_.joinable()) {
      if (::write(stop_pipe_[1], "x", 1) < 0) spdlog::debug("waking the signal watcher failed: {}", errno);
      wakeup_thread_.join();
      ::close(stop_pipe_[0]);
      ::close(stop_pipe_[1]);
    }
  }

  DaemonSpec spec_;
  std::unique_ptr<RunningDaemon> daemon_;
  std::string help_;
  Mutex mu_;
  CondVar cv_;
  // context_ and runtime_ are written under mu_ (the loop thread and
  // OnShutdownRequest read them under it); the Python thread that writes
  // them reads them without it.
  worker::WorkerContext* context_ = nullptr;
  bool released_ TANDEM_GUARDED_BY(mu_) = false;
  std::atomic<bool> shutdown_requested_{false};
  std::unique_ptr<worker::Runtime> runtime_;
  std::unique_ptr<worker::TrainMetrics> metrics_;
  std::thread wakeup_thread_;
  int stop_pipe_[2] = {-1, -1};
};

// Writes a parameter-server checkpoint of the whole model into `dir`: one
// partition over [0, count) holding the weights and `state_buffers` of the
// state arrays (addresses of count floats each), at training step `step`
// with `version` (1 + the optimizer updates the state has seen), for the
// tensor table `tensors` (its fingerprint) and optimizer `optimizer` ("sgd",
// "adam", "adamw"). The servers restore it onto any partitioning.
void WriteCheckpoint(const std::string& dir, const TensorTable& tensors, uintptr_t weights, size_t count,
                     uintptr_t state0, uintptr_t state1, int state_buffers, const std::string& optimizer, uint64_t step,
                     uint64_t version) {
  const std::vector<v1::TensorSpec> specs = Specs(tensors);
  google::protobuf::RepeatedPtrField<v1::TensorSpec> table(specs.begin(), specs.end());
  server::CheckpointMeta meta;
  meta.job_id = "tandem.torch";
  meta.checkpoint_id = "torch-state";
  meta.step = step;
  meta.parameter_count = count;
  meta.tensor_fingerprint = server::TensorTableFingerprint(table);
  meta.optimizer = optimizer;
  meta.state_buffers = static_cast<uint32_t>(state_buffers);
  server::PartitionState part;
  part.begin = 0;
  part.end = count;
  part.step = step;
  part.version = version;
  const auto* w = reinterpret_cast<const float*>(weights);
  part.weights.assign(w, w + count);
  if (state_buffers >= 1)
    part.state0.assign(reinterpret_cast<const float*>(state0), reinterpret_cast<const float*>(state0) + count);
  if (state_buffers >= 2)
    part.state1.assign(reinterpret_cast<const float*>(state1), reinterpret_cast<const float*>(state1) + count);
  Status s = [&] {
    py::gil_scoped_release release;
    return server::WriteCheckpointFiles(dir, meta, {&part}, nullptr, nullptr);
  }();
  if (!s.ok()) Throw(s);
}

// A checkpoint's whole state: (meta, weights, state0, state1) with the
// arrays as bytes of little-endian fp32.
py::tuple ReadCheckpoint(const std::string& dir) {
  Result<server::PartitionState> state = [&]() -> Result<server::PartitionState> {
    py::gil_scoped_release release;
    TANDEM_ASSIGN_OR_RETURN(auto reader, server::CheckpointReader::Open(dir));
    const uint64_t n = reader.meta().parameter_count;
    return reader.Read(0, 0, n, /*with_state=*/true);
  }();
  if (!state.ok()) Throw(state.status());
  auto reader = server::CheckpointReader::Open(dir);
  if (!reader.ok()) Throw(reader.status());
  const auto& meta = reader->meta();
  py::dict m;
  m["job_id"] = meta.job_id;
  m["checkpoint_id"] = meta.checkpoint_id;
  m["step"] = meta.step;
  m["parameter_count"] = meta.parameter_count;
  m["optimizer"] = meta.optimizer;
  m["state_buffers"] = meta.state_buffers;
  m["version"] = state->version;
  auto bytes = [](const std::vector<float>& v) {
    return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  };
  return py::make_tuple(m, bytes(state->weights), bytes(state->state0), bytes(state->state1));
}

}  // namespace
}  // namespace tandem::python

PYBIND11_MODULE(_tandem, m) {
  using tandem::python::Worker;
  namespace tw = tandem::worker;
  m.doc() = "Tandem's worker runtime for Python training loops (the PyTorch front end: tandem.torch)";
  m.attr("__version__") = TANDEM_VERSION;

  m.def("_set_error_type", [](py::object type) { tandem::python::ErrorType() = std::move(type); });
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tandem::python::StatusError& e) {
      py::object& type = tandem::python::ErrorType();
      py::tuple args = py::make_tuple(tandem::python::CodeName(e.status.code()), e.status.message(), e.fatal);
      if (type) {
        PyErr_SetObject(type.ptr(), args.ptr());
      } else {
        PyErr_SetString(PyExc_RuntimeError, e.status.ToString().c_str());
      }
    }
  });

  py::class_<tw::StepPlan>(m, "StepPlan")
      .def_readonly("step", &tw::StepPlan::step)
      .def_readonly("epoch", &tw::StepPlan::epoch)
      .def_readonly("rank", &tw::StepPlan::rank)
      .def_readonly("world_size", &tw::StepPlan::world_size)
      .def_readonly("dp_rank", &tw::StepPlan::dp_rank)
      .def_readonly("dp_size", &tw::StepPlan::dp_size)
      .def_readonly("resynced", &tw::StepPlan::resynced);

  py::class_<tw::StepResult>(m, "StepResult")
      .def_readonly("step", &tw::StepResult::step)
      .def_readonly("epoch", &tw::StepResult::epoch)
      .def_readonly("loss", &tw::StepResult::loss)
      .def_readonly("samples", &tw::StepResult::samples)
      .def_readonly("tokens", &tw::StepResult::tokens)
      .def_readonly("comm_seconds", &tw::StepResult::comm_seconds)
      .def_readonly("exposed_seconds", &tw::StepResult::exposed_seconds)
      .def_readonly("optimizer_seconds", &tw::StepResult::optimizer_seconds)
      .def_readonly("skipped", &tw::StepResult::skipped)
      .def_readonly("parameter_bytes", &tw::StepResult::parameter_bytes);

  py::class_<Worker>(m, "Worker")
      .def(py::init<std::vector<std::string>>(), py::arg("args"))
      .def_property_readonly("help", &Worker::help)
      .def_property_readonly("running", &Worker::running)
      .def("train_config", &Worker::Train)
      .def_property_readonly("grpc_address", &Worker::grpc_address)
      .def_property_readonly("metrics_address", &Worker::metrics_address)
      .def_property_readonly("shutdown_requested", &Worker::shutdown_requested)
      .def("failure", &Worker::failure)
      .def("request_shutdown", &Worker::RequestShutdown, py::arg("failure") = "")
      .def("shutdown", &Worker::Shutdown)
      .def("watch_wakeup_fd", &Worker::WatchWakeupFd)
      .def("create_runtime", &Worker::CreateRuntime)
      .def("attach", &Worker::Attach)
      .def("set_initial_state", &Worker::SetInitialState)
      .def("begin_step", &Worker::BeginStep)
      .def("gradients_ready", &Worker::GradientsReady)
      .def("set_step_learning_rate", &Worker::SetStepLearningRate)
      .def("end_step", &Worker::EndStep, py::arg("loss_share"), py::arg("samples"), py::arg("tokens"),
           py::arg("more") = std::vector<float>{})
      .def("acquire", &Worker::Acquire)
      .def("wait_for_parameters", &Worker::WaitForParameters)
      .def("abandon_step", &Worker::AbandonStep)
      .def("finish_run", &Worker::FinishRun)
      .def("allreduce_between_steps", &Worker::AllReduceBetweenSteps)
      .def("save_checkpoint", &Worker::SaveCheckpoint)
      .def("record_step", &Worker::RecordStep)
      .def("record_failure", &Worker::RecordFailure)
      .def("take_rollback", &Worker::TakeRollback)
      .def("completed_steps", [](Worker& w) { return w.runtime().completed_steps(); });

  m.def("read_checkpoint", &tandem::python::ReadCheckpoint, py::arg("dir"));
  m.def("write_checkpoint", &tandem::python::WriteCheckpoint);
  m.def("builtin_corpus", [] {
    std::string corpus = tandem::data::DefaultCorpus();
    return py::bytes(corpus);
  });
}
