// The NCCL communicator. Everywhere: the mapping to NCCL's enums, the unique
// id's encoding, and Create failing cleanly where no GPU can be used (a build
// without CUDA, or no device). Where a CUDA device is present: every operation
// with world size 1 checked against a host reference, Abort while idle and in
// flight, the timeout, a second epoch, and (with two devices) two ranks.
//
// The GPU tests skip without a device; with TANDEM_REQUIRE_GPU set in the
// environment (scripts/gpu-check.sh sets it) they fail instead.
#include "worker/nccl/nccl_communicator.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/mutex.h"
#include "common/rendezvous.h"
#include "tandem/config.h"
#include "worker/collectives/dtype.h"
#include "worker/nccl/gpu_info.h"

#if TANDEM_CUDA_ENABLED
#include <cuda_runtime_api.h>
#endif

namespace tandem::gpu {
namespace {

using comm::CommInfo;
using comm::DType;
using comm::ReduceOp;

// Used by the GPU tests only (unused when the GPU backend is off).
[[maybe_unused]] constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kInt32,
                                              DType::kInt64};
[[maybe_unused]] constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax};

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(NcclMappingTest, DataTypesMapToNccl) {
  // ncclFloat32 = 7, ncclFloat16 = 6, ncclBfloat16 = 9, ncclInt32 = 2, ncclInt64 = 4.
  EXPECT_EQ(*ToNcclDataType(DType::kFloat32), 7);
  EXPECT_EQ(*ToNcclDataType(DType::kFloat16), 6);
  EXPECT_EQ(*ToNcclDataType(DType::kBFloat16), 9);
  EXPECT_EQ(*ToNcclDataType(DType::kInt32), 2);
  EXPECT_EQ(*ToNcclDataType(DType::kInt64), 4);
  const auto bad = ToNcclDataType(static_cast<DType>(42));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status().message(), "42")) << bad.status().message();
}

TEST(NcclMappingTest, ReduceOpsMapToNccl) {
  // ncclSum = 0, ncclAvg = 4, ncclMin = 3, ncclMax = 2.
  EXPECT_EQ(*ToNcclRedOp(ReduceOp::kSum), 0);
  EXPECT_EQ(*ToNcclRedOp(ReduceOp::kAvg), 4);
  EXPECT_EQ(*ToNcclRedOp(ReduceOp::kMin), 3);
  EXPECT_EQ(*ToNcclRedOp(ReduceOp::kMax), 2);
  const auto bad = ToNcclRedOp(static_cast<ReduceOp>(9));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

TEST(NcclMappingTest, UniqueIdKeyNamesTheCommunicatorAndEpoch) {
  CommInfo info;
  info.name = "dp/3";
  info.epoch = 7;
  EXPECT_EQ(NcclUniqueIdKey(info), "nccl/dp/3/7");
}

TEST(NcclMappingTest, HexRoundTripsBinaryBytes) {
  EXPECT_EQ(HexEncode(std::string("\x00\xff\x10\x7f", 4)), "00ff107f");
  std::string bytes(128, '\0');  // the size of an ncclUniqueId, zeros included
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 37 + 11);
  const std::string hex = HexEncode(bytes);
  EXPECT_EQ(hex.size(), 256u);
  const auto back = HexDecode(hex);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, bytes);
  EXPECT_EQ(*HexDecode("00FF"), std::string("\x00\xff", 2));
  EXPECT_EQ(*HexDecode(""), "");
  EXPECT_EQ(HexDecode("abc").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(HexDecode("0g").status().code(), StatusCode::kInvalidArgument);
}

