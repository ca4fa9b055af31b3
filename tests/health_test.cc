// The health service and its client, in one process with real gRPC
// on loopback.
#include "common/health.h"

#include <thread>

#include <gtest/gtest.h>

#include "common/grpc_util.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;

std::unique_ptr<GrpcServer> StartServer() {
  GrpcServerConfig config;
  config.listen_address = "127.0.0.1:0";
  auto server = GrpcServer::Start(config, {});
  EXPECT_TRUE(server.ok()) << server.status().ToString();
  return server.ok() ? std::move(*server) : nullptr;
}

TEST(HealthTest, CheckReportsEachServiceAndUnknownOnes) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto channel = MakeChannel(server->address(), TlsConfig{});
  ASSERT_TRUE(channel.ok());
  EXPECT_EQ(*CheckHealth(*channel, "", milliseconds(5000)), "SERVING");
  EXPECT_EQ(*CheckHealth(*channel, "no.such.Service", milliseconds(5000)), "SERVICE_UNKNOWN");
  server->SetHealth(kReadyService, false);
  EXPECT_EQ(*CheckHealth(*channel, kReadyService, milliseconds(5000)), "NOT_SERVING");
  server->SetHealth(kReadyService, true);
  EXPECT_EQ(*CheckHealth(*channel, kReadyService, milliseconds(5000)), "SERVING");
}

TEST(HealthTest, WatchStreamsChangesAndEndsAtShutdown) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  server->SetHealth(kReadyService, false);
  auto channel = MakeChannel(server->address(), TlsConfig{});
  ASSERT_TRUE(channel.ok());
  auto stub = grpc::health::v1::Health::NewStub(*channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(kReadyService);
  auto reader = stub->Watch(&ctx, request);
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  server->SetHealth(kReadyService, true);
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  std::thread stopper([&] { server->Shutdown(milliseconds(2000)); });
  const bool got_final = reader->Read(&response);
  const auto final_status = response.status();
  while (reader->Read(&response)) {
  }
  const grpc::Status finished = reader->Finish();
  stopper.join();
  ASSERT_TRUE(got_final);
  EXPECT_EQ(final_status, grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_TRUE(finished.ok()) << finished.error_message();
}

TEST(HealthTest, UnreachableDaemonIsAnErrorNotAHang) {
  auto channel = MakeChannel("127.0.0.1:1", TlsConfig{});
  ASSERT_TRUE(channel.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto r = CheckHealth(*channel, "", milliseconds(500));
  EXPECT_FALSE(r.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

}  // namespace
}  // namespace tandem
