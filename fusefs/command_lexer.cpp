#include "fusefs/command_lexer.hpp"

#include <charconv>
#include <cmath>
#include <cstring>
#include <system_error>

namespace salus::fusefs::lex {

namespace {

constexpr std::uint64_t kOnes = 0x0101010101010101ULL;
constexpr std::uint64_t kHighs = 0x8080808080808080ULL;

bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

bool in(unsigned char c, unsigned lo, unsigned hi) {
  return c >= lo && c <= hi;
}

// A '-' that starts what would otherwise be a number: reported as "must not be
// negative" rather than as junk, because that is what the user meant.
bool looks_negative(std::string_view text) {
  return text.size() >= 2 && text[0] == '-' && (is_digit(text[1]) || text[1] == '.');
}

template <typename T>
NumStatus parse_floating(std::string_view text, T& out) {
  // from_chars would also take "inf", "nan" and "infinity"; only numbers are wanted.
  std::size_t first = (!text.empty() && text[0] == '-') ? 1 : 0;
  if (first >= text.size() || !(is_digit(text[first]) || text[first] == '.')) {
    return NumStatus::bad;
  }
  T value{};
  const char* const end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value, std::chars_format::general);
  if (ec == std::errc::invalid_argument || ptr != end) return NumStatus::bad;
  if (ec == std::errc::result_out_of_range || !std::isfinite(value)) return NumStatus::range;
  out = value;
  return NumStatus::ok;
}

}  // namespace

LineProblem check_line_bytes(std::string_view line) {
  const auto* p = reinterpret_cast<const unsigned char*>(line.data());
  const std::size_t n = line.size();
  std::size_t i = 0;
  while (i < n) {
    // Command lines are almost all ASCII: skip eight bytes at a time while they
    // have no high bit and no zero byte.
    while (i + 8 <= n) {
      std::uint64_t w;
      std::memcpy(&w, p + i, 8);
      if ((w & kHighs) != 0 || ((w - kOnes) & ~w & kHighs) != 0) break;
      i += 8;
    }
    if (i >= n) break;
    const unsigned char c = p[i];
    if (c == 0) return LineProblem::nul;
    if (c < 0x80) {
      ++i;
      continue;
    }
    // Lead byte decides the length and the allowed range of the second byte;
    // the narrowed ranges are what exclude overlong forms, surrogates and > U+10FFFF.
    std::size_t len;
    unsigned lo = 0x80, hi = 0xBF;
    if (in(c, 0xC2, 0xDF)) {
      len = 2;
    } else if (c == 0xE0) {
      len = 3, lo = 0xA0;
    } else if (in(c, 0xE1, 0xEC) || in(c, 0xEE, 0xEF)) {
      len = 3;
    } else if (c == 0xED) {
      len = 3, hi = 0x9F;
    } else if (c == 0xF0) {
      len = 4, lo = 0x90;
    } else if (in(c, 0xF1, 0xF3)) {
      len = 4;
    } else if (c == 0xF4) {
      len = 4, hi = 0x8F;
    } else {
      return LineProblem::bad_utf8;
    }
    if (n - i < len) return LineProblem::bad_utf8;
    if (!in(p[i + 1], lo, hi)) return LineProblem::bad_utf8;
    for (std::size_t k = 2; k < len; ++k) {
      if (!in(p[i + k], 0x80, 0xBF)) return LineProblem::bad_utf8;
    }
    i += len;
  }
  return LineProblem::none;
}

NumStatus parse_unsigned(std::string_view text, std::uint64_t lo, std::uint64_t hi,
                         std::uint64_t& out, bool allow_hex) {
  if (looks_negative(text)) return NumStatus::negative;
  if (text.empty() || !is_digit(text[0])) return NumStatus::bad;
  int base = 10;
  if (allow_hex && text.size() > 2 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X')) {
    text.remove_prefix(2);
    base = 16;
  }
  std::uint64_t value = 0;
  const char* const end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value, base);
  if (ec == std::errc::invalid_argument || ptr != end) return NumStatus::bad;
  if (ec == std::errc::result_out_of_range || value < lo || value > hi) return NumStatus::range;
  out = value;
  return NumStatus::ok;
}

NumStatus parse_signed(std::string_view text, std::int64_t lo, std::int64_t hi, std::int64_t& out) {
  const std::size_t first = (!text.empty() && text[0] == '-') ? 1 : 0;
  if (first >= text.size() || !is_digit(text[first])) return NumStatus::bad;
  std::int64_t value = 0;
  const char* const end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec == std::errc::invalid_argument || ptr != end) return NumStatus::bad;
  if (ec == std::errc::result_out_of_range || value < lo || value > hi) return NumStatus::range;
  out = value;
  return NumStatus::ok;
}

NumStatus parse_float(std::string_view text, float& out) {
  return parse_floating(text, out);
}

NumStatus parse_double(std::string_view text, double& out) {
  return parse_floating(text, out);
}

NumStatus parse_size(std::string_view text, arena::Bytes& out) {
  switch (arena::parse_size(text, out)) {
    case arena::SizeParse::ok:
      return NumStatus::ok;
    case arena::SizeParse::out_of_range:
      return NumStatus::range;
    case arena::SizeParse::malformed:
      break;
  }
  return looks_negative(text) ? NumStatus::negative : NumStatus::bad;
}

}  // namespace salus::fusefs::lex
