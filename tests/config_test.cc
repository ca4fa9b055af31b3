#include "common/config.h"

#include <algorithm>

#include <gtest/gtest.h>

#include "common/grpc_util.h"
#include "test_util.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;

// A small option set like a daemon's.
struct Fixture {
  std::string address = "0.0.0.0:7400";
  std::string level = "info";
  int64_t workers = 4;
  double ratio = 0.5;
  bool verbose = false;
  milliseconds interval{1000};
  uint64_t partition = 4ull << 20;
  std::string name = "default";
  TlsConfig tls;
  OptionSet options{"tandem-test", "a test program"};

  Fixture() {
    options.EnableConfigFile();
    options.Address("listen_address", &address, "where to listen");
    options.Choice("log.level", &level, {"debug", "info", "warn"}, "log level");
    options.Int("rendezvous.min_workers", &workers, "fewest workers", 1, 4096);
    options.Double("ratio", &ratio, "a ratio", 0.0, 1.0);
    options.Bool("verbose", &verbose, "say more");
    options.Duration("heartbeat.interval", &interval, "heartbeat period", milliseconds(10), milliseconds(60000));
    options.Bytes("partition_size", &partition, "partition size", 4096, 1ull << 30);
    options.String("name", &name, "a name");
    DeclareTlsOptions(options, &tls);
  }

  Result<OptionSet::Outcome> Parse(std::vector<std::string> args, std::string* out = nullptr) {
    std::vector<const char*> argv = {"tandem-test"};
    for (const auto& a : args) argv.push_back(a.c_str());
    std::string sink;
    return options.Parse(static_cast<int>(argv.size()), argv.data(), out != nullptr ? out : &sink);
  }
};

TEST(ConfigTest, DefaultsStandWhenNothingIsGiven) {
  Fixture f;
  ASSERT_TRUE(f.Parse({}).ok());
  EXPECT_EQ(f.address, "0.0.0.0:7400");
  EXPECT_EQ(f.workers, 4);
}

TEST(ConfigTest, FileOverridesDefaultsAndFlagsOverrideTheFile) {
  Fixture f;
  testing::TempDir dir;
  const std::string file = dir.File("c.yaml",
                                    "listen_address: 127.0.0.1:9000\n"
                                    "log:\n  level: debug\n"
                                    "rendezvous:\n  min_workers: 8\n"
                                    "heartbeat:\n  interval: 250ms\n"
                                    "partition_size: 8MiB\n");
  // The flag comes before --config on the command line and still wins.
  auto r = f.Parse({"--rendezvous-min-workers", "16", "--config", file, "--verbose"});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(f.address, "127.0.0.1:9000");    // file
  EXPECT_EQ(f.level, "debug");               // file
  EXPECT_EQ(f.workers, 16);                  // flag over file
  EXPECT_EQ(f.interval, milliseconds(250));  // file
  EXPECT_EQ(f.partition, 8ull << 20);        // file
  EXPECT_TRUE(f.verbose);                    // flag
  EXPECT_EQ(f.name, "default");              // default
}

TEST(ConfigTest, FlagsTakeEqualsOrTheNextArgumentAndTheLastOneWins) {
  Fixture f;
  ASSERT_TRUE(f.Parse({"--name=a", "--name", "b", "--verbose=false", "--ratio=0.25"}).ok());
  EXPECT_EQ(f.name, "b");
  EXPECT_FALSE(f.verbose);
  EXPECT_DOUBLE_EQ(f.ratio, 0.25);
}

TEST(ConfigTest, UnknownKeyNamesTheKeyTheLineAndAGuess) {
  Fixture f;
  const Status s = f.options.ApplyYaml("name: x\nrendezvous:\n  min_worker: 3\n", "job.yaml");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "job.yaml:3:3: unknown key 'rendezvous.min_worker' (did you mean 'rendezvous.min_workers'?)");
}

TEST(ConfigTest, UnknownSectionIsAnError) {
  Fixture f;
  const Status s = f.options.ApplyYaml("telemetry:\n  port: 1\n", "job.yaml");
  EXPECT_EQ(s.message(), "job.yaml:1:1: unknown section 'telemetry'");
}

