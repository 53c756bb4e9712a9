// Lexical layer of the command language: per-line byte checks (NUL, UTF-8),
// tokens, and number parsing that neither throws nor allocates.
#pragma once

#include <cstdint>
#include <string_view>

#include "arena/size_units.hpp"

namespace salus::fusefs::lex {

enum class LineProblem : std::uint8_t { none, nul, bad_utf8 };

// The first problem in `line`, by position: an embedded NUL byte or a byte
// sequence that is not well-formed UTF-8 (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF, no truncated sequences).
LineProblem check_line_bytes(std::string_view line);

inline bool is_blank(char c) {
  return c == ' ' || c == '\t';
}

// Splits one line on spaces and tabs. A token that starts with '#' begins a
// comment, like in a shell, so '#' inside a token (a path, say) is kept.
class Tokenizer {
 public:
  explicit Tokenizer(std::string_view line) : rest_(line) {}

  // The next token, or an empty view at the end of the line (tokens are never empty).
  std::string_view next() {
    std::size_t i = 0;
    while (i < rest_.size() && is_blank(rest_[i])) ++i;
    if (i == rest_.size() || rest_[i] == '#') {
      rest_ = {};
      return {};
    }
    std::size_t j = i;
    while (j < rest_.size() && !is_blank(rest_[j])) ++j;
    const std::string_view token = rest_.substr(i, j - i);
    rest_.remove_prefix(j);
    return token;
  }

 private:
  std::string_view rest_;
};

// Why a number did not parse. Callers map bad and negative to EINVAL, range to ERANGE.
enum class NumStatus : std::uint8_t { ok, bad, negative, range };

// Decimal (or, with allow_hex, "0x"-prefixed hex) unsigned integer in [lo, hi].
// No sign, no whitespace, no suffix.
NumStatus parse_unsigned(std::string_view text, std::uint64_t lo, std::uint64_t hi,
                         std::uint64_t& out, bool allow_hex = false);

// Decimal signed integer in [lo, hi]; a leading '-' is allowed, a leading '+' is not.
NumStatus parse_signed(std::string_view text, std::int64_t lo, std::int64_t hi, std::int64_t& out);

// A finite decimal floating-point number ("1.5", "-2", "1e-3", ".5"); no inf,
// nan, hex floats or leading '+'. Overflow and underflow give range.
NumStatus parse_float(std::string_view text, float& out);
NumStatus parse_double(std::string_view text, double& out);

// arena::parse_size, with its failures told apart: a negative sign, a value
// past 2^63 (range), or anything else (bad).
NumStatus parse_size(std::string_view text, arena::Bytes& out);

}  // namespace salus::fusefs::lex
