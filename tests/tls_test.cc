// TLS and mutual TLS between real processes, with certificates made by
// openssl for the test: a client without a valid certificate is refused, and
// a member reaches a coordinator that requires client certificates, and
// hybrid training runs with every gRPC channel (coordinator, servers) on
// mutual TLS.
#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "cli/launcher.h"
#include "launch_util.h"
#include "test_util.h"
#include "worker/model/model.h"
#include "worker/runtime/trainer.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;
using testing::BinDir;
using testing::RunCommand;

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string d = dir_.path();
    // A CA, and server and client certificates it signs (P-256 keys: fast to make).
    const std::string script =
        "set -e; cd " + d +
        "\n"
        "key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out $1.key 2>/dev/null; }\n"
        "key ca; openssl req -x509 -new -key ca.key -out ca.pem -days 1 -subj '/CN=Tandem test CA'\n"
        "for n in server client; do key $n; openssl req -new -key $n.key -out $n.csr -subj \"/CN=$n\";\n"
        "  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > $n.ext;\n"
        "  openssl x509 -req -in $n.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $n.pem -days 1 "
        "-extfile $n.ext 2>/dev/null; done\n"
        // A CA the servers do not trust, for a client certificate they must refuse.
        "key rogue; openssl req -x509 -new -key rogue.key -out rogue.pem -days 1 -subj '/CN=rogue'\n";
    const auto r = RunCommand({"/bin/sh", "-c", script});
    ASSERT_TRUE(r.exit.success()) << r.output;
  }

  std::vector<std::string> ServerTls() const {
    const std::string d = dir_.path();
    return {"--tls-cert-file", d + "/server.pem", "--tls-key-file",           d + "/server.key",
            "--tls-ca-file",   d + "/ca.pem",     "--tls-require-client-cert"};
  }

  Result<cli::LaunchedDaemon> Start(const std::string& binary, std::vector<std::string> args) {
    return testing::StartDaemon(binary, binary, dir_.path(), std::move(args));
  }

  testing::CommandResult Health(const std::string& address, std::vector<std::string> tls,
                                const std::string& service = "") {
    std::vector<std::string> argv = {BinDir() + "/tandem", "health", address, "--timeout", "3s"};
    if (!service.empty()) argv.insert(argv.end(), {"--service", service});
    argv.insert(argv.end(), tls.begin(), tls.end());
    return RunCommand(argv);
  }

  testing::TempDir dir_;
};

TEST_F(TlsTest, MutualTlsAdmitsOnlyClientsWithAValidCertificate) {
  const std::string d = dir_.path();
  auto coordinator = Start("tandem-coordinator", ServerTls());
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  EXPECT_NE(testing::ReadFile(coordinator->log_file).find("(mutual TLS)"), std::string::npos);
  const std::string address = coordinator->ready.grpc_address;

  const auto good = Health(address, {"--tls-ca-file", d + "/ca.pem", "--tls-cert-file", d + "/client.pem",
                                     "--tls-key-file", d + "/client.key"});
  EXPECT_TRUE(good.exit.success()) << good.output;
  EXPECT_NE(good.output.find("SERVING"), std::string::npos);

  const auto no_cert = Health(address, {"--tls-ca-file", d + "/ca.pem"});
  EXPECT_EQ(no_cert.exit.ToString(), "exit 1") << no_cert.output;
  EXPECT_NE(no_cert.output.find("unreachable"), std::string::npos) << no_cert.output;

  const auto rogue = Health(address, {"--tls-ca-file", d + "/ca.pem", "--tls-cert-file", d + "/rogue.pem",
                                      "--tls-key-file", d + "/rogue.key"});
  EXPECT_EQ(rogue.exit.ToString(), "exit 1") << rogue.output;

  const auto plaintext = Health(address, {});
  EXPECT_EQ(plaintext.exit.ToString(), "exit 1") << plaintext.output;

  // A worker with the same CA and its own certificate reaches the coordinator and becomes ready.
  std::vector<std::string> worker_args = ServerTls();
  worker_args.insert(worker_args.end(), {"--tls-server-name", "localhost", "--coordinator-address", address});
  auto worker = Start("tandem-worker", worker_args);
  ASSERT_TRUE(worker.ok()) << worker.status().ToString();
  testing::CommandResult ready;
  for (int i = 0; i < 100; ++i) {
    ready = Health(
        worker->ready.grpc_address,
        {"--tls-ca-file", d + "/ca.pem", "--tls-cert-file", d + "/client.pem", "--tls-key-file", d + "/client.key"},
        "tandem.ready");
    if (ready.exit.success()) break;
    std::this_thread::sleep_for(milliseconds(50));
  }
  EXPECT_TRUE(ready.exit.success()) << ready.output << testing::ReadFile(worker->log_file);

  EXPECT_TRUE(worker->process->Stop(milliseconds(5000)).success());
  EXPECT_TRUE(coordinator->process->Stop(milliseconds(5000)).success());
}

