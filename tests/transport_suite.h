// The transports the shared transport suite (transport_test.cc) runs over,
// and what its checks share: every rule of common/transport/transport.h is
// checked the same way on every transport (tensorpipe's transport_test.h
// pattern, as comm_backends.h does for the communicators). Each backend
// builds a group of connected transports whose ranks are threads of the test
// process, and says how a rank goes away (a LocalFabric rank is killed; a UCX
// rank closes its transport). What is particular to one transport stays in
// that transport's own test (ucx_transport_test.cc: options, handshake, path
// summaries, tags, WaitPosted and Progress, peers in other processes).
//
// Adding a transport: write a function returning its TransportBackend (next
// to LocalTransportBackend below) and add it to AllTransportBackends(). The
// suite then runs every test over it.
//
// Thread safety: a TransportGroup's transports follow transport.h; the group
// itself (close) belongs to the test's main thread. A Completions object is
// thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "common/transport/local_transport.h"
#include "common/transport/transport.h"
#include "common/transport/ucx_transport.h"

namespace tandem::testing {

// Bytes of a recognisable pattern that depends on `seed`.
inline std::vector<char> Pattern(size_t bytes, int seed) {
  std::vector<char> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<char>((i * 131 + static_cast<size_t>(seed) * 7919) % 251);
  return v;
}

// Records the completions of one transport's operations (the rules below
// hold per transport) and waits for them. Checks on the way what every
// completion promises: it runs once, never inside the posting call (on the
// thread that built this object, the one posting), and never at the same
// time as another completion of the same transport.
class Completions {
 public:
  transport::Transport::Completion Record(std::function<void(const Status&)> also = nullptr) {
    auto calls = std::make_shared<std::atomic<int>>(0);
    return [this, calls, also = std::move(also)](const Status& status) {
      if (calls->fetch_add(1) != 0) ADD_FAILURE() << "a completion ran twice: " << status.ToString();
      if (running_.fetch_add(1) != 0) overlapped_.store(true);
      if (also) also(status);
      running_.fetch_sub(1);
      MutexLock lock(&mu_);
      statuses_.push_back(status);
      if (std::this_thread::get_id() == caller_) inside_caller_ = true;
      cv_.NotifyAll();
    };
  }
  // Waits for `n` completions in all (up to 10 s).
  bool WaitFor(size_t n) {
    MutexLock lock(&mu_);
    return cv_.WaitFor(lock, std::chrono::seconds(10), [&]() TANDEM_REQUIRES(mu_) { return statuses_.size() >= n; });
  }
  std::vector<Status> statuses() {
    MutexLock lock(&mu_);
    return statuses_;
  }
  // Whether a completion ran on the thread that built this object (the one
  // posting): completions never run inside the posting call.
  bool ranOnCaller() {
    MutexLock lock(&mu_);
    return inside_caller_;
  }
  // Whether two completions ran at once.
  bool overlapped() const { return overlapped_.load(); }

 private:
  Mutex mu_;
  CondVar cv_;
  std::vector<Status> statuses_ TANDEM_GUARDED_BY(mu_);
  const std::thread::id caller_ = std::this_thread::get_id();
  bool inside_caller_ TANDEM_GUARDED_BY(mu_) = false;
  std::atomic<int> running_{0};
  std::atomic<bool> overlapped_{false};
};

// ---------------------------------------------------------------------------
// UCX on loopback, as the suite's UCX backends and ucx_transport_test use it.

inline constexpr std::chrono::milliseconds kUcxWait{10000};

inline transport::UcxOptions UcxTestOptions(const std::string& tls = "", bool prefer_copy_shm = true) {
  transport::UcxOptions o;
  o.net_devices = "lo";
  o.tls = tls;
  o.prefer_copy_shm = prefer_copy_shm;
  o.close_timeout = std::chrono::milliseconds(1000);
  o.abandon_timeout = std::chrono::milliseconds(3000);
  return o;
}

using UcxGroup = std::vector<std::unique_ptr<transport::UcxTransport>>;

// n connected UCX transports (empty, with test failures, if that fails); rank
// r uses options[r], or options[0] for all.
inline UcxGroup ConnectedUcx(int n, const std::vector<transport::UcxOptions>& options) {
  UcxGroup group;
  std::vector<std::string> addresses;
  for (int r = 0; r < n; ++r) {
    auto t = transport::UcxTransport::Create(options.size() == 1 ? options[0] : options.at(static_cast<size_t>(r)));
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    if (!t.ok()) return {};
    addresses.push_back((*t)->address());
    group.push_back(std::move(t).value());
  }
  std::vector<Status> results(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      results[static_cast<size_t>(r)] = group[static_cast<size_t>(r)]->Connect(r, n, addresses, kUcxWait);
    });
  }
  for (auto& th : threads) th.join();
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(results[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << results[static_cast<size_t>(r)].ToString();
    if (!results[static_cast<size_t>(r)].ok()) return {};
  }
  return group;
}

