#include "common/config.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "tandem/config.h"

namespace tandem {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string ToLower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

// Parses a finite decimal number that may have a fraction ("1.5").
bool ParseNumber(std::string_view text, double* out) {
  if (text.empty()) return false;
  std::string buf(text);
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(buf.c_str(), &end);
  if (errno != 0 || end != buf.c_str() + buf.size() || !std::isfinite(v)) return false;
  // strtod accepts hex and "inf"; accept only plain decimals.
  for (char c : buf) {
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '+' || c == 'e' || c == 'E')) {
      return false;
    }
  }
  *out = v;
  return true;
}

bool ParseInt64(std::string_view text, int64_t* out) {
  if (text.empty()) return false;
  if (text.front() == '+') text.remove_prefix(1);
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && ptr == text.data() + text.size();
}

std::string FlagFor(const std::string& key) {
  std::string flag = key;
  std::replace(flag.begin(), flag.end(), '.', '-');
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string Location(std::string_view origin, const YAML::Mark& mark) {
  if (mark.is_null()) return std::string(origin);
  return fmt::format("{}:{}:{}", origin, mark.line + 1, mark.column + 1);
}

}  // namespace

// --- value parsers -----------------------------------------------------------

Result<std::chrono::milliseconds> ParseDuration(std::string_view text) {
  text = Trim(text);
  const auto bad = [&] {
    return InvalidArgument("expected a duration with a unit (ms, s, m or h), such as 500ms, 3s or 1.5m; got '{}'",
                           text);
  };
  size_t split = text.size();
  while (split > 0 && std::isalpha(static_cast<unsigned char>(text[split - 1]))) --split;
  const std::string unit = ToLower(text.substr(split));
  double number = 0;
  if (!ParseNumber(text.substr(0, split), &number) || number < 0) return bad();
  double ms = 0;
  if (unit == "ms") {
    ms = number;
  } else if (unit == "s") {
    ms = number * 1e3;
  } else if (unit == "m" || unit == "min") {
    ms = number * 60e3;
  } else if (unit == "h") {
    ms = number * 3600e3;
  } else {
    return bad();
  }
  if (ms > 1e15) return bad();
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(ms)));
}

Result<uint64_t> ParseBytes(std::string_view text) {
  text = Trim(text);
  const auto bad = [&] {
    return InvalidArgument(
        "expected a size in bytes, optionally with a unit (KiB, MiB, GiB, KB, MB, GB), such as 4MiB; got '{}'", text);
  };
  size_t split = text.size();
  while (split > 0 && std::isalpha(static_cast<unsigned char>(text[split - 1]))) --split;
  const std::string unit = ToLower(Trim(text.substr(split)));
  double number = 0;
  if (!ParseNumber(Trim(text.substr(0, split)), &number) || number < 0) return bad();
  static const std::pair<std::string_view, double> kUnits[] = {
      {"", 1},         {"b", 1},      {"k", 0x1p10},   {"kib", 0x1p10}, {"m", 0x1p20}, {"mib", 0x1p20}, {"g", 0x1p30},
      {"gib", 0x1p30}, {"t", 0x1p40}, {"tib", 0x1p40}, {"kb", 1e3},     {"mb", 1e6},   {"gb", 1e9},     {"tb", 1e12},
  };
  const auto it = std::find_if(std::begin(kUnits), std::end(kUnits), [&](const auto& u) { return u.first == unit; });
  if (it == std::end(kUnits)) return bad();
  const double scale = it->second;
  const double bytes = number * scale;
  if (bytes > 1.8e19 || bytes != std::floor(bytes)) return bad();
  return static_cast<uint64_t>(bytes);
}

Result<bool> ParseBool(std::string_view text) {
  const std::string v = ToLower(Trim(text));
  if (v == "true" || v == "yes" || v == "on" || v == "1") return true;
  if (v == "false" || v == "no" || v == "off" || v == "0") return false;
  return InvalidArgument("expected true or false, got '{}'", text);
}

