// The shared-memory communicator between real processes: results, a rank
// killed mid-collective (named within the timeout, never a hang), a rank that
// never enters (named when the timeout passes), disagreeing ranks, and no
// segment left behind in /dev/shm.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <thread>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "worker/comm/shm_communicator.h"

namespace tandem::comm {
namespace {

using Clock = std::chrono::steady_clock;
using testing::ReadFile;
using testing::TempDir;

struct RankResult {
  bool exited = false;
  int code = -1;
  std::string message;  // the rank's final status
  double seconds = 0;   // from start until the rank wrote its status
  pid_t pid = 0;
};

// Forks one process per rank running body(rank, rendezvous); each writes its
// final status to a file. Ranks still running after `bound` are killed by PID.
std::vector<RankResult> ForkRanks(int n, const std::function<Status(int, Rendezvous&)>& body,
                                  std::chrono::seconds bound = std::chrono::seconds(30)) {
  TempDir dir;
  const auto start = Clock::now();
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      FileRendezvous rendezvous(dir.path() + "/rendezvous");
      const Status status = body(r, rendezvous);
      const double s = std::chrono::duration<double>(Clock::now() - start).count();
      std::ofstream(dir.path() + "/rank-" + std::to_string(r)) << s << "\n" << status.ToString();
      ::_exit(status.ok() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  std::vector<RankResult> results(static_cast<size_t>(n));
  for (size_t i = 0; i < pids.size(); ++i) results[i].pid = pids[i];
  const auto deadline = start + bound;
  size_t left = pids.size();
  while (left > 0 && Clock::now() < deadline) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (results[i].exited) continue;
      int status = 0;
      if (::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        results[i].exited = true;
        results[i].code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        --left;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    if (results[i].exited) continue;
    ::kill(pids[i], SIGKILL);
    ::waitpid(pids[i], nullptr, 0);
  }
  for (int r = 0; r < n; ++r) {
    std::istringstream in(ReadFile(dir.path() + "/rank-" + std::to_string(r)));
    auto& result = results[static_cast<size_t>(r)];
    in >> result.seconds;
    in.get();
    std::getline(in, result.message, '\0');
  }
  return results;
}

CommInfo Info(int rank, int size, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  CommInfo info;
  info.name = "world";
  info.epoch = 1;
  info.rank = rank;
  info.size = size;
  info.timeout = timeout;
  return info;
}

// Segments in /dev/shm made by these ranks (rank 0 names them after its pid).
std::vector<std::string> Segments(const std::vector<RankResult>& ranks) {
  std::vector<std::string> names;
  const std::string prefix = "tandem-" + std::to_string(ranks.at(0).pid) + "-";
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) names.push_back(name);
  }
  return names;
}

TEST(ShmProcessTest, CollectivesAcrossProcesses) {
  const auto results = ForkRanks(3, [](int r, Rendezvous& rv) -> Status {
    ShmOptions options;
    options.round_bytes = 64 << 10;  // many rounds
    TANDEM_ASSIGN_OR_RETURN(auto comm, ShmCommunicator::Create(Info(r, 3), rv, options));
    const size_t count = (5 << 20) / 4 + 3;
    std::vector<float> in(count);
    std::vector<float> out(count);
    for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>(r + 1 + static_cast<int>(i % 5));
    TANDEM_RETURN_IF_ERROR(comm->AllReduce(in.data(), out.data(), count, DType::kFloat32, ReduceOp::kSum));
    for (size_t i = 0; i < count; ++i) {
      const float want = static_cast<float>(6 + 3 * static_cast<int>(i % 5));
      if (out[i] != want) return Internal("rank {}: out[{}] = {}, want {}", r, i, out[i], want);
    }
    std::vector<float> all(count * 3);
    TANDEM_RETURN_IF_ERROR(comm->AllGather(in.data(), all.data(), count, DType::kFloat32));
    for (int j = 0; j < 3; ++j) {
      if (all[static_cast<size_t>(j) * count] != static_cast<float>(j + 1)) return Internal("all_gather block {}", j);
    }
    // A ring of sends: each rank passes its input to the next.
    TANDEM_RETURN_IF_ERROR(comm->SendRecv((r + 1) % 3, in.data(), (r + 2) % 3, out.data(), count, DType::kFloat32));
    if (out[0] != static_cast<float>((r + 2) % 3 + 1)) return Internal("sendrecv got {}", out[0]);
    return comm->Barrier();
  });
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].code, 0) << "rank " << r << ": " << results[r].message;
  }
  EXPECT_TRUE(Segments(results).empty()) << "a segment was left in /dev/shm";
}

