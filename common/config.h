// Configuration from one declaration: a YAML file and command-line flags.
//
// A program declares its options once, each bound to a field of its own config
// struct. The same declaration drives the YAML keys, the flags, `--help`, the
// validation messages and `--check-config` (which prints the effective
// configuration). Precedence: built-in default < YAML file (--config) < flags.
//
// Keys are YAML paths with dots for nesting ("tls.cert_file" is `cert_file`
// inside the `tls` map); the flag for a key is "--" + the key with '.' and '_'
// written as '-' ("--tls-cert-file"). An unknown key or flag, a value of the
// wrong form or out of range, and a key given no value are errors that name the
// key (and, in files, the line) and say what is accepted.
//
// Thread safety: not thread-safe; build and parse on one thread at start-up.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem {

// Parsers shared by flags, YAML and other inputs. Each error message says what
// form is accepted.
Result<std::chrono::milliseconds> ParseDuration(std::string_view text);  // "500ms", "3s", "1.5m", "2h"
Result<uint64_t> ParseBytes(std::string_view text);                      // "4096", "4KiB", "64MiB", "1GB"
Result<bool> ParseBool(std::string_view text);                           // true/false, yes/no, on/off, 1/0
std::string FormatDuration(std::chrono::milliseconds d);
std::string FormatBytes(uint64_t bytes);

// "host:port", "[v6]:port"; the port is 0..65535 (0: pick a free port).
struct HostPort {
  std::string host;
  int port = 0;
};
Result<HostPort> ParseHostPort(std::string_view text);

class OptionSet {
 public:
  // `program` is the name shown in usage lines and errors; `summary` is one
  // sentence on what the program does.
  OptionSet(std::string program, std::string summary);

  // Declarations. `target` must outlive the OptionSet; its current value is the
  // default. Declaring two options with the same key or flag is a programming
  // error and aborts.
  void String(const std::string& key, std::string* target, const std::string& help);
  void Bool(const std::string& key, bool* target, const std::string& help);
  void Int(const std::string& key, int64_t* target, const std::string& help, int64_t min, int64_t max);
  void Double(const std::string& key, double* target, const std::string& help, double min, double max);
  void Duration(const std::string& key, std::chrono::milliseconds* target, const std::string& help,
                std::chrono::milliseconds min, std::chrono::milliseconds max);
  void Bytes(const std::string& key, uint64_t* target, const std::string& help, uint64_t min, uint64_t max);
  void Choice(const std::string& key, std::string* target, std::vector<std::string> choices, const std::string& help);
  // host:port; `allow_empty` lets the empty string mean "off".
  void Address(const std::string& key, std::string* target, const std::string& help, bool allow_empty = false);
  // A positional argument (CLI commands only; not a YAML key).
  void Positional(const std::string& name, std::string* target, const std::string& help, bool required);

  // Adds --config FILE (and --check-config) to this set.
  void EnableConfigFile();
  // A check run after all values are applied, for rules that tie options together.
  void AddCheck(std::function<Status()> check);
  // Extra text printed at the end of --help.
  void SetEpilog(std::string text) { epilog_ = std::move(text); }

  // Applies a YAML document; `origin` (a file name) prefixes error messages.
  Status ApplyYaml(std::string_view yaml_text, std::string_view origin);
  Status ApplyYamlFile(const std::string& path);
  // Applies one value as if given for `key` (used by tests and launchers).
  Status Set(std::string_view key, std::string_view value);

  enum class Outcome { kRun, kExit };
  // Parses argv[1..argc): handles --help, --version and --check-config
  // (prints to `out` and returns kExit), reads --config first and then applies
  // the other flags in order, then runs the checks.
  Result<Outcome> Parse(int argc, const char* const* argv, std::string* out);

  std::string Help() const;
  // The flags that give the options whose keys start with `key_prefix` their
  // current values, in declaration order: "--flag", "value" pairs, a Bool as
  // one "--flag=true" or "--flag=false"; an option whose value is empty is
  // left out (its default is empty). A launcher hands a config struct to a
  // child process with these, from the same declaration the child parses.
  std::vector<std::string> Flags(std::string_view key_prefix) const;
  // The effective configuration as a YAML document (what --check-config prints).
  std::string EffectiveYaml() const;
  const std::string& program() const { return program_; }

 private:
  struct Option {
    std::string key;
    std::string flag;        // without the leading "--"
    std::string value_name;  // HOST:PORT, DURATION, …
    std::string help;
    bool is_bool = false;
    std::function<Status(std::string_view)> set;
    std::function<std::string()> get;
  };
  struct PositionalArg {
    std::string name;
    std::string* target;
    std::string help;
    bool required;
  };

  void Add(Option option);
  const Option* FindByKey(std::string_view key) const;
  const Option* FindByFlag(std::string_view flag) const;
  std::string Suggest(std::string_view name, bool flags) const;

  std::string program_;
  std::string summary_;
  std::string epilog_;
  std::vector<Option> options_;
  std::vector<PositionalArg> positionals_;
  std::vector<std::function<Status()>> checks_;
  bool config_file_enabled_ = false;
};

}  // namespace tandem