std::string FormatDuration(std::chrono::milliseconds d) {
  const int64_t ms = d.count();
  if (ms != 0 && ms % 3600000 == 0) return fmt::format("{}h", ms / 3600000);
  if (ms != 0 && ms % 60000 == 0) return fmt::format("{}m", ms / 60000);
  if (ms != 0 && ms % 1000 == 0) return fmt::format("{}s", ms / 1000);
  return fmt::format("{}ms", ms);
}

std::string FormatBytes(uint64_t bytes) {
  constexpr uint64_t kKiB = 1024, kMiB = kKiB * 1024, kGiB = kMiB * 1024;
  if (bytes != 0 && bytes % kGiB == 0) return fmt::format("{}GiB", bytes / kGiB);
  if (bytes != 0 && bytes % kMiB == 0) return fmt::format("{}MiB", bytes / kMiB);
  if (bytes != 0 && bytes % kKiB == 0) return fmt::format("{}KiB", bytes / kKiB);
  return fmt::format("{}", bytes);
}

Result<HostPort> ParseHostPort(std::string_view text) {
  const auto bad = [&](std::string_view why) {
    return InvalidArgument("expected HOST:PORT (such as 0.0.0.0:7400 or [::1]:7400), got '{}': {}", text, why);
  };
  HostPort hp;
  std::string_view port_text;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == std::string_view::npos) return bad("no closing ']'");
    hp.host = std::string(text.substr(1, close - 1));
    if (close + 1 >= text.size() || text[close + 1] != ':') return bad("no ':PORT' after the address");
    port_text = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) return bad("no ':PORT'");
    hp.host = std::string(text.substr(0, colon));
    if (hp.host.find(':') != std::string::npos) return bad("write IPv6 addresses in brackets");
    port_text = text.substr(colon + 1);
  }
  if (hp.host.empty()) return bad("the host is empty");
  for (char c : hp.host) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' || c == '_')) {
      return bad("the host has characters that are not allowed");
    }
  }
  int64_t port = -1;
  if (!ParseInt64(port_text, &port) || port < 0 || port > 65535) return bad("the port must be 0..65535");
  hp.port = static_cast<int>(port);
  return hp;
}

// --- OptionSet -----------------------------------------------------------------