TEST(NcclCommunicatorTest, CreateFailsCleanlyWithoutAUsableGpu) {
  const GpuInfo gpu = Probe();
  if (gpu.compiled && gpu.device_count > 0) {
    GTEST_SKIP() << "a CUDA device is present (" << Describe(gpu) << "): the GPU tests cover Create";
  }
  comm::MemoryRendezvous rendezvous;
  CommInfo info;
  info.name = "world";
  info.epoch = 3;
  info.timeout = std::chrono::milliseconds(2000);
  const auto comm = NcclCommunicator::Create(info, rendezvous, NcclOptions{});
  ASSERT_FALSE(comm.ok());
  const Status& s = comm.status();
  std::cout << "Create without a usable GPU: " << s.ToString() << "\n";
  if (!gpu.compiled) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), "this build of Tandem has no CUDA support")) << s.message();
    EXPECT_TRUE(Contains(s.message(), "-DTANDEM_WITH_CUDA=ON")) << s.message();
  } else {
    // CUDA is compiled in but no device can be used: CUDA's own explanation
    // (for example "no CUDA-capable device is detected").
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), gpu.problem)) << s.message() << " lacks " << gpu.problem;
  }
  EXPECT_TRUE(Contains(s.message(), "\"world\"")) << s.message();
  EXPECT_TRUE(Contains(s.message(), "rank 0")) << s.message();
  EXPECT_TRUE(Contains(s.message(), "epoch 3")) << s.message();
  // Nothing was published for peers to pick up.
  EXPECT_EQ(rendezvous.Get("nccl/world/3", std::chrono::milliseconds(0)).status().code(),
            StatusCode::kDeadlineExceeded);
}

// The GPU tests skip (or, with TANDEM_REQUIRE_GPU, fail) without a device.
class NcclGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    gpu_ = Probe();
    if (!gpu_.compiled || gpu_.device_count == 0) {
      const std::string reason = "needs a CUDA device and a build with CUDA; here: " + Describe(gpu_);
      if (std::getenv("TANDEM_REQUIRE_GPU") != nullptr) FAIL() << reason << " (TANDEM_REQUIRE_GPU is set)";
      GTEST_SKIP() << reason;
    }
  }
  GpuInfo gpu_;
};

#if !TANDEM_CUDA_ENABLED

TEST_F(NcclGpuTest, NotCompiledWithoutCuda) {
  FAIL() << "unreachable: SetUp skips every GPU test in a build without CUDA";
}

#else  // TANDEM_CUDA_ENABLED

// Device memory for a test, freed at the end of the scope.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) {
      EXPECT_EQ(cudaMalloc(&data_, bytes), cudaSuccess) << "cudaMalloc of " << bytes << " bytes";
    }
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return data_; }
  void Upload(const std::vector<uint8_t>& host) {
    ASSERT_LE(host.size(), bytes_);
    if (!host.empty()) {
      ASSERT_EQ(cudaMemcpy(data_, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  std::vector<uint8_t> Download() const {
    std::vector<uint8_t> host(bytes_);
    if (bytes_ > 0) {
      EXPECT_EQ(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return host;
  }
  void Fill(uint8_t byte) {
    if (bytes_ > 0) {
      ASSERT_EQ(cudaMemset(data_, byte, bytes_), cudaSuccess);
    }
  }

 private:
  size_t bytes_;
  void* data_ = nullptr;
};

void Store(std::vector<uint8_t>& bytes, size_t i, DType dtype, int v) {
  uint8_t* p = bytes.data() + i * collectives::SizeOf(dtype);
  switch (dtype) {
    case DType::kFloat32: {
      const auto f = static_cast<float>(v);
      std::memcpy(p, &f, sizeof(f));
      return;
    }
    case DType::kFloat16: {
      const uint16_t h = collectives::FloatToHalf(static_cast<float>(v));
      std::memcpy(p, &h, sizeof(h));
      return;
    }
    case DType::kBFloat16: {
      const uint16_t b = collectives::FloatToBFloat16(static_cast<float>(v));
      std::memcpy(p, &b, sizeof(b));
      return;
    }
    case DType::kInt32: {
      const auto x = static_cast<int32_t>(v);
      std::memcpy(p, &x, sizeof(x));
      return;
    }
    case DType::kInt64: {
      const auto x = static_cast<int64_t>(v);
      std::memcpy(p, &x, sizeof(x));
      return;
    }
  }
}

double Load(const uint8_t* p, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, sizeof(f));
      return f;
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, sizeof(h));
      return collectives::HalfToFloat(h);
    }
    case DType::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, p, sizeof(b));
      return collectives::BFloat16ToFloat(b);
    }
    case DType::kInt32: {
      int32_t x;
      std::memcpy(&x, p, sizeof(x));
      return x;
    }
    case DType::kInt64: {
      int64_t x;
      std::memcpy(&x, p, sizeof(x));
      return static_cast<double>(x);
    }
  }
  return 0;
}

