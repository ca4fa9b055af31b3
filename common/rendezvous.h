// Rendezvous: how the ranks of a communicator exchange the small values they
// need to connect (UCX worker addresses, shared-memory segment names, NCCL
// unique ids) before any data moves. Keys are scoped by the caller, for
// example "world/ucx/3" or "nccl/dp/0"; a key is written once per epoch.
//
// Implementations: the coordinator's epoch values (workers in a job; see
// PutEpochValue / GetEpochValues), a directory on a shared file system
// (`tandem bench`, tests), and memory (threads of one process).
//
// Thread safety: implementations are thread-safe.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace tandem::comm {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  // Publishes `value` (at most 64 KiB) under `key`. ALREADY_EXISTS if the
  // key holds a different value.
  virtual Status Put(const std::string& key, const std::string& value) = 0;
  // Waits up to `timeout` for `key`; DEADLINE_EXCEEDED naming the key if it
  // never appears.
  virtual Result<std::string> Get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // True once whoever builds with this rendezvous gave up (the process is
  // stopping): waits that follow it, such as a transport's handshake with
  // the peers it found, end early too.
  virtual bool cancelled() const { return false; }
};

// Files in a directory (created if missing); values are written to a
// temporary file and renamed, so readers never see half a value.
class FileRendezvous : public Rendezvous {
 public:
  explicit FileRendezvous(std::string dir);
  Status Put(const std::string& key, const std::string& value) override;
  Result<std::string> Get(const std::string& key, std::chrono::milliseconds timeout) override;

 private:
  std::string PathOf(const std::string& key) const;
  const std::string dir_;
};

// In memory, shared by the threads of one process (tests).
class MemoryRendezvous : public Rendezvous {
 public:
  Status Put(const std::string& key, const std::string& value) override;
  Result<std::string> Get(const std::string& key, std::chrono::milliseconds timeout) override;

 private:
  Mutex mu_;
  CondVar cv_;
  std::map<std::string, std::string> values_ TANDEM_GUARDED_BY(mu_);
};

}  // namespace tandem::comm