OptionSet::OptionSet(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

void OptionSet::Add(Option option) {
  if (FindByKey(option.key) != nullptr || FindByFlag(option.flag) != nullptr) {
    fmt::print(stderr, "{}: option '{}' declared twice\n", program_, option.key);
    std::abort();
  }
  options_.push_back(std::move(option));
}

const OptionSet::Option* OptionSet::FindByKey(std::string_view key) const {
  for (const auto& o : options_) {
    if (o.key == key) return &o;
  }
  return nullptr;
}

const OptionSet::Option* OptionSet::FindByFlag(std::string_view flag) const {
  for (const auto& o : options_) {
    if (o.flag == flag) return &o;
  }
  return nullptr;
}

std::string OptionSet::Suggest(std::string_view name, bool flags) const {
  std::string best;
  size_t best_distance = 3;  // suggest only close matches
  for (const auto& o : options_) {
    const std::string& candidate = flags ? o.flag : o.key;
    const size_t d = EditDistance(name, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  if (best.empty()) return "";
  return flags ? fmt::format(" (did you mean --{}?)", best) : fmt::format(" (did you mean '{}'?)", best);
}

void OptionSet::String(const std::string& key, std::string* target, const std::string& help) {
  Add({key, FlagFor(key), "TEXT", help, false,
       [target](std::string_view v) {
         *target = std::string(v);
         return Status::Ok();
       },
       [target] { return *target; }});
}

void OptionSet::Bool(const std::string& key, bool* target, const std::string& help) {
  Add({key, FlagFor(key), "BOOL", help, true,
       [target](std::string_view v) -> Status {
         auto b = ParseBool(v);
         if (!b.ok()) return b.status();
         *target = *b;
         return Status::Ok();
       },
       [target] { return std::string(*target ? "true" : "false"); }});
}

void OptionSet::Int(const std::string& key, int64_t* target, const std::string& help, int64_t min, int64_t max) {
  Add({key, FlagFor(key), "N", fmt::format("{} ({}..{})", help, min, max), false,
       [target, min, max](std::string_view v) -> Status {
         int64_t n = 0;
         if (!ParseInt64(Trim(v), &n)) return InvalidArgument("expected a whole number, got '{}'", v);
         if (n < min || n > max) return OutOfRange("{} is out of range: accepted {}..{}", n, min, max);
         *target = n;
         return Status::Ok();
       },
       [target] { return std::to_string(*target); }});
}

void OptionSet::Double(const std::string& key, double* target, const std::string& help, double min, double max) {
  Add({key, FlagFor(key), "X", fmt::format("{} ({}..{})", help, min, max), false,
       [target, min, max](std::string_view v) -> Status {
         double x = 0;
         if (!ParseNumber(Trim(v), &x)) return InvalidArgument("expected a number, got '{}'", v);
         if (x < min || x > max) return OutOfRange("{} is out of range: accepted {}..{}", x, min, max);
         *target = x;
         return Status::Ok();
       },
       [target] { return fmt::format("{}", *target); }});
}

void OptionSet::Duration(const std::string& key, std::chrono::milliseconds* target, const std::string& help,
                         std::chrono::milliseconds min, std::chrono::milliseconds max) {
  Add({key, FlagFor(key), "DURATION", fmt::format("{} ({}..{})", help, FormatDuration(min), FormatDuration(max)), false,
       [target, min, max](std::string_view v) -> Status {
         auto d = ParseDuration(v);
         if (!d.ok()) return d.status();
         if (*d < min || *d > max) {
           return OutOfRange("{} is out of range: accepted {}..{}", FormatDuration(*d), FormatDuration(min),
                             FormatDuration(max));
         }
         *target = *d;
         return Status::Ok();
       },
       [target] { return FormatDuration(*target); }});
}

void OptionSet::Bytes(const std::string& key, uint64_t* target, const std::string& help, uint64_t min, uint64_t max) {
  Add({key, FlagFor(key), "SIZE", fmt::format("{} ({}..{})", help, FormatBytes(min), FormatBytes(max)), false,
       [target, min, max](std::string_view v) -> Status {
         auto b = ParseBytes(v);
         if (!b.ok()) return b.status();
         if (*b < min || *b > max) {
           return OutOfRange("{} is out of range: accepted {}..{}", FormatBytes(*b), FormatBytes(min),
                             FormatBytes(max));
         }
         *target = *b;
         return Status::Ok();
       },
       [target] { return FormatBytes(*target); }});
}

void OptionSet::Choice(const std::string& key, std::string* target, std::vector<std::string> choices,
                       const std::string& help) {
  const std::string joined = fmt::format("{}", fmt::join(choices, "|"));
  Add({key, FlagFor(key), joined, help, false,
       [target, choices, joined](std::string_view v) -> Status {
         const std::string value(Trim(v));
         if (std::find(choices.begin(), choices.end(), value) == choices.end()) {
           return InvalidArgument("expected one of {}, got '{}'", joined, v);
         }
         *target = value;
         return Status::Ok();
       },
       [target] { return *target; }});
}

void OptionSet::Address(const std::string& key, std::string* target, const std::string& help, bool allow_empty) {
  Add({key, FlagFor(key), "HOST:PORT", allow_empty ? help + " (empty: off)" : help, false,
       [target, allow_empty](std::string_view v) -> Status {
         const std::string value(Trim(v));
         if (value.empty() && allow_empty) {
           target->clear();
           return Status::Ok();
         }
         auto hp = ParseHostPort(value);
         if (!hp.ok()) return hp.status();
         *target = value;
         return Status::Ok();
       },
       [target] { return *target; }});
}

void OptionSet::Positional(const std::string& name, std::string* target, const std::string& help, bool required) {
  positionals_.push_back({name, target, help, required});
}

void OptionSet::EnableConfigFile() {
  config_file_enabled_ = true;
}

void OptionSet::AddCheck(std::function<Status()> check) {
  checks_.push_back(std::move(check));
}

Status OptionSet::Set(std::string_view key, std::string_view value) {
  const Option* o = FindByKey(key);
  if (o == nullptr) return InvalidArgument("unknown key '{}'{}", key, Suggest(key, false));
  return o->set(value).WithContext(key);
}

Status OptionSet::ApplyYaml(std::string_view yaml_text, std::string_view origin) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::Exception& e) {
    return InvalidArgument("{}: not valid YAML: {}", Location(origin, e.mark), e.msg);
  }
  if (root.IsNull()) return Status::Ok();  // an empty file sets nothing
  if (!root.IsMap()) {
    return InvalidArgument("{}: the configuration must be a map of keys to values", Location(origin, root.Mark()));
  }
  // Walks maps depth-first, turning nesting into dotted keys.
  std::function<Status(const YAML::Node&, const std::string&)> walk = [&](const YAML::Node& map,
                                                                          const std::string& prefix) -> Status {
    for (const auto& entry : map) {
      std::string name;
      try {
        name = entry.first.as<std::string>();
      } catch (const YAML::Exception&) {
        return InvalidArgument("{}: keys must be plain strings", Location(origin, entry.first.Mark()));
      }
      const std::string key = prefix.empty() ? name : prefix + "." + name;
      const YAML::Node& value = entry.second;
      const std::string where = Location(origin, entry.first.Mark());
      if (value.IsMap()) {
        const bool known_section = std::any_of(options_.begin(), options_.end(),
                                               [&](const Option& o) { return o.key.rfind(key + ".", 0) == 0; });
        if (!known_section) return InvalidArgument("{}: unknown section '{}'{}", where, key, Suggest(key, false));
        TANDEM_RETURN_IF_ERROR(walk(value, key));
        continue;
      }
      const Option* o = FindByKey(key);
      if (o == nullptr) return InvalidArgument("{}: unknown key '{}'{}", where, key, Suggest(key, false));
      if (value.IsNull()) return InvalidArgument("{}: '{}' has no value", where, key);
      if (!value.IsScalar()) return InvalidArgument("{}: '{}' must be a single value, not a list", where, key);
      const Status s = o->set(value.Scalar());
      if (!s.ok()) return Status(s.code(), fmt::format("{}: {}: {}", where, key, s.message()));
    }
    return Status::Ok();
  };
  return walk(root, "");
}

Status OptionSet::ApplyYamlFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound("cannot read the configuration file '{}': {}", path, std::strerror(errno));
  std::stringstream buf;
  buf << in.rdbuf();
  return ApplyYaml(buf.str(), path);
}