// Small integers (exact in every dtype, their sums and halves too), different
// per rank.
std::vector<uint8_t> Pattern(DType dtype, size_t count, int rank) {
  std::vector<uint8_t> bytes(count * collectives::SizeOf(dtype));
  for (size_t i = 0; i < count; ++i) {
    Store(bytes, i, dtype, static_cast<int>((i * 7 + static_cast<size_t>(rank) * 5 + 3) % 17) - 8);
  }
  return bytes;
}

// op over the ranks' inputs, computed on the host.
std::vector<uint8_t> Reference(const std::vector<std::vector<uint8_t> >& inputs, size_t count, DType dtype,
                               ReduceOp op) {
  std::vector<uint8_t> acc = inputs.at(0);
  for (size_t r = 1; r < inputs.size(); ++r) collectives::Reduce(acc.data(), inputs[r].data(), count, dtype, op);
  if (op == ReduceOp::kAvg) collectives::Divide(acc.data(), count, dtype, static_cast<int>(inputs.size()));
  return acc;
}

::testing::AssertionResult SameElements(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                                        DType dtype) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " bytes instead of " << want.size();
  }
  const size_t size = collectives::SizeOf(dtype);
  for (size_t i = 0; i < got.size(); i += size) {
    if (std::memcmp(got.data() + i, want.data() + i, size) != 0) {
      return ::testing::AssertionFailure()
             << "element " << i / size << " of " << got.size() / size << " is " << Load(got.data() + i, dtype)
             << " instead of " << Load(want.data() + i, dtype);
    }
  }
  return ::testing::AssertionSuccess();
}

std::string Label(DType dtype, ReduceOp op, size_t count) {
  return std::string(collectives::Name(dtype)) + " " + std::string(collectives::Name(op)) + " count " +
         std::to_string(count);
}

CommInfo World(uint64_t epoch, std::chrono::milliseconds timeout = std::chrono::milliseconds(30000)) {
  CommInfo info;
  info.name = "world";
  info.epoch = epoch;
  info.rank = 0;
  info.size = 1;
  info.timeout = timeout;
  return info;
}

std::unique_ptr<NcclCommunicator> Make(const CommInfo& info, comm::Rendezvous& rendezvous,
                                       const NcclOptions& options = {}) {
  auto made = NcclCommunicator::Create(info, rendezvous, options);
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  if (!made.ok()) return nullptr;
  std::unique_ptr<comm::Communicator> base = std::move(made).value();
  auto* nccl = dynamic_cast<NcclCommunicator*>(base.get());
  EXPECT_NE(nccl, nullptr);
  if (nccl == nullptr) return nullptr;
  base.release();
  return std::unique_ptr<NcclCommunicator>(nccl);
}

// Holds a stream at a host function until Open(): the operations enqueued
// after it cannot complete, as if a peer had not entered them.
class StreamGate {
 public:
  Status Close(cudaStream_t stream) {
    if (cudaLaunchHostFunc(stream, &StreamGate::Hold, this) != cudaSuccess) return Internal("cudaLaunchHostFunc");
    return Status::Ok();
  }
  void Open() {
    MutexLock lock(&mu_);
    open_ = true;
    cv_.NotifyAll();
  }

 private:
  static void Hold(void* self) {
    auto* gate = static_cast<StreamGate*>(self);
    MutexLock lock(&gate->mu_);
    gate->cv_.Wait(lock, [gate]() TANDEM_REQUIRES(gate->mu_) { return gate->open_; });
  }
  Mutex mu_;
  CondVar cv_;
  bool open_ TANDEM_GUARDED_BY(mu_) = false;
};

