// A seam for time, so tests can move the clock instead of sleeping.
//
// Thread safety: SystemClock and FakeClock are thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace tandem {

class Clock {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  virtual ~Clock() = default;
  // Monotonic time, for deadlines and durations.
  virtual TimePoint Now() const = 0;
  // Wall-clock time in Unix milliseconds, for timestamps people read.
  virtual int64_t UnixMillis() const = 0;
};

class SystemClock final : public Clock {
 public:
  TimePoint Now() const override { return std::chrono::steady_clock::now(); }
  int64_t UnixMillis() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  // The process-wide instance (stateless, so sharing it is safe).
  static SystemClock* Get() {
    static SystemClock clock;
    return &clock;
  }
};

// A clock that moves only when told to.
class FakeClock final : public Clock {
 public:
  TimePoint Now() const override { return TimePoint(std::chrono::milliseconds(ms_.load())); }
  int64_t UnixMillis() const override { return 1'800'000'000'000 + ms_.load(); }
  void Advance(std::chrono::milliseconds d) { ms_ += d.count(); }

 private:
  std::atomic<int64_t> ms_{1'000'000};
};

}  // namespace tandem