TEST(ConfigTest, BadValuesSayWhatIsAccepted) {
  struct Case {
    std::string yaml;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"heartbeat:\n  interval: fast\n",
       "c.yaml:2:3: heartbeat.interval: expected a duration with a unit (ms, s, m or h), such as 500ms, 3s or 1.5m; "
       "got 'fast'"},
      {"heartbeat:\n  interval: 5ms\n", "c.yaml:2:3: heartbeat.interval: 5ms is out of range: accepted 10ms..1m"},
      {"rendezvous:\n  min_workers: 0\n", "c.yaml:2:3: rendezvous.min_workers: 0 is out of range: accepted 1..4096"},
      {"rendezvous:\n  min_workers: two\n", "c.yaml:2:3: rendezvous.min_workers: expected a whole number, got 'two'"},
      {"log:\n  level: loud\n", "c.yaml:2:3: log.level: expected one of debug|info|warn, got 'loud'"},
      {"verbose: maybe\n", "c.yaml:1:1: verbose: expected true or false, got 'maybe'"},
      {"ratio: 2\n", "c.yaml:1:1: ratio: 2 is out of range: accepted 0..1"},
      {"partition_size: 4 parsecs\n",
       "c.yaml:1:1: partition_size: expected a size in bytes, optionally with a unit (KiB, MiB, GiB, KB, MB, GB), "
       "such as 4MiB; got '4 parsecs'"},
      {"listen_address: localhost\n",
       "c.yaml:1:1: listen_address: expected HOST:PORT (such as 0.0.0.0:7400 or [::1]:7400), got 'localhost': no "
       "':PORT'"},
      {"listen_address: 1.2.3.4:70000\n",
       "c.yaml:1:1: listen_address: expected HOST:PORT (such as 0.0.0.0:7400 or [::1]:7400), got '1.2.3.4:70000': "
       "the port must be 0..65535"},
      {"name:\n", "c.yaml:1:1: 'name' has no value"},
      {"name: [a, b]\n", "c.yaml:1:1: 'name' must be a single value, not a list"},
      {"- a\n- b\n", "c.yaml:1:1: the configuration must be a map of keys to values"},
  };
  for (const auto& c : cases) {
    Fixture f;
    const Status s = f.options.ApplyYaml(c.yaml, "c.yaml");
    EXPECT_FALSE(s.ok()) << c.yaml;
    EXPECT_EQ(s.message(), c.message) << c.yaml;
  }
}

TEST(ConfigTest, BadValuesLeaveTheTargetUntouched) {
  Fixture f;
  EXPECT_FALSE(f.options.ApplyYaml("rendezvous:\n  min_workers: 99999\n", "c.yaml").ok());
  EXPECT_EQ(f.workers, 4);
}

TEST(ConfigTest, BrokenYamlIsReportedWithItsLine) {
  Fixture f;
  const Status s = f.options.ApplyYaml("name: a\n  bad: [\n", "c.yaml");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message().rfind("c.yaml:2:", 0), 0u) << s.message();
  EXPECT_NE(s.message().find("not valid YAML"), std::string::npos);
}

TEST(ConfigTest, EmptyFileSetsNothing) {
  Fixture f;
  EXPECT_TRUE(f.options.ApplyYaml("", "c.yaml").ok());
  EXPECT_TRUE(f.options.ApplyYaml("# only a comment\n", "c.yaml").ok());
}

TEST(ConfigTest, UnknownFlagSuggestsTheClosestOne) {
  Fixture f;
  auto r = f.Parse({"--listen-adress", "1.2.3.4:5"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            "unknown flag --listen-adress (did you mean --listen-address?) (run tandem-test --help to list the flags)");
}

TEST(ConfigTest, FlagErrorsNameTheFlag) {
  Fixture f;
  auto r = f.Parse({"--heartbeat-interval", "never"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().rfind("--heartbeat-interval: expected a duration", 0), 0u) << r.status().message();
  auto missing = f.Parse({"--name"});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(), "--name needs a value (TEXT)");
  auto stray = f.Parse({"extra"});
  ASSERT_FALSE(stray.ok());
  EXPECT_EQ(stray.status().message(), "unexpected argument 'extra' (run tandem-test --help)");
}

TEST(ConfigTest, MissingConfigFileIsNotFound) {
  Fixture f;
  auto r = f.Parse({"--config", "/nonexistent/tandem.yaml"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("/nonexistent/tandem.yaml"), std::string::npos);
}

TEST(ConfigTest, ChecksTieOptionsTogether) {
  Fixture f;
  auto r = f.Parse({"--tls-cert-file", "/x.pem"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "tls.cert_file and tls.key_file must be set together (got only tls.cert_file)");
  Fixture g;
  auto m = g.Parse({"--tls-require-client-cert"});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("tls.require_client_cert needs"), std::string::npos);
}

TEST(ConfigTest, HelpListsEveryFlagWithItsKeyAndDefault) {
  Fixture f;
  std::string out;
  auto r = f.Parse({"--help"}, &out);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, OptionSet::Outcome::kExit);
  EXPECT_NE(out.find("--listen-address HOST:PORT"), std::string::npos) << out;
  EXPECT_NE(out.find("[listen_address] (default 0.0.0.0:7400)"), std::string::npos) << out;
  EXPECT_NE(out.find("--heartbeat-interval DURATION"), std::string::npos) << out;
  EXPECT_NE(out.find("[heartbeat.interval] (default 1s)"), std::string::npos) << out;
  EXPECT_NE(out.find("--config FILE"), std::string::npos);
  std::string version;
  ASSERT_TRUE(f.Parse({"--version"}, &version).ok());
  EXPECT_EQ(version.rfind("tandem-test 0.", 0), 0u) << version;
}

TEST(ConfigTest, CheckConfigPrintsYamlThatLoadsBackToTheSameValues) {
  Fixture f;
  std::string out;
  auto r = f.Parse(
      {"--rendezvous-min-workers", "12", "--heartbeat-interval", "1.5s", "--name", "with: colon", "--check-config"},
      &out);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, OptionSet::Outcome::kExit);
  Fixture g;
  ASSERT_TRUE(g.options.ApplyYaml(out, "printed").ok()) << out;
  EXPECT_EQ(g.workers, 12);
  EXPECT_EQ(g.interval, milliseconds(1500));
  EXPECT_EQ(g.name, "with: colon");
  EXPECT_EQ(g.partition, f.partition);
  EXPECT_EQ(g.options.EffectiveYaml(), f.options.EffectiveYaml());
}