TEST_F(NcclGpuTest, ReportsTheGpuBackend) {
  std::cout << "GPU backend: " << Describe(gpu_) << "\n";
  comm::MemoryRendezvous rendezvous;
  auto comm = Make(World(0), rendezvous);
  ASSERT_NE(comm, nullptr);
  EXPECT_EQ(comm->backend(), "nccl");
  EXPECT_TRUE(comm->device_buffers());
  EXPECT_EQ(comm->device(), 0);
  EXPECT_NE(comm->stream(), nullptr);
  EXPECT_TRUE(comm->health().ok());
  // Rank 0 published the unique id, hex-encoded.
  const auto id = rendezvous.Get("nccl/world/0", std::chrono::milliseconds(0));
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_EQ(id->size(), 256u);
}

TEST_F(NcclGpuTest, AllReduceMatchesTheHostReference) {
  comm::MemoryRendezvous rendezvous;
  auto comm = Make(World(0), rendezvous);
  ASSERT_NE(comm, nullptr);
  uint64_t done = 0;
  for (const DType dtype : kDTypes) {
    for (const ReduceOp op : kOps) {
      for (const size_t count : {size_t{0}, size_t{1}, size_t{1023}, size_t{4} << 20}) {
        SCOPED_TRACE(Label(dtype, op, count));
        const size_t bytes = count * collectives::SizeOf(dtype);
        const auto in = Pattern(dtype, count, 0);
        const auto want = Reference({in}, count, dtype, op);
        DeviceBuffer din(bytes);
        DeviceBuffer dout(bytes);
        din.Upload(in);
        dout.Fill(0xa5);
        Status s = comm->AllReduce(din.get(), dout.get(), count, dtype, op);
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_TRUE(SameElements(dout.Download(), want, dtype)) << "out of place";
        EXPECT_TRUE(SameElements(din.Download(), in, dtype)) << "the input changed";
        s = comm->AllReduce(din.get(), din.get(), count, dtype, op);  // in place
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_TRUE(SameElements(din.Download(), want, dtype)) << "in place";
        done += 2;
      }
    }
  }
  const comm::Progress p = comm->progress();
  EXPECT_EQ(p.communicator, "world");
  EXPECT_EQ(p.last_entered, done);
  EXPECT_EQ(p.last_completed, done);
  EXPECT_EQ(p.last_kind, "allreduce");
}

TEST_F(NcclGpuTest, EveryCollectiveWorksWithOneRank) {
  comm::MemoryRendezvous rendezvous;
  auto comm = Make(World(0), rendezvous);
  ASSERT_NE(comm, nullptr);
  for (const DType dtype : kDTypes) {
    for (const size_t count : {size_t{0}, size_t{1}, size_t{1023}, size_t{1} << 20}) {
      const size_t bytes = count * collectives::SizeOf(dtype);
      const auto in = Pattern(dtype, count, 0);
      {
        SCOPED_TRACE("broadcast " + Label(dtype, ReduceOp::kSum, count));
        DeviceBuffer data(bytes);
        data.Upload(in);
        const Status s = comm->Broadcast(data.get(), count, dtype, 0);
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_TRUE(SameElements(data.Download(), in, dtype));
      }
      for (const ReduceOp op : kOps) {
        SCOPED_TRACE("reduce and reduce_scatter " + Label(dtype, op, count));
        const auto want = Reference({in}, count, dtype, op);
        DeviceBuffer din(bytes);
        DeviceBuffer dout(bytes);
        din.Upload(in);
        dout.Fill(0x5a);
        Status s = comm->Reduce(din.get(), dout.get(), count, dtype, op, 0);
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_TRUE(SameElements(dout.Download(), want, dtype)) << "reduce";
        dout.Fill(0x5a);
        s = comm->ReduceScatter(din.get(), dout.get(), count, dtype, op);
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_TRUE(SameElements(dout.Download(), want, dtype)) << "reduce_scatter";
      }
      {
        SCOPED_TRACE("all_gather " + Label(dtype, ReduceOp::kSum, count));
        DeviceBuffer din(bytes);
        DeviceBuffer dout(bytes);
        din.Upload(in);
        dout.Fill(0x33);
        const Status s = comm->AllGather(din.get(), dout.get(), count, dtype);
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_TRUE(SameElements(dout.Download(), in, dtype));
      }
    }
  }
  for (int i = 0; i < 3; ++i) {
    const Status s = comm->Barrier();
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  const comm::Progress p = comm->progress();
  EXPECT_EQ(p.last_kind, "barrier");
  EXPECT_EQ(p.last_completed, p.last_entered);
  // Arguments the base class checks never reach NCCL.
  EXPECT_EQ(comm->Broadcast(nullptr, 1, DType::kFloat32, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(comm->health().ok());
}

TEST_F(NcclGpuTest, AbortWhileIdleFailsTheNextOperation) {
  comm::MemoryRendezvous rendezvous;
  auto comm = Make(World(0), rendezvous);
  ASSERT_NE(comm, nullptr);
  DeviceBuffer buf(1024 * sizeof(float));
  ASSERT_TRUE(comm->AllReduce(buf.get(), buf.get(), 1024, DType::kFloat32, ReduceOp::kSum).ok());
  comm->Abort("epoch 0 was superseded by epoch 1");
  for (const size_t count : {size_t{1024}, size_t{0}}) {
    const Status s = comm->AllReduce(buf.get(), buf.get(), count, DType::kFloat32, ReduceOp::kSum);
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), "epoch 0 was superseded by epoch 1")) << s.message();
  }
  EXPECT_EQ(comm->Barrier().code(), StatusCode::kAborted);
  EXPECT_EQ(comm->health().code(), StatusCode::kAborted);
  comm->Abort("a second abort changes nothing");
  EXPECT_TRUE(Contains(comm->health().message(), "superseded")) << comm->health().message();
}