inline UcxGroup ConnectedUcx(int n, const transport::UcxOptions& options) {
  return ConnectedUcx(n, std::vector<transport::UcxOptions>{options});
}

// The UCX paths every UCX test that runs per path covers.
struct UcxPath {
  const char* name;  // letters and digits: used in test names
  const char* tls;
  bool prefer_copy_shm;
};

inline std::vector<UcxPath> UcxPaths() {
  return {{"SharedMemoryCopy", "", true}, {"SharedMemoryCma", "", false}, {"Tcp", "tcp", true}};
}

// Names the parameter in test listings (ctest shows it).
inline void PrintTo(const UcxPath& path, std::ostream* os) {
  *os << path.name;
}

// ---------------------------------------------------------------------------
// The backends.

// The connected transports of one group, transports[r] being rank r.
class TransportGroup {
 public:
  virtual ~TransportGroup() = default;
  int size() const { return static_cast<int>(transports_.size()); }
  transport::Transport& operator[](int rank) { return *transports_.at(static_cast<size_t>(rank)); }
  transport::Transport* get(int rank) { return transports_.at(static_cast<size_t>(rank)).get(); }
  // Makes `rank` go away as a process that ends: its peers' pending and later
  // operations with it fail with UNAVAILABLE naming it. The test uses that
  // rank's transport no more.
  virtual void Close(int rank) = 0;

 protected:
  std::vector<std::unique_ptr<transport::Transport>> transports_;
};

struct TransportBackend {
  // Used in test names: letters and digits only.
  std::string name;
  // Builds a group of `n` connected transports (null, with test failures, if
  // that fails).
  std::function<std::unique_ptr<TransportGroup>(int n)> make_group;
};

inline void PrintTo(const TransportBackend& backend, std::ostream* os) {
  *os << backend.name;
}

// The in-process fabric; Close is LocalFabric::Kill.
inline TransportBackend LocalTransportBackend() {
  class Group final : public TransportGroup {
   public:
    explicit Group(int n) : fabric_(transport::LocalFabric::Create(n)) {
      for (int r = 0; r < n; ++r) transports_.push_back(fabric_->Connect(r));
    }
    ~Group() override { transports_.clear(); }  // before the fabric
    void Close(int rank) override { fabric_->Kill(rank); }

   private:
    std::shared_ptr<transport::LocalFabric> fabric_;
  };
  return {"Local", [](int n) -> std::unique_ptr<TransportGroup> { return std::make_unique<Group>(n); }};
}

// UCX on one path; Close destroys the rank's transport (it closes its
// endpoints, as a process that exits does).
inline TransportBackend UcxTransportBackend(const UcxPath& path) {
  class Group final : public TransportGroup {
   public:
    explicit Group(UcxGroup group) {
      for (auto& t : group) transports_.push_back(std::move(t));
    }
    void Close(int rank) override { transports_.at(static_cast<size_t>(rank)).reset(); }
  };
  const transport::UcxOptions options = UcxTestOptions(path.tls, path.prefer_copy_shm);
  return {std::string("Ucx") + path.name, [options](int n) -> std::unique_ptr<TransportGroup> {
            UcxGroup group = ConnectedUcx(n, options);
            if (group.size() != static_cast<size_t>(n)) return nullptr;
            return std::make_unique<Group>(std::move(group));
          }};
}

// Every transport the suite runs over.
inline std::vector<TransportBackend> AllTransportBackends() {
  std::vector<TransportBackend> backends = {LocalTransportBackend()};
  for (const UcxPath& path : UcxPaths()) backends.push_back(UcxTransportBackend(path));
  // Add a transport here.
  return backends;
}

}  // namespace tandem::testing
