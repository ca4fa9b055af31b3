// CPU sets: which CPUs a process may use, lists in the kernel's syntax
// ("0-3,8,10-11"), and pinning a process to some of them. Workers pin
// themselves with their `cpus` option; `tandem run` gives each worker its
// own share of the machine, as MPI launchers bind ranks to cores.
//
// Thread safety: thread-safe (BindProcess changes the whole process).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem {

// The CPUs this process may run on, ascending.
std::vector<int> AllowedCpus();

// Parses "0-3,8,10-11" (ascending or not, no duplicates needed) into sorted,
// distinct CPU numbers. INVALID_ARGUMENT names the part that is wrong.
Result<std::vector<int>> ParseCpuList(std::string_view text);

// The shortest list for `cpus` ("0-3,8"); "" when empty.
std::string FormatCpuList(std::vector<int> cpus);

// The CPUs process `index` of `count` gets out of `allowed`: a contiguous
// block of them when there are at least as many CPUs as processes (the
// first allowed.size() % count processes get one more), else one CPU,
// round robin. Empty when `allowed` is.
std::vector<int> ShareOfCpus(const std::vector<int>& allowed, int index, int count);

// Pins every thread of this process (and the threads it starts later) to
// `cpus`, which must all be among the CPUs it may use now (AllowedCpus;
// INVALID_ARGUMENT otherwise, naming them). There is no widening it later.
Status BindProcess(const std::vector<int>& cpus);

}  // namespace tandem