TEST_F(NcclGpuTest, ANewEpochWorksAfterTheOldOneIsAborted) {
  comm::MemoryRendezvous rendezvous;
  auto old_comm = Make(World(4), rendezvous);
  ASSERT_NE(old_comm, nullptr);
  old_comm->Abort("epoch 4 was superseded by epoch 5");
  auto comm = Make(World(5), rendezvous);
  ASSERT_NE(comm, nullptr);
  auto also = Make(World(6), rendezvous);  // two live communicators on one device
  ASSERT_NE(also, nullptr);
  const auto in = Pattern(DType::kInt64, 4096, 0);
  DeviceBuffer din(in.size());
  DeviceBuffer dout(in.size());
  din.Upload(in);
  for (NcclCommunicator* c : {comm.get(), also.get()}) {
    dout.Fill(0);
    const Status s = c->AllReduce(din.get(), dout.get(), 4096, DType::kInt64, ReduceOp::kMax);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_TRUE(SameElements(dout.Download(), in, DType::kInt64));
  }
  EXPECT_EQ(old_comm->Barrier().code(), StatusCode::kAborted);
}

TEST_F(NcclGpuTest, AbortWakesAnOperationInFlight) {
  StreamGate gate;  // first: outlives the buffers, whose cudaFree waits for the host function
  comm::MemoryRendezvous rendezvous;
  auto comm = Make(World(0), rendezvous);
  ASSERT_NE(comm, nullptr);
  DeviceBuffer buf(1024 * sizeof(float));
  ASSERT_TRUE(gate.Close(comm->stream()).ok());
  // Whatever happens, the gate opens (ncclCommAbort may wait for the stream).
  std::thread opener([&gate] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    gate.Open();
  });
  Status status;
  std::chrono::steady_clock::time_point returned;
  std::thread op([&] {
    status = comm->AllReduce(buf.get(), buf.get(), 1024, DType::kFloat32, ReduceOp::kSum);
    returned = std::chrono::steady_clock::now();
  });
  const auto entered_by = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (comm->progress().last_entered == 0 && std::chrono::steady_clock::now() < entered_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(comm->progress().last_completed, 0u) << "the gate did not hold the stream";
  const auto aborted_at = std::chrono::steady_clock::now();
  comm->Abort("the job is being stopped");
  op.join();
  opener.join();
  EXPECT_EQ(status.code(), StatusCode::kAborted) << status.ToString();
  EXPECT_TRUE(Contains(status.message(), "the job is being stopped")) << status.message();
  // Well before the 30 s timeout (ncclCommAbort waits for the gate at 1.5 s).
  EXPECT_LT(returned - aborted_at, std::chrono::seconds(10));
  EXPECT_EQ(comm->Barrier().code(), StatusCode::kAborted);
}

