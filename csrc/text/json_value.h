// A JSON value and its parser, for the standalone file's header (a safetensors header and the JSON string of its
// metadata): objects, arrays, strings (escapes and \u surrogate pairs decoded to UTF-8), numbers as double,
// true / false / null. Parsing fails with the byte offset of the first error.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace bitquilt_json {

// Code point `cp` appended to `out` as UTF-8.
inline void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | cp >> 6);
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | cp >> 12);
    out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | cp >> 18);
    out += static_cast<char>(0x80 | (cp >> 12 & 0x3F));
    out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

struct Value {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<Value> array;
  std::map<std::string, Value> object;

  // The member `key` of an object, or null when absent (or this is not an object).
  const Value& operator[](const std::string& key) const {
    static const Value null;
    const auto it = object.find(key);
    return kind == Object && it != object.end() ? it->second : null;
  }
  bool has(const std::string& key) const { return kind == Object && object.count(key) > 0; }
  // Whether this is a number holding an integer in [lo, hi] exactly (not 2.5, not 1e999, not NaN): only those cast
  // to int64 with a defined result. lo and hi lie within ±2^53, where doubles hold every integer.
  bool is_integer(int64_t lo = -(int64_t{1} << 53), int64_t hi = int64_t{1} << 53) const {
    return kind == Number && std::isfinite(number) && number == std::floor(number) &&
           number >= static_cast<double>(lo) && number <= static_cast<double>(hi);
  }
  // The integer this holds (is_integer); a std::runtime_error otherwise.
  int64_t integer() const {
    if (!is_integer()) throw std::runtime_error("JSON: expected an integer, got " + describe());
    return static_cast<int64_t>(number);
  }
  // A few words on what this value is, for messages.
  std::string describe() const {
    static const char* const kinds[] = {"null", "a boolean", "", "a string", "a list", "an object"};
    if (kind != Number) return kinds[kind];
    char text[32];
    std::snprintf(text, sizeof text, "%.17g", number);
    return text;
  }
};

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  Value parse() {
    Value v = value();
    skip_space();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("JSON: " + what + " at byte " + std::to_string(i_));
  }
  void skip_space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool take(char c) {
    skip_space();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!take(c)) fail(std::string("expected '") + c + "'");
  }
  bool literal(const char* word) {
    const std::string w(word);
    if (s_.compare(i_, w.size(), w) != 0) return false;
    i_ += w.size();
    return true;
  }

  Value value() {
    if (++depth_ > 64) fail("nesting deeper than 64");
    skip_space();
    if (i_ >= s_.size()) fail("unexpected end");
    Value v;
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      v.kind = Value::Object;
      if (!take('}')) {
        do {
          skip_space();
          if (i_ >= s_.size() || s_[i_] != '"') fail("expected a string key");
          std::string key = string();
          expect(':');
          v.object[key] = value();
        } while (take(','));
        expect('}');
      }
    } else if (c == '[') {
      ++i_;
      v.kind = Value::Array;
      if (!take(']')) {
        do v.array.push_back(value());
        while (take(','));
        expect(']');
      }
    } else if (c == '"') {
      v.kind = Value::String;
      v.string = string();
    } else if (literal("true")) {
      v.kind = Value::Bool;
      v.boolean = true;
    } else if (literal("false")) {
      v.kind = Value::Bool;
    } else if (literal("null")) {
      v.kind = Value::Null;
    } else {
      char* end = nullptr;
      v.number = std::strtod(s_.c_str() + i_, &end);
      if (end == s_.c_str() + i_) fail("unexpected character");
      v.kind = Value::Number;
      i_ = end - s_.c_str();
    }
    --depth_;
    return v;
  }

  uint32_t hex4() {
    if (i_ + 4 > s_.size()) fail("short \\u escape");
    const std::string digits = s_.substr(i_, 4);
    char* end = nullptr;
    const uint32_t u = std::strtoul(digits.c_str(), &end, 16);
    if (end != digits.c_str() + 4) fail("bad \\u escape");
    i_ += 4;
    return u;
  }

  std::string string() {
    ++i_;  // the opening quote
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      const char e = s_[i_++];
      switch (e) {
        case '"': case '\\': case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && s_.compare(i_, 2, "\\u") == 0) {
            i_ += 2;
            const uint32_t low = hex4();
            if (low < 0xDC00 || low >= 0xE000) fail("unpaired surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
  }

  const std::string& s_;
  size_t i_ = 0;
  int depth_ = 0;
};

inline Value parse(const std::string& text) { return Parser(text).parse(); }

}  // namespace bitquilt_json
