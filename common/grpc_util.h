// gRPC helpers: TLS and mutual TLS from the configuration, channels, and a
// server that always serves the standard gRPC health service.
//
// TLS (section `tls` of every daemon's configuration):
//   cert_file, key_file   this process's certificate chain and private key (PEM).
//                         Set both to serve TLS; as a client they are presented
//                         to servers that require client certificates.
//   ca_file               CA bundle (PEM) that peers' certificates must chain to:
//                         clients verify servers with it; servers verify clients
//                         with it when require_client_cert is on.
//   require_client_cert   mutual TLS: refuse clients without a valid certificate.
//   server_name           name to check in the server's certificate instead of
//                         the host of the address (clients only).
// With none of these set, traffic is plaintext (for loopback and trusted
// networks only; see docs/security.md).
//
// Thread safety: GrpcServer is thread-safe after Start(); the free functions are.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/config.h"
#include "common/health_service.h"
#include "common/status.h"

namespace tandem {

struct TlsConfig {
  std::string cert_file;
  std::string key_file;
  std::string ca_file;
  bool require_client_cert = false;
  std::string server_name;

  bool ServerEnabled() const { return !cert_file.empty(); }
  bool ClientEnabled() const { return !ca_file.empty() || !cert_file.empty(); }
};

// Declares the tls.* options above, and a check that they fit together.
// With `client_only` (command-line tools) the serving-side options are left out.
void DeclareTlsOptions(OptionSet& options, TlsConfig* tls, bool client_only = false);

Result<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsConfig& tls);
Result<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsConfig& tls);

// A channel to `address` (host:port) with the TLS settings and message limit.
Result<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address, const TlsConfig& tls,
                                                   uint64_t max_message_bytes = 64ull << 20);

// Reads a whole file; the error names the file and the purpose (e.g. "tls.ca_file").
Result<std::string> ReadFileContents(const std::string& path, std::string_view purpose);

struct GrpcServerConfig {
  std::string listen_address;  // host:port; port 0 picks a free port
  uint64_t max_message_bytes = 16ull << 20;
  TlsConfig tls;
};

// A started gRPC server with the standard health service (grpc.health.v1).
// The overall health ("") and each registered service report SERVING once
// Start() returns, until SetServing(false) or Shutdown().
class GrpcServer {
 public:
  struct ServiceEntry {
    std::string name;        // full name, e.g. "tandem.v1.Coordinator"; its health is reported too
    grpc::Service* service;  // must outlive the server
  };
  static Result<std::unique_ptr<GrpcServer>> Start(const GrpcServerConfig& config,
                                                   const std::vector<ServiceEntry>& services);
  ~GrpcServer();

  // host:port actually bound.
  const std::string& address() const { return address_; }
  // Sets the health of "" and of every registered service.
  void SetServing(bool serving);
  // Sets the health of one service name (it need not be a registered service).
  void SetHealth(const std::string& service, bool serving);
  // Reports NOT_SERVING, then stops accepting calls and cancels those still
  // running after `grace`. Idempotent.
  void Shutdown(std::chrono::milliseconds grace);

 private:
  GrpcServer() = default;
  HealthService health_;  // outlives server_ (declared first)
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::string> service_names_;
  std::string address_;
  bool shut_down_ = false;
};

// Compares secrets (join tokens) in time that does not depend on where they
// differ.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace tandem