TEST_F(NcclGpuTest, AnOperationThatDoesNotCompleteTimesOut) {
  StreamGate gate;  // first: outlives the buffers, whose cudaFree waits for the host function
  comm::MemoryRendezvous rendezvous;
  auto comm = Make(World(0, std::chrono::milliseconds(300)), rendezvous);
  ASSERT_NE(comm, nullptr);
  DeviceBuffer buf(1024 * sizeof(float));
  ASSERT_TRUE(comm->AllReduce(buf.get(), buf.get(), 1024, DType::kFloat32, ReduceOp::kSum).ok());
  ASSERT_TRUE(gate.Close(comm->stream()).ok());
  std::thread opener([&gate] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    gate.Open();
  });
  const auto start = std::chrono::steady_clock::now();
  const Status s = comm->AllReduce(buf.get(), buf.get(), 1024, DType::kFloat32, ReduceOp::kSum);
  const auto took = std::chrono::steady_clock::now() - start;
  opener.join();
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_TRUE(
      Contains(s.message(), "allreduce seq 2 did not complete within 300 ms on rank 0; NCCL communicator aborted"))
      << s.message();
  EXPECT_GE(took, std::chrono::milliseconds(300));
  // The communicator is broken for good: build a new epoch to go on.
  EXPECT_EQ(comm->health().code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(comm->Barrier().code(), StatusCode::kDeadlineExceeded);
  const comm::Progress p = comm->progress();
  EXPECT_EQ(p.last_entered, 2u);
  EXPECT_EQ(p.last_completed, 1u);
}

TEST_F(NcclGpuTest, InitTimesOutWhenARankNeverJoins) {
  comm::MemoryRendezvous rendezvous;
  CommInfo info = World(0, std::chrono::milliseconds(1000));
  info.size = 2;  // rank 1 never comes
  const auto start = std::chrono::steady_clock::now();
  const auto made = NcclCommunicator::Create(info, rendezvous, NcclOptions{});
  const auto took = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), StatusCode::kDeadlineExceeded) << made.status().ToString();
  EXPECT_TRUE(Contains(made.status().message(), "did not complete within 1000 ms on rank 0"))
      << made.status().message();
  EXPECT_LT(took, std::chrono::seconds(20));
}

TEST_F(NcclGpuTest, CreateRejectsADeviceThatDoesNotExist) {
  comm::MemoryRendezvous rendezvous;
  NcclOptions options;
  options.device = gpu_.device_count;
  const auto made = NcclCommunicator::Create(World(0), rendezvous, options);
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), StatusCode::kInvalidArgument) << made.status().ToString();
  // The default device is local_rank modulo the device count.
  options.device = -1;
  options.local_rank = gpu_.device_count;
  auto comm = Make(World(1), rendezvous, options);
  ASSERT_NE(comm, nullptr);
  EXPECT_EQ(comm->device(), 0);
}

// Two ranks, one per device, as threads of this process.
class NcclTwoGpuTest : public NcclGpuTest {
 protected:
  void SetUp() override {
    NcclGpuTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    if (gpu_.device_count < 2) GTEST_SKIP() << "needs two CUDA devices; here: " << Describe(gpu_);
  }

  // Creates both ranks of `info` concurrently (each Create waits for the other).
  std::vector<std::unique_ptr<NcclCommunicator> > MakePair(CommInfo info, comm::Rendezvous& rendezvous) {
    std::vector<std::unique_ptr<NcclCommunicator> > comms(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        CommInfo mine = info;
        mine.rank = r;
        mine.size = 2;
        NcclOptions options;
        options.local_rank = r;
        comms[static_cast<size_t>(r)] = Make(mine, rendezvous, options);
      });
    }
    for (auto& t : threads) t.join();
    return comms;
  }

  // Destroys both ranks concurrently, as their processes would.
  static void DestroyPair(std::vector<std::unique_ptr<NcclCommunicator> >& comms) {
    std::vector<std::thread> threads;
    for (auto& c : comms) threads.emplace_back([&c] { c.reset(); });
    for (auto& t : threads) t.join();
  }
};

