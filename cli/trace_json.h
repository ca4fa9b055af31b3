// A small JSON reader for `tandem trace merge` (trace_merge.h): the trace
// files' lines, and the merged file in tests. Integers are kept exact (trace
// times are nanoseconds, beyond a double's 53 bits of precision).
#pragma once

#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "common/status.h"

namespace tandem::cli {

struct JValue {
  enum Type { kNull, kBool, kNumber, kString, kArray, kObject } type = kNull;
  bool b = false;
  bool integral = false;
  int64_t i = 0;
  double d = 0;
  std::string s;
  std::vector<JValue> array;
  // An object's members, in order: keys[i] is values[i]'s name. (Two
  // vectors: a pair holding the type being defined is not allowed.)
  std::vector<std::string> keys;
  std::vector<JValue> values;

  const JValue* Find(std::string_view key) const {
    for (size_t k = 0; k < keys.size(); ++k) {
      if (keys[k] == key) return &values[k];
    }
    return nullptr;
  }
  int64_t Int(std::string_view key, int64_t fallback = 0) const {
    const JValue* v = Find(key);
    if (v == nullptr || v->type != kNumber) return fallback;
    return v->integral ? v->i : static_cast<int64_t>(v->d);
  }
  std::string Str(std::string_view key) const {
    const JValue* v = Find(key);
    return v != nullptr && v->type == kString ? v->s : std::string();
  }
};

class JsonReader {
 public:
  explicit JsonReader(std::string_view text) : t_(text) {}
  Result<JValue> Document() {
    JValue v;
    TANDEM_RETURN_IF_ERROR(Value(v, 0));
    Space();
    if (p_ != t_.size()) return Error("text after the value");
    return v;
  }

 private:
  Status Error(std::string_view what) const { return InvalidArgument("{} at column {}", what, p_ + 1); }
  void Space() {
    while (p_ < t_.size() && (t_[p_] == ' ' || t_[p_] == '\t' || t_[p_] == '\r' || t_[p_] == '\n')) ++p_;
  }
  bool Eat(char c) {
    Space();
    if (p_ < t_.size() && t_[p_] == c) {
      ++p_;
      return true;
    }
    return false;
  }
  Status Value(JValue& v, int depth) {
    if (depth > 32) return Error("nesting too deep");
    Space();
    if (p_ >= t_.size()) return Error("unexpected end");
    const char c = t_[p_];
    if (c == '{') {
      ++p_;
      v.type = JValue::kObject;
      if (Eat('}')) return Status::Ok();
      do {
        Space();
        JValue key;
        if (p_ >= t_.size() || t_[p_] != '"') return Error("expected a key");
        TANDEM_RETURN_IF_ERROR(String(key.s));
        if (!Eat(':')) return Error("expected ':'");
        JValue item;
        TANDEM_RETURN_IF_ERROR(Value(item, depth + 1));
        v.keys.push_back(std::move(key.s));
        v.values.push_back(std::move(item));
      } while (Eat(','));
      if (!Eat('}')) return Error("expected ',' or '}'");
      return Status::Ok();
    }
    if (c == '[') {
      ++p_;
      v.type = JValue::kArray;
      if (Eat(']')) return Status::Ok();
      do {
        JValue item;
        TANDEM_RETURN_IF_ERROR(Value(item, depth + 1));
        v.array.push_back(std::move(item));
      } while (Eat(','));
      if (!Eat(']')) return Error("expected ',' or ']'");
      return Status::Ok();
    }
    if (c == '"') {
      v.type = JValue::kString;
      return String(v.s);
    }
    for (const auto& [word, type, value] :
         {std::tuple{"true", JValue::kBool, true}, {"false", JValue::kBool, false}, {"null", JValue::kNull, false}}) {
      if (t_.substr(p_, std::strlen(word)) == word) {
        p_ += std::strlen(word);
        v.type = type;
        v.b = value;
        return Status::Ok();
      }
    }
    return Number(v);
  }
  Status String(std::string& out) {
    ++p_;  // the opening quote
    while (p_ < t_.size()) {
      const char c = t_[p_++];
      if (c == '"') return Status::Ok();
      if (c != '\\') {
        out += c;
        continue;
      }
      if (p_ >= t_.size()) break;
      const char e = t_[p_++];
      switch (e) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'u': {
          if (p_ + 4 > t_.size()) return Error("bad \\u escape");
          unsigned code = 0;
          const auto [q, ec] = std::from_chars(t_.data() + p_, t_.data() + p_ + 4, code, 16);
          if (ec != std::errc() || q != t_.data() + p_ + 4) return Error("bad \\u escape");
          p_ += 4;
          if (code < 0x80) {
            out += static_cast<char>(code);
          } else if (code < 0x800) {
            out += static_cast<char>(0xC0 | (code >> 6));
            out += static_cast<char>(0x80 | (code & 0x3F));
          } else {
            out += static_cast<char>(0xE0 | (code >> 12));
            out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (code & 0x3F));
          }
          break;
        }
        default:
          out += e;
      }
    }
    return Error("unterminated string");
  }
  Status Number(JValue& v) {
    const size_t start = p_;
    while (p_ < t_.size() && (std::isdigit(static_cast<unsigned char>(t_[p_])) || t_[p_] == '-' || t_[p_] == '+' ||
                              t_[p_] == '.' || t_[p_] == 'e' || t_[p_] == 'E')) {
      ++p_;
    }
    if (p_ == start) return Error(fmt::format("unexpected '{}'", t_[start]));
    const std::string_view n = t_.substr(start, p_ - start);
    v.type = JValue::kNumber;
    const auto [q, ec] = std::from_chars(n.data(), n.data() + n.size(), v.i);
    if (ec == std::errc() && q == n.data() + n.size()) {
      v.integral = true;
      v.d = static_cast<double>(v.i);
      return Status::Ok();
    }
    char* end = nullptr;
    const std::string copy(n);
    v.d = std::strtod(copy.c_str(), &end);
    if (end != copy.c_str() + copy.size()) return Error("bad number");
    return Status::Ok();
  }

  std::string_view t_;
  size_t p_ = 0;
};

}  // namespace tandem::cli
