// Status: the one error type Tandem returns across module and RPC boundaries.
//
// Error policy (docs/architecture.md, "Errors"): functions that can fail
// return a Status or a Result<T>; the message says what was wrong in words a
// user can act on (which key, which field, which peer). Exceptions from
// third-party libraries are caught at the boundary and turned into a Status.
// Only broken invariants abort.
//
// The codes are the gRPC status codes, one for one, so a Status crosses a
// gRPC boundary unchanged in both directions (ToGrpc / FromGrpc).
//
// Thread safety: Status and Result are values; distinct objects may be used
// from distinct threads, a shared one only for reading.
#pragma once

// StatusCode, Status, Result<T> and the TANDEM_RETURN_IF_ERROR and
// TANDEM_ASSIGN_OR_RETURN macros are part of the public API: their
// definitions are in worker/include/tandem/status.h.
#include <variant>

#include <fmt/format.h>

#include "tandem/status.h"

namespace tandem {

// Constructors named after the codes, with fmt-style formatting.
#define TANDEM_STATUS_FACTORY(Name, Code)                                              \
  template <typename... Args>                                                          \
  Status Name(fmt::format_string<Args...> format, Args&&... args) {                    \
    return Status(StatusCode::Code, fmt::format(format, std::forward<Args>(args)...)); \
  }
TANDEM_STATUS_FACTORY(InvalidArgument, kInvalidArgument)
TANDEM_STATUS_FACTORY(NotFound, kNotFound)
TANDEM_STATUS_FACTORY(AlreadyExists, kAlreadyExists)
TANDEM_STATUS_FACTORY(FailedPrecondition, kFailedPrecondition)
TANDEM_STATUS_FACTORY(OutOfRange, kOutOfRange)
TANDEM_STATUS_FACTORY(Unavailable, kUnavailable)
TANDEM_STATUS_FACTORY(DeadlineExceeded, kDeadlineExceeded)
TANDEM_STATUS_FACTORY(Internal, kInternal)
TANDEM_STATUS_FACTORY(Unauthenticated, kUnauthenticated)
TANDEM_STATUS_FACTORY(PermissionDenied, kPermissionDenied)
TANDEM_STATUS_FACTORY(ResourceExhausted, kResourceExhausted)
TANDEM_STATUS_FACTORY(Aborted, kAborted)
TANDEM_STATUS_FACTORY(DataLoss, kDataLoss)
TANDEM_STATUS_FACTORY(Unimplemented, kUnimplemented)
TANDEM_STATUS_FACTORY(Cancelled, kCancelled)
#undef TANDEM_STATUS_FACTORY

}  // namespace tandem
