#include "common/grpc_util.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>

#include <spdlog/spdlog.h>

namespace tandem {

void DeclareTlsOptions(OptionSet& options, TlsConfig* tls, bool client_only) {
  options.String("tls.cert_file", &tls->cert_file,
                 client_only ? "PEM client certificate, for servers that require one (mutual TLS)"
                             : "PEM certificate chain of this process (set to serve TLS; also presented as a client "
                               "certificate, so it needs clientAuth too under mutual TLS)");
  options.String("tls.key_file", &tls->key_file, "PEM private key for tls.cert_file");
  options.String("tls.ca_file", &tls->ca_file, "PEM CA bundle that peers' certificates must chain to");
  if (!client_only) {
    options.Bool("tls.require_client_cert", &tls->require_client_cert,
                 "mutual TLS: refuse clients without a certificate signed by tls.ca_file");
  }
  options.String("tls.server_name", &tls->server_name,
                 "name to verify in servers' certificates instead of the address's host");
  options.AddCheck([tls]() -> Status {
    if (tls->cert_file.empty() != tls->key_file.empty()) {
      return InvalidArgument("tls.cert_file and tls.key_file must be set together (got only {})",
                             tls->cert_file.empty() ? "tls.key_file" : "tls.cert_file");
    }
    if (tls->require_client_cert && (tls->ca_file.empty() || tls->cert_file.empty())) {
      return InvalidArgument(
          "tls.require_client_cert needs tls.cert_file, tls.key_file and tls.ca_file (the CA that signs client "
          "certificates)");
    }
    return Status::Ok();
  });
}

Result<std::string> ReadFileContents(const std::string& path, std::string_view purpose) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("{}: cannot read '{}': {}", purpose, path, std::strerror(errno));
  std::stringstream buf;
  buf << in.rdbuf();
  if (buf.str().empty()) return InvalidArgument("{}: '{}' is empty", purpose, path);
  return buf.str();
}

Result<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsConfig& tls) {
  if (!tls.ServerEnabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(tls.require_client_cert
                                                ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                                : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  TANDEM_ASSIGN_OR_RETURN(pair.cert_chain, ReadFileContents(tls.cert_file, "tls.cert_file"));
  TANDEM_ASSIGN_OR_RETURN(pair.private_key, ReadFileContents(tls.key_file, "tls.key_file"));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!tls.ca_file.empty()) {
    TANDEM_ASSIGN_OR_RETURN(options.pem_root_certs, ReadFileContents(tls.ca_file, "tls.ca_file"));
  }
  return grpc::SslServerCredentials(options);
}

Result<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsConfig& tls) {
  if (!tls.ClientEnabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  if (!tls.ca_file.empty()) {
    TANDEM_ASSIGN_OR_RETURN(options.pem_root_certs, ReadFileContents(tls.ca_file, "tls.ca_file"));
  }
  if (!tls.cert_file.empty()) {
    TANDEM_ASSIGN_OR_RETURN(options.pem_cert_chain, ReadFileContents(tls.cert_file, "tls.cert_file"));
    TANDEM_ASSIGN_OR_RETURN(options.pem_private_key, ReadFileContents(tls.key_file, "tls.key_file"));
  }
  return grpc::SslCredentials(options);
}

Result<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address, const TlsConfig& tls,
                                                   uint64_t max_message_bytes) {
  TANDEM_RETURN_IF_ERROR(ParseHostPort(address).status().WithContext("address"));
  TANDEM_ASSIGN_OR_RETURN(auto creds, MakeChannelCredentials(tls));
  grpc::ChannelArguments args;
  const int limit = static_cast<int>(std::min<uint64_t>(max_message_bytes, INT32_MAX));
  args.SetMaxReceiveMessageSize(limit);
  args.SetMaxSendMessageSize(limit);
  if (!tls.server_name.empty()) args.SetSslTargetNameOverride(tls.server_name);
  // Reconnect quickly to a restarted peer: control-plane peers (the
  // coordinator above all) come back within seconds, and gRPC's default
  // backoff would wait up to two minutes.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(address, creds, args);
}

Result<std::unique_ptr<GrpcServer>> GrpcServer::Start(const GrpcServerConfig& config,
                                                      const std::vector<ServiceEntry>& services) {
  auto hp = ParseHostPort(config.listen_address);
  if (!hp.ok()) return hp.status().WithContext("listen_address");
  TANDEM_ASSIGN_OR_RETURN(auto creds, MakeServerCredentials(config.tls));

  // Tandem serves its own grpc.health.v1.Health (common/health_service.h).
  grpc::EnableDefaultHealthCheckService(false);
  grpc::ServerBuilder builder;
  int port = 0;
  // No SO_REUSEPORT: a second daemon on the same port must fail, not silently share it.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(config.listen_address, creds, &port);
  const int limit = static_cast<int>(std::min<uint64_t>(config.max_message_bytes, INT32_MAX));
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  std::unique_ptr<GrpcServer> server(new GrpcServer());
  builder.RegisterService(&server->health_);
  for (const auto& entry : services) {
    builder.RegisterService(entry.service);
    server->service_names_.push_back(entry.name);
  }
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || port == 0) {
    return Unavailable("cannot serve gRPC on {}: the address is in use or not available on this host",
                       config.listen_address);
  }
  const bool v6 = hp->host.find(':') != std::string::npos;
  server->address_ = v6 ? fmt::format("[{}]:{}", hp->host, port) : fmt::format("{}:{}", hp->host, port);
  server->SetServing(true);
  return server;
}

GrpcServer::~GrpcServer() {
  Shutdown(std::chrono::milliseconds(0));
}

void GrpcServer::SetServing(bool serving) {
  health_.Set("", serving);
  for (const auto& name : service_names_) health_.Set(name, serving);
}

void GrpcServer::SetHealth(const std::string& service, bool serving) {
  health_.Set(service, serving);
}

void GrpcServer::Shutdown(std::chrono::milliseconds grace) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  // Every service reports NOT_SERVING from here on, so load balancers and
  // probes stop sending work while calls in flight finish.
  health_.Shutdown();
  server_->Shutdown(std::chrono::system_clock::now() + grace);
  server_->Wait();
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

}  // namespace tandem