Result<OptionSet::Outcome> OptionSet::Parse(int argc, const char* const* argv, std::string* out) {
  std::vector<std::string_view> args(argv + 1, argv + argc);
  bool check_config = false;

  // First pass: --help, --version and --config, so the file applies before any flag.
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string_view a = args[i];
    if (a == "--help" || a == "-h") {
      *out = Help();
      return Outcome::kExit;
    }
    if (a == "--version") {
      *out = fmt::format("{} {} ({}{})\n", program_, TANDEM_VERSION, TANDEM_BUILD_TYPE,
                         TANDEM_CUDA_ENABLED ? ", CUDA" : "");
      return Outcome::kExit;
    }
    if (!config_file_enabled_) continue;
    if (a == "--config" || a.rfind("--config=", 0) == 0) {
      std::string path;
      if (a == "--config") {
        if (i + 1 >= args.size()) return InvalidArgument("--config needs a file name");
        path = std::string(args[++i]);
      } else {
        path = std::string(a.substr(9));
      }
      TANDEM_RETURN_IF_ERROR(ApplyYamlFile(path));
    }
  }

  size_t next_positional = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string_view a = args[i];
    if (config_file_enabled_ && a == "--config") {
      ++i;
      continue;
    }
    if (config_file_enabled_ && a.rfind("--config=", 0) == 0) continue;
    if (config_file_enabled_ && a == "--check-config") {
      check_config = true;
      continue;
    }
    if (a.rfind("--", 0) != 0 || a.size() == 2) {
      if (next_positional < positionals_.size()) {
        *positionals_[next_positional++].target = std::string(a);
        continue;
      }
      return InvalidArgument("unexpected argument '{}' (run {} --help)", a, program_);
    }
    std::string_view name = a.substr(2);
    std::optional<std::string_view> value;
    if (const size_t eq = name.find('='); eq != std::string_view::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    const Option* o = FindByFlag(name);
    if (o == nullptr) {
      return InvalidArgument("unknown flag --{}{} (run {} --help to list the flags)", name, Suggest(name, true),
                             program_);
    }
    if (!value) {
      if (o->is_bool) {
        value = "true";
      } else {
        if (i + 1 >= args.size()) return InvalidArgument("--{} needs a value ({})", name, o->value_name);
        value = args[++i];
      }
    }
    const Status s = o->set(*value);
    if (!s.ok()) return Status(s.code(), fmt::format("--{}: {}", name, s.message()));
  }
  for (size_t p = next_positional; p < positionals_.size(); ++p) {
    if (positionals_[p].required) {
      return InvalidArgument("missing {} ({}); run {} --help", positionals_[p].name, positionals_[p].help, program_);
    }
  }
  for (const auto& check : checks_) TANDEM_RETURN_IF_ERROR(check());
  if (check_config) {
    *out = EffectiveYaml();
    return Outcome::kExit;
  }
  return Outcome::kRun;
}