TEST_F(NcclTwoGpuTest, AllReduceAndSendRecvAcrossTwoDevices) {
  comm::MemoryRendezvous rendezvous;
  auto comms = MakePair(World(0), rendezvous);
  ASSERT_NE(comms[0], nullptr);
  ASSERT_NE(comms[1], nullptr);
  EXPECT_NE(comms[0]->device(), comms[1]->device());
  constexpr size_t kCount = 100000;
  for (const DType dtype : kDTypes) {
    for (const ReduceOp op : kOps) {
      SCOPED_TRACE(Label(dtype, op, kCount));
      const std::vector<std::vector<uint8_t> > inputs = {Pattern(dtype, kCount, 0), Pattern(dtype, kCount, 1)};
      const auto want = Reference(inputs, kCount, dtype, op);
      std::vector<std::vector<uint8_t> > got(2);
      std::vector<Status> statuses(2);
      std::vector<std::thread> threads;
      for (int r = 0; r < 2; ++r) {
        threads.emplace_back([&, r] {
          const auto ur = static_cast<size_t>(r);
          ASSERT_EQ(cudaSetDevice(comms[ur]->device()), cudaSuccess);
          DeviceBuffer buf(inputs[ur].size());
          buf.Upload(inputs[ur]);
          statuses[ur] = comms[ur]->AllReduce(buf.get(), buf.get(), kCount, dtype, op);
          got[ur] = buf.Download();
        });
      }
      for (auto& t : threads) t.join();
      for (size_t r = 0; r < 2; ++r) {
        ASSERT_TRUE(statuses[r].ok()) << statuses[r].ToString();
        EXPECT_TRUE(SameElements(got[r], want, dtype)) << "rank " << r;
      }
    }
  }
  // Rank 0 sends to rank 1.
  const auto payload = Pattern(DType::kInt32, 4096, 3);
  std::vector<uint8_t> received;
  Status sent;
  Status recv;
  std::thread sender([&] {
    ASSERT_EQ(cudaSetDevice(comms[0]->device()), cudaSuccess);
    DeviceBuffer buf(payload.size());
    buf.Upload(payload);
    sent = comms[0]->Send(1, buf.get(), 4096, DType::kInt32);
  });
  std::thread receiver([&] {
    ASSERT_EQ(cudaSetDevice(comms[1]->device()), cudaSuccess);
    DeviceBuffer buf(payload.size());
    recv = comms[1]->Recv(0, buf.get(), 4096, DType::kInt32);
    received = buf.Download();
  });
  sender.join();
  receiver.join();
  ASSERT_TRUE(sent.ok()) << sent.ToString();
  ASSERT_TRUE(recv.ok()) << recv.ToString();
  EXPECT_TRUE(SameElements(received, payload, DType::kInt32));
  DestroyPair(comms);
}

TEST_F(NcclTwoGpuTest, ARankThatNeverEntersTimesTheOtherOut) {
  comm::MemoryRendezvous rendezvous;
  auto comms = MakePair(World(0, std::chrono::milliseconds(500)), rendezvous);
  ASSERT_NE(comms[0], nullptr);
  ASSERT_NE(comms[1], nullptr);
  ASSERT_EQ(cudaSetDevice(comms[0]->device()), cudaSuccess);
  DeviceBuffer buf(1024 * sizeof(float));
  const Status s = comms[0]->AllReduce(buf.get(), buf.get(), 1024, DType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "allreduce seq 1 did not complete within 500 ms on rank 0")) << s.message();
  // Rank 1's heartbeats would show it never entered seq 1.
  EXPECT_EQ(comms[1]->progress().last_entered, 0u);
  comms[1]->Abort("rank 0 timed out");
  DestroyPair(comms);
}

#endif  // TANDEM_CUDA_ENABLED

}  // namespace
}  // namespace tandem::gpu
