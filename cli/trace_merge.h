// `tandem trace merge`: the per-process trace files of a run (common/trace.h)
// joined into one Chrome trace-event file for Perfetto or chrome://tracing,
// every process on the reference clock, flows linking each push to the
// server's update and each pull to its answer, and optionally an SVG chart of
// each worker's step breakdown.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem::cli {

struct TraceMergeOptions {
  std::string dir;     // the trace directory (files *.trace.jsonl)
  std::string output;  // the merged trace-event JSON
  std::string svg;     // the step breakdown chart; empty: none
};

struct TraceMergeReport {
  struct Process {
    std::string file;
    std::string name;
    std::string role;
    int64_t offset_ns = 0;    // added to this process's times
    int64_t delay_ns = 0;     // of the round trip used (the offset's error is at most half)
    size_t samples = 0;       // clock samples against the reference
    bool aligned = false;     // false: no way to align it (offset 0)
    bool same_clock = false;  // on the reference's host: the offset is exact
    uint64_t events = 0;
  };
  std::vector<Process> processes;
  std::string reference;  // the reference's clock id
  uint64_t events = 0;
  uint64_t pushes = 0;         // traced pushes of the workers
  uint64_t pushes_linked = 0;  // of them, linked to their server's update
  uint64_t pulls_linked = 0;   // pulls linked to their answer
  std::vector<std::string> warnings;
};

// Reads every trace file of options.dir and writes options.output (and
// options.svg). NOT_FOUND when the directory holds no trace file,
// INVALID_ARGUMENT naming the file and line of one that is not a trace
// (a cut-off last line, as a killed process leaves, is a warning).
Result<TraceMergeReport> MergeTraces(const TraceMergeOptions& options);

// tandem trace merge DIR -o FILE [--svg FILE]
int TraceCommand(int argc, char** argv);

}  // namespace tandem::cli
