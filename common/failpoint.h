// Fault injection for tests: named points in the code where a test can make
// a process fail at a chosen moment that no signal from outside can hit (for
// example between a parameter server deciding a step and replicating it).
//
// Failpoints are read once from the environment variable TANDEM_FAILPOINTS,
// a comma-separated list of name=value pairs:
//
//   TANDEM_FAILPOINTS=ps.crash_on_decide=4 tandem-server ...
//
// Without the variable (every production run) each check is one load of a
// cached, empty table. docs/building.md#failpoints lists the failpoints.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tandem {

// The value given to failpoint `name`, if it is set.
std::optional<std::string> FailpointValue(std::string_view name);

// The value of failpoint `name` as a number (a step, a count), if it is set
// to one. A value that is not a number is logged once and ignored.
std::optional<uint64_t> FailpointNumber(std::string_view name);

// Dies with SIGKILL after `delay_ms`, from a thread of its own, so that the
// caller's thread (maybe a transport's progress thread) can go on delivering
// what it already sent. Logs the reason first.
void FailpointCrashSoon(const std::string& why, int delay_ms);

}  // namespace tandem