TEST(ShmProcessTest, KilledRankIsNamedByTheSurvivors) {
  // The timeout is long: the survivors must notice the death, not time out.
  const auto results = ForkRanks(3, [](int r, Rendezvous& rv) -> Status {
    TANDEM_ASSIGN_OR_RETURN(auto comm, ShmCommunicator::Create(Info(r, 3, std::chrono::seconds(60)), rv));
    std::vector<float> data(1 << 18, 1.0f);
    for (int i = 0; i < 100000; ++i) {
      if (r == 2 && i == 20) ::raise(SIGKILL);  // dies between collectives, never reaped until the test ends
      TANDEM_RETURN_IF_ERROR(comm->AllReduce(data.data(), data.data(), data.size(), DType::kFloat32, ReduceOp::kMax));
    }
    return Internal("rank {} never noticed the dead rank", r);
  });
  ASSERT_EQ(results[2].code, 128 + SIGKILL);
  for (int r = 0; r < 2; ++r) {
    const auto& result = results[static_cast<size_t>(r)];
    EXPECT_EQ(result.code, 1);
    EXPECT_NE(result.message.find("rank 2 died"), std::string::npos) << result.message;
    EXPECT_LT(result.seconds, 20.0) << "noticed only after " << result.seconds << " s";
  }
}

TEST(ShmProcessTest, RankThatNeverEntersIsNamedAtTheTimeout) {
  const auto results = ForkRanks(3, [](int r, Rendezvous& rv) -> Status {
    TANDEM_ASSIGN_OR_RETURN(auto comm, ShmCommunicator::Create(Info(r, 3, std::chrono::milliseconds(1000)), rv));
    int32_t v = r;
    for (int i = 0; i < 3; ++i) TANDEM_RETURN_IF_ERROR(comm->AllReduce(&v, &v, 1, DType::kInt32, ReduceOp::kSum));
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // alive but stuck (a hung step, say)
      return Status::Ok();
    }
    return comm->AllReduce(&v, &v, 1, DType::kInt32, ReduceOp::kSum);
  });
  for (int r : {0, 2}) {
    const auto& result = results[static_cast<size_t>(r)];
    EXPECT_EQ(result.code, 1);
    // The first to time out names rank 1; the other may instead report that first failure.
    EXPECT_NE(result.message.find("rank 1 never entered this collective"), std::string::npos) << result.message;
    EXPECT_LT(result.seconds, 2.5);
  }
}

TEST(ShmProcessTest, RanksThatDisagreeGetAnErrorNamingBoth) {
  const auto results = ForkRanks(2, [](int r, Rendezvous& rv) -> Status {
    TANDEM_ASSIGN_OR_RETURN(auto comm, ShmCommunicator::Create(Info(r, 2, std::chrono::seconds(10)), rv));
    std::vector<float> data(r == 0 ? 1000 : 1001, 1.0f);
    return comm->AllReduce(data.data(), data.data(), data.size(), DType::kFloat32, ReduceOp::kSum);
  });
  for (int r = 0; r < 2; ++r) {
    const auto& result = results[static_cast<size_t>(r)];
    EXPECT_EQ(result.code, 1);
    EXPECT_NE(result.message.find("INVALID_ARGUMENT"), std::string::npos) << result.message;
    EXPECT_NE(result.message.find("1000 float32"), std::string::npos) << result.message;
    EXPECT_NE(result.message.find("1001 float32"), std::string::npos) << result.message;
  }
}

TEST(ShmProcessTest, RankThatNeverAttachesIsNamed) {
  const auto results = ForkRanks(3, [](int r, Rendezvous& rv) -> Status {
    if (r == 2) return Status::Ok();  // never attaches
    return ShmCommunicator::Create(Info(r, 3, std::chrono::milliseconds(800)), rv).status();
  });
  EXPECT_NE(results[0].message.find("rank 2 did not attach"), std::string::npos) << results[0].message;
  EXPECT_TRUE(Segments(results).empty());
}

// A segment /dev/shm cannot hold is an error at build time that says what to
// do, with nothing published and nothing left in /dev/shm (never a SIGBUS in
// the middle of a collective).
TEST(ShmProcessTest, ASegmentTooLargeForDevShmIsAClearErrorAndLeavesNothing) {
  MemoryRendezvous rendezvous;
  ShmOptions options;
  options.round_bytes = 1ULL << 30;  // 64 ranks x 2 sets x 2 slots x 1 GiB = 256 GiB
  auto made = ShmCommunicator::Create(Info(0, 64, std::chrono::milliseconds(500)), rendezvous, options);
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), StatusCode::kResourceExhausted) << made.status().ToString();
  EXPECT_NE(made.status().message().find("/dev/shm"), std::string::npos) << made.status().ToString();
  EXPECT_FALSE(rendezvous.Get("shm/world/1", std::chrono::milliseconds(0)).ok()) << "a segment name was published";
  RankResult self;
  self.pid = ::getpid();
  EXPECT_TRUE(Segments({self}).empty()) << "a segment was left in /dev/shm";
}

}  // namespace
}  // namespace tandem::comm
