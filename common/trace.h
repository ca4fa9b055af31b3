// Timeline traces of a process: spans of each step (forward, backward, a
// bucket's reduce-scatter, push, pull, a server's aggregation and update...)
// written to one file per process, which `tandem trace merge` aligns and turns
// into one Chrome trace-event file for Perfetto or chrome://tracing
// (docs/observability.md, "Traces").
//
// Off (the default), every recording call costs one relaxed atomic load.
// On (trace.dir set), a span costs two reads of the trace clock and an
// append to a buffer of the calling thread (no allocation once the buffer
// has grown); a writer thread drains the buffers into the file every
// 200 ms. Spans of a step outside trace.steps are not recorded.
//
// The file, `<dir>/<name>-<pid>.trace.jsonl`, is JSON lines:
//   {"type":"process", ...}   who this is: role, name, pid, host, clock id,
//                             step range; later lines add what is learned
//                             (member id, rank, node)
//   {"type":"thread","tid":T,"name":"comm"}
//   {"type":"clock","ref":ID,"t0":..,"t1":..,"t2":..,"t3":..}
//                             a round trip to the reference (the
//                             coordinator): t0 and t3 on this clock, t1 and
//                             t2 on the reference's (trace_clock.h)
//   {"ph":"X","name":..,"cat":..,"ts":NS,"dur":NS,"tid":T,"step":S,"args":{..}}
//   {"ph":"i", ...}           an instant (no dur)
//   {"type":"end","events":N,"dropped":N}   written at a clean stop
// Times are nanoseconds of the trace clock: CLOCK_MONOTONIC (plus the
// failpoint trace.clock_skew_ms, for tests of the alignment).
//
// Thread safety: everything here is thread-safe. Start and Stop are meant for
// a daemon's main thread (RunningDaemon does both).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem {
class OptionSet;
}

