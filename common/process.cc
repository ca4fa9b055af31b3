#include "common/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace tandem {

std::string ExitInfo::ToString() const {
  if (exited) return fmt::format("exit {}", code);
  const char* name = sigabbrev_np(signal);
  return fmt::format("killed by SIG{}", name != nullptr ? name : std::to_string(signal).c_str());
}

Result<std::unique_ptr<Subprocess>> Subprocess::Spawn(const SpawnOptions& options) {
  if (options.argv.empty()) return InvalidArgument("spawn: no program given");
  // Everything the child needs is prepared before fork(): after it, only
  // async-signal-safe calls are allowed.
  std::vector<char*> argv;
  for (const auto& a : options.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) env_storage.emplace_back(*e);
  for (const auto& e : options.extra_env) env_storage.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);
  int out_fd = -1;
  if (!options.output_file.empty()) {
    out_fd = open(options.output_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (out_fd < 0) return NotFound("spawn: cannot open '{}': {}", options.output_file, std::strerror(errno));
  }
  // The child reports an exec failure through this close-on-exec pipe.
  int err_pipe[2];
  if (pipe2(err_pipe, O_CLOEXEC) != 0) return Internal("spawn: pipe: {}", std::strerror(errno));
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int e = errno;
    close(err_pipe[0]);
    close(err_pipe[1]);
    if (out_fd >= 0) close(out_fd);
    return Internal("spawn: fork: {}", std::strerror(e));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died before prctl
    if (options.new_process_group) setpgid(0, 0);
    sigset_t none;
    sigemptyset(&none);
    pthread_sigmask(SIG_SETMASK, &none, nullptr);  // do not inherit ShutdownSignal's mask
    signal(SIGPIPE, SIG_DFL);
    if (out_fd >= 0) {
      dup2(out_fd, STDOUT_FILENO);
      dup2(out_fd, STDERR_FILENO);
    }
    execve(argv[0], argv.data(), envp.data());
    const int e = errno;
    (void)!write(err_pipe[1], &e, sizeof(e));
    _exit(127);
  }
  close(err_pipe[1]);
  if (out_fd >= 0) close(out_fd);
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(err_pipe[0], &child_errno, sizeof(child_errno));
  } while (n < 0 && errno == EINTR);
  close(err_pipe[0]);
  std::unique_ptr<Subprocess> process(new Subprocess(pid, options.new_process_group));
  if (n == static_cast<ssize_t>(sizeof(child_errno))) {
    process->Reap(true);
    return NotFound("spawn: cannot run '{}': {}", options.argv[0], std::strerror(child_errno));
  }
  return process;
}

Subprocess::~Subprocess() {
  if (!reaped_) {
    KillHard();
    Reap(true);
  }
}

void Subprocess::KillHard() {
  // The whole process group, so nothing the child started outlives it.
  if (own_group_) kill(-pid_, SIGKILL);
  kill(pid_, SIGKILL);
}

bool Subprocess::Reap(bool block) {
  if (reaped_) return true;
  int status = 0;
  pid_t r;
  do {
    r = waitpid(pid_, &status, block ? 0 : WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r != pid_) return false;
  reaped_ = true;
  if (WIFEXITED(status)) {
    exit_ = {true, WEXITSTATUS(status), 0};
  } else if (WIFSIGNALED(status)) {
    exit_ = {false, 0, WTERMSIG(status)};
  }
  return true;
}

bool Subprocess::Running() {
  return !Reap(false);
}

Status Subprocess::Signal(int sig) {
  if (Reap(false)) return FailedPrecondition("process {} has already exited ({})", pid_, exit_.ToString());
  if (kill(pid_, sig) != 0) return Internal("kill({}, {}): {}", pid_, sig, std::strerror(errno));
  return Status::Ok();
}

Result<ExitInfo> Subprocess::Wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!Reap(false)) {
    if (std::chrono::steady_clock::now() >= deadline) {
      return DeadlineExceeded("process {} still running after {} ms", pid_, timeout.count());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return exit_;
}

ExitInfo Subprocess::Stop(std::chrono::milliseconds grace) {
  if (Signal(SIGTERM).ok()) {
    if (auto r = Wait(grace); r.ok()) return *r;
    KillHard();
  }
  Reap(true);
  return exit_;
}

}  // namespace tandem