std::string OptionSet::Help() const {
  std::string usage = program_;
  if (config_file_enabled_) usage += " [--config FILE]";
  usage += " [flags]";
  for (const auto& p : positionals_) usage += p.required ? " " + p.name : " [" + p.name + "]";
  std::string text = fmt::format("{} {}: {}\n\nUsage: {}\n", program_, TANDEM_VERSION, summary_, usage);
  if (!positionals_.empty()) {
    text += "\nArguments:\n";
    for (const auto& p : positionals_) text += fmt::format("  {:<30} {}\n", p.name, p.help);
  }
  if (!options_.empty()) {
    text += config_file_enabled_ ? "\nFlags (each is also a key of the YAML file, shown in brackets):\n" : "\nFlags:\n";
    for (const auto& o : options_) {
      const std::string left = o.is_bool ? "--" + o.flag : fmt::format("--{} {}", o.flag, o.value_name);
      const std::string current = o.get();
      std::string line = fmt::format("  {:<30} {}", left, o.help);
      if (config_file_enabled_) line += fmt::format(" [{}]", o.key);
      if (!current.empty()) line += fmt::format(" (default {})", current);
      text += line + "\n";
    }
  }
  text += "\nGeneral:\n";
  if (config_file_enabled_) {
    text += fmt::format("  {:<30} {}\n", "--config FILE", "YAML configuration; flags win over it");
    text += fmt::format("  {:<30} {}\n", "--check-config", "print the effective configuration as YAML and exit");
  }
  text += fmt::format("  {:<30} {}\n", "--help", "show this help and exit");
  text += fmt::format("  {:<30} {}\n", "--version", "show the version and exit");
  if (!epilog_.empty()) text += "\n" + epilog_ + "\n";
  return text;
}

std::vector<std::string> OptionSet::Flags(std::string_view key_prefix) const {
  std::vector<std::string> out;
  for (const auto& o : options_) {
    if (!o.key.starts_with(key_prefix)) continue;
    const std::string value = o.get();
    if (o.is_bool) {
      out.push_back(fmt::format("--{}={}", o.flag, value));
    } else if (!value.empty()) {
      out.push_back("--" + o.flag);
      out.push_back(value);
    }
  }
  return out;
}

std::string OptionSet::EffectiveYaml() const {
  YAML::Node root(YAML::NodeType::Map);
  for (const auto& o : options_) {
    std::vector<std::string> parts;
    std::stringstream ss(o.key);
    for (std::string part; std::getline(ss, part, '.');) parts.push_back(part);
    // yaml-cpp nodes are handles: walk down by reassigning a copy of each child handle.
    YAML::Node node = root;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      YAML::Node child = node[parts[i]];
      if (!child.IsMap()) child = YAML::Node(YAML::NodeType::Map);
      node[parts[i]] = child;
      node.reset(child);
    }
    node[parts.back()] = o.get();
  }
  YAML::Emitter emitter;
  emitter << root;
  return std::string(emitter.c_str()) + "\n";
}

}  // namespace tandem