TEST(ConfigTest, FlagsGiveAnotherProcessTheSameValues) {
  Fixture f;
  ASSERT_TRUE(f.Parse({"--rendezvous-min-workers", "12", "--ratio", "0.1", "--verbose", "--heartbeat-interval", "1.5s",
                       "--partition-size", "12KiB", "--name", ""})
                  .ok());
  const std::vector<std::string> flags = f.options.Flags("");
  // The empty name is left out; the Bool is one argument.
  EXPECT_EQ(std::count(flags.begin(), flags.end(), "--name"), 0);
  EXPECT_EQ(std::count(flags.begin(), flags.end(), "--verbose=true"), 1);
  Fixture g;
  g.name = "not the default";
  g.verbose = false;
  ASSERT_TRUE(g.Parse(flags).ok());
  EXPECT_EQ(g.workers, 12);
  EXPECT_EQ(g.ratio, 0.1);  // the shortest text that reads back as the same double
  EXPECT_TRUE(g.verbose);
  EXPECT_EQ(g.interval, milliseconds(1500));
  EXPECT_EQ(g.partition, 12u * 1024);
  EXPECT_EQ(g.name, "not the default");  // an empty value is not handed over
  EXPECT_EQ(g.address, f.address);
  EXPECT_EQ(g.level, f.level);
  // Only the keys under a prefix.
  for (const auto& flag : f.options.Flags("heartbeat.")) {
    EXPECT_TRUE(flag == "--heartbeat-interval" || flag == "1500ms") << flag;
  }
}

TEST(ConfigTest, PositionalArguments) {
  std::string address;
  OptionSet options("tool", "t");
  options.Positional("ADDRESS", &address, "where", true);
  const char* with[] = {"tool", "1.2.3.4:5"};
  std::string out;
  ASSERT_TRUE(options.Parse(2, with, &out).ok());
  EXPECT_EQ(address, "1.2.3.4:5");
  const char* without[] = {"tool"};
  auto r = options.Parse(1, without, &out);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "missing ADDRESS (where); run tool --help");
}

TEST(ValueParsersTest, Durations) {
  EXPECT_EQ(*ParseDuration("500ms"), milliseconds(500));
  EXPECT_EQ(*ParseDuration("3s"), milliseconds(3000));
  EXPECT_EQ(*ParseDuration("1.5m"), milliseconds(90000));
  EXPECT_EQ(*ParseDuration("2h"), milliseconds(7200000));
  EXPECT_FALSE(ParseDuration("3").ok());  // a unit is required
  EXPECT_FALSE(ParseDuration("-1s").ok());
  EXPECT_FALSE(ParseDuration("s").ok());
  EXPECT_FALSE(ParseDuration("1e400s").ok());
  EXPECT_EQ(FormatDuration(milliseconds(90000)), "90s");
  EXPECT_EQ(FormatDuration(milliseconds(120000)), "2m");
  EXPECT_EQ(FormatDuration(milliseconds(1500)), "1500ms");
}

TEST(ValueParsersTest, Bytes) {
  EXPECT_EQ(*ParseBytes("4096"), 4096u);
  EXPECT_EQ(*ParseBytes("4KiB"), 4096u);
  EXPECT_EQ(*ParseBytes("64MiB"), 64ull << 20);
  EXPECT_EQ(*ParseBytes("1GB"), 1000000000ull);
  EXPECT_EQ(*ParseBytes("1.5KiB"), 1536u);
  EXPECT_FALSE(ParseBytes("0.3B").ok());  // not a whole number of bytes
  EXPECT_FALSE(ParseBytes("-4KiB").ok());
  EXPECT_FALSE(ParseBytes("99999999999TiB").ok());
  EXPECT_EQ(FormatBytes(4ull << 20), "4MiB");
  EXPECT_EQ(FormatBytes(1000), "1000");
}

TEST(ValueParsersTest, HostPort) {
  auto v4 = ParseHostPort("127.0.0.1:7400");
  ASSERT_TRUE(v4.ok());
  EXPECT_EQ(v4->host, "127.0.0.1");
  EXPECT_EQ(v4->port, 7400);
  auto v6 = ParseHostPort("[::1]:0");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 0);
  EXPECT_TRUE(ParseHostPort("tandem-coordinator.default.svc:7400").ok());
  EXPECT_FALSE(ParseHostPort("::1:80").ok());
  EXPECT_FALSE(ParseHostPort(":80").ok());
  EXPECT_FALSE(ParseHostPort("host:").ok());
  EXPECT_FALSE(ParseHostPort("ho st:80").ok());
}

}  // namespace
}  // namespace tandem