namespace tandem::trace {

// The steps recorded: [first, last].
struct StepRange {
  uint64_t first = 0;
  uint64_t last = UINT64_MAX;
  bool Contains(uint64_t step) const { return step >= first && step <= last; }
};
// "A:B" (A to B, both included), "A:" (from A on), ":B", "S" (only S), ""
// (every step).
Result<StepRange> ParseStepRange(std::string_view text);

struct Config {
  std::string dir;    // trace.dir: where this process writes its trace; empty: no tracing
  std::string steps;  // trace.steps: ParseStepRange's form
};
// trace.dir and trace.steps (every daemon declares them).
void DeclareOptions(OptionSet& options, Config* config);

// Starts recording into `config.dir` (created if missing) as `role` named
// `name`. INVALID_ARGUMENT for a bad step range, UNAVAILABLE when the file
// cannot be created. A second Start without Stop is refused.
Status Start(const Config& config, std::string_view role, std::string_view name);
// Writes what is buffered and closes the file; recording stops.
void Stop();
// Writes what is buffered now (tests).
void Flush();
// The file being written (empty when off).
std::string Path();

namespace internal {
extern std::atomic<bool> on;
extern std::atomic<uint64_t> first_step;
extern std::atomic<uint64_t> last_step;
extern std::atomic<int64_t> skew_ns;
}  // namespace internal

// Whether tracing is on at all.
inline bool On() {
  return internal::on.load(std::memory_order_relaxed);
}
// Whether spans of `step` are recorded.
inline bool StepOn(uint64_t step) {
  return On() && step >= internal::first_step.load(std::memory_order_relaxed) &&
         step <= internal::last_step.load(std::memory_order_relaxed);
}
// The trace clock, in nanoseconds.
int64_t Now();
// A steady_clock time (CLOCK_MONOTONIC on Linux) on the trace clock.
int64_t FromSteady(std::chrono::steady_clock::time_point t);
// Tests: adds `ns` to the trace clock (as the failpoint trace.clock_skew_ms does).
void SetClockSkewForTesting(int64_t ns);
// This host's clock domain: processes with the same id read the same
// CLOCK_MONOTONIC (host name and boot id).
const std::string& ClockId();

// A new correlation id (48 bits, never 0): this process's 16-bit tag (from
// its pid and start time) and a counter, for the parameter-server frames of
// a traced step (ps::SetCorrelation).
uint64_t NewCorrelation();

// The most number-valued arguments an event has.
inline constexpr int kMaxArgs = 6;

// A number-valued argument of an event. `key` must be a string literal (or
// otherwise outlive the process).
struct Arg {
  const char* key;
  int64_t value;
};

// A span [start, end] of `step` (0: not tied to a step) on the calling
// thread. `name` and `cat` must be string literals. At most six args, and
// one short text argument (`text_key`: `text`, cut to 31 bytes).
void Complete(const char* name, const char* cat, int64_t start, int64_t end, uint64_t step,
              std::initializer_list<Arg> args = {}, const char* text_key = nullptr, std::string_view text = {});
// An instant at `ts`.
void Instant(const char* name, const char* cat, int64_t ts, uint64_t step, std::initializer_list<Arg> args = {},
             const char* text_key = nullptr, std::string_view text = {});
// Names the calling thread in the trace (once per thread is enough).
void SetThreadName(std::string_view name);
// The step the calling thread works on, for code that does not know it (a
// pipeline's sends and receives run on the training thread). 0: none.
void SetThreadStep(uint64_t step);
uint64_t ThreadStep();
// A span on a track of its own instead of the calling thread's, for spans
// that overlap without nesting (a server's aggregation of each partition):
// track `index` of `kind` (a string literal), named "<kind> <index>".
void CompleteOnTrack(const char* kind, int64_t index, const char* name, const char* cat, int64_t start, int64_t end,
                     uint64_t step, std::initializer_list<Arg> args = {});
// Adds to the process's description: {"type":"process", key: value}.
void SetProcessInfo(std::string_view key, std::string_view value);
void SetProcessInfo(std::string_view key, int64_t value);
// One round trip to the reference clock `ref` (trace_clock.h).
void RecordClockSample(std::string_view ref, int64_t t0, int64_t t1, int64_t t2, int64_t t3);

// A span of `step` from construction to destruction (or End()), recorded only
// when StepOn(step). Args added with Add (at most six).
class Span {
 public:
  Span(const char* name, const char* cat, uint64_t step)
      : name_(name), cat_(cat), step_(step), on_(StepOn(step)), start_(on_ ? Now() : 0) {}
  ~Span() { End(); }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  bool on() const { return on_; }
  void Add(const char* key, int64_t value) {
    if (on_ && nargs_ < kMaxArgs) args_[nargs_++] = {key, value};
  }
  void Text(const char* key, std::string_view text) {
    if (!on_) return;
    text_key_ = key;
    text_ = text;
  }
  void End();

 private:
  const char* name_;
  const char* cat_;
  uint64_t step_;
  bool on_;
  int64_t start_;
  Arg args_[kMaxArgs] = {};
  int nargs_ = 0;
  const char* text_key_ = nullptr;
  std::string_view text_;
};

// The clock offset of a process against its reference from round trips
// (NTP's): for each sample, offset = ((t1 - t0) + (t2 - t3)) / 2 and delay =
// (t3 - t0) - (t2 - t1); the estimate is the offset of the sample with the
// least delay (its error is at most half that delay). reference time = local
// time + offset.
struct ClockSample {
  int64_t t0 = 0, t1 = 0, t2 = 0, t3 = 0;
};
struct OffsetEstimate {
  int64_t offset_ns = 0;
  int64_t delay_ns = 0;  // of the sample used: the error is at most half of it
  size_t samples = 0;    // 0: no usable sample
};
OffsetEstimate EstimateOffset(const std::vector<ClockSample>& samples);

}  // namespace tandem::trace