TEST_F(TlsTest, HybridTrainingRunsWithEveryChannelOnMutualTls) {
  const std::string d = dir_.path();
  worker::TrainConfig train;
  train.steps = 3;
  train.mode = "hybrid";
  train.layers = 1;
  train.d_model = 16;
  train.heads = 2;
  train.context = 8;
  train.global_batch = 2;
  train.progress_file = d + "/progress.jsonl";
  train.epoch_wait = milliseconds(20000);
  train.step_timeout = milliseconds(20000);
  auto model = worker::ModelConfigOf(train);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  uint64_t parameters = 0;
  for (const auto& t : model::TensorLayout(*model)) parameters += t.size;

  std::vector<std::string> coordinator_args = ServerTls();
  coordinator_args.insert(coordinator_args.end(),
                          {"--job-min-workers", "1", "--job-min-servers", "1", "--job-last-call-window", "0s",
                           "--job-parameter-count", std::to_string(parameters), "--job-partition-size", "4KiB"});
  auto coordinator = Start("tandem-coordinator", coordinator_args);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  // Members serve with the server certificate and use it as their client certificate.
  std::vector<std::string> member = ServerTls();
  member.insert(member.end(),
                {"--tls-server-name", "localhost", "--coordinator-address", coordinator->ready.grpc_address});
  std::vector<std::string> server_args = member;
  server_args.insert(server_args.end(), {"--node-id", "node-s"});
  auto server = testing::StartDaemon("tandem-server", "server", d, server_args);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  std::vector<std::string> worker_args = member;
  worker_args.insert(worker_args.end(), {"--node-id", "node-w"});
  for (const auto& f : worker::TrainFlags(train)) worker_args.push_back(f);
  auto worker = testing::StartDaemon("tandem-worker", "worker", d, worker_args);
  ASSERT_TRUE(worker.ok()) << worker.status().ToString();

  // A line per step, then the one that says training finished.
  int lines = 0;
  bool finished = false;
  for (int i = 0; i < 400 && !finished; ++i) {
    std::this_thread::sleep_for(milliseconds(50));
    std::ifstream in(train.progress_file);
    lines = 0;
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"finished\":true") != std::string::npos) {
        finished = true;
      } else {
        ++lines;
      }
    }
  }
  EXPECT_TRUE(finished) << testing::ReadFile(worker->log_file) << testing::ReadFile(server->log_file);
  EXPECT_EQ(lines, 3) << testing::ReadFile(worker->log_file) << testing::ReadFile(server->log_file);
  EXPECT_TRUE(worker->process->Stop(milliseconds(5000)).success());
  EXPECT_TRUE(server->process->Stop(milliseconds(5000)).success());
  EXPECT_TRUE(coordinator->process->Stop(milliseconds(5000)).success());
}

TEST_F(TlsTest, MissingCertificateFileIsAStartupErrorNamingIt) {
  const std::string d = dir_.path();
  const auto r = RunCommand({BinDir() + "/tandem-coordinator", "--listen-address", "127.0.0.1:0", "--metrics-address",
                             "127.0.0.1:0", "--tls-cert-file", d + "/absent.pem", "--tls-key-file", d + "/server.key"});
  EXPECT_EQ(r.exit.ToString(), "exit 1") << r.output;
  EXPECT_NE(r.output.find("tls.cert_file: cannot read '" + d + "/absent.pem'"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace tandem
