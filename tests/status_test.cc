#include "common/status.h"

#include <grpcpp/support/status.h>
#include <gtest/gtest.h>

namespace tandem {
namespace {

TEST(StatusTest, OkHasNoMessage) {
  const Status s(StatusCode::kOk, "ignored");
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, EveryCodeMapsOneToOneOntoGrpc) {
  const std::vector<std::pair<StatusCode, grpc::StatusCode>> pairs = {
      {StatusCode::kOk, grpc::StatusCode::OK},
      {StatusCode::kCancelled, grpc::StatusCode::CANCELLED},
      {StatusCode::kUnknown, grpc::StatusCode::UNKNOWN},
      {StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT},
      {StatusCode::kDeadlineExceeded, grpc::StatusCode::DEADLINE_EXCEEDED},
      {StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND},
      {StatusCode::kAlreadyExists, grpc::StatusCode::ALREADY_EXISTS},
      {StatusCode::kPermissionDenied, grpc::StatusCode::PERMISSION_DENIED},
      {StatusCode::kResourceExhausted, grpc::StatusCode::RESOURCE_EXHAUSTED},
      {StatusCode::kFailedPrecondition, grpc::StatusCode::FAILED_PRECONDITION},
      {StatusCode::kAborted, grpc::StatusCode::ABORTED},
      {StatusCode::kOutOfRange, grpc::StatusCode::OUT_OF_RANGE},
      {StatusCode::kUnimplemented, grpc::StatusCode::UNIMPLEMENTED},
      {StatusCode::kInternal, grpc::StatusCode::INTERNAL},
      {StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE},
      {StatusCode::kDataLoss, grpc::StatusCode::DATA_LOSS},
      {StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED},
  };
  ASSERT_EQ(pairs.size(), 17u);  // all of gRPC's codes
  for (const auto& [ours, theirs] : pairs) {
    const Status s(ours, "what went wrong");
    const grpc::Status g = s.ToGrpc();
    EXPECT_EQ(g.error_code(), theirs) << StatusCodeName(ours);
    EXPECT_EQ(g.error_message(), ours == StatusCode::kOk ? "" : "what went wrong");
    const Status back = Status::FromGrpc(grpc::Status(theirs, ours == StatusCode::kOk ? "" : "msg"));
    EXPECT_EQ(back.code(), ours) << StatusCodeName(ours);
  }
}

TEST(StatusTest, NamesMatchGrpcSpelling) {
  EXPECT_EQ(StatusCodeName(StatusCode::kInvalidArgument), "INVALID_ARGUMENT");
  EXPECT_EQ(StatusCodeName(StatusCode::kUnauthenticated), "UNAUTHENTICATED");
  EXPECT_EQ(InvalidArgument("key '{}' is bad", "x").ToString(), "INVALID_ARGUMENT: key 'x' is bad");
}

TEST(StatusTest, WithContextPrefixesTheMessageAndKeepsTheCode) {
  const Status s = NotFound("no such file").WithContext("tls.ca_file");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "tls.ca_file: no such file");
  EXPECT_TRUE(Status::Ok().WithContext("x").ok());
}

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgument("{} is odd", x);
  return x / 2;
}

Result<int> Quarter(int x) {
  TANDEM_ASSIGN_OR_RETURN(const int half, Half(x));
  TANDEM_ASSIGN_OR_RETURN(const int quarter, Half(half));
  return quarter;
}

TEST(ResultTest, CarriesAValueOrAnError) {
  EXPECT_EQ(*Quarter(8), 2);
  const auto r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "3 is odd");
  // A Result built from an OK status without a value is a bug, reported as INTERNAL.
  const Result<int> broken(Status::Ok());
  EXPECT_EQ(broken.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace tandem
