#include "arena/size_units.hpp"

#include <fmt/format.h>
#include <cmath>

namespace salus::arena {

std::optional<Bytes> parse_size(std::string_view text) {
  Bytes out = 0;
  if (parse_size(text, out) != SizeParse::ok) return std::nullopt;
  return out;
}

SizeParse parse_size(std::string_view text, Bytes& out) {
  constexpr SizeParse bad = SizeParse::malformed;
  if (text.empty()) return bad;
  std::size_t i = 0;
  unsigned long long whole = 0;
  bool any_digit = false;
  bool whole_overflow = false;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    const unsigned digit = static_cast<unsigned>(text[i] - '0');
    if (whole > (~0ULL - digit) / 10) whole_overflow = true;
    if (!whole_overflow) whole = whole * 10 + digit;
    any_digit = true;
    ++i;
  }
  // Fractions are kept as an exact decimal numerator/denominator pair.
  unsigned long long frac_num = 0, frac_den = 1;
  if (i < text.size() && text[i] == '.') {
    ++i;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
      if (frac_den >= 1'000'000ULL) return bad;  // more than 6 decimals
      frac_num = frac_num * 10 + static_cast<unsigned>(text[i] - '0');
      frac_den *= 10;
      any_digit = true;
      ++i;
    }
  }
  if (!any_digit) return bad;
  unsigned shift = 0;
  if (i < text.size()) {
    switch (text[i]) {
      case 'k':
      case 'K':
        shift = 10;
        break;
      case 'm':
      case 'M':
        shift = 20;
        break;
      case 'g':
      case 'G':
        shift = 30;
        break;
      case 't':
      case 'T':
        shift = 40;
        break;
      case 'b':
      case 'B':
        shift = 0;
        break;
      default:
        return bad;
    }
    if (text[i] != 'b' && text[i] != 'B') {
      ++i;
      if (i < text.size() && text[i] == 'i') ++i;
      if (i < text.size() && (text[i] == 'B' || text[i] == 'b')) ++i;
    } else {
      ++i;
    }
  }
  if (i != text.size()) return bad;
  constexpr unsigned long long kLimit = 1ULL << 63;
  if (whole_overflow || whole > (kLimit >> shift)) return SizeParse::out_of_range;
  unsigned long long value = whole << shift;
  if (frac_num != 0) {
    const unsigned long long scaled = (frac_num << shift);
    if (scaled % frac_den != 0) return bad;  // not a whole number of bytes
    value += scaled / frac_den;
  }
  if (value > kLimit) return SizeParse::out_of_range;
  out = value;
  return SizeParse::ok;
}

std::string format_size(Bytes n) {
  static constexpr const char* kUnits[] = {"", "K", "M", "G", "T"};
  if (n < 1024) return fmt::format("{}", n);
  double v = static_cast<double>(n);
  int unit = 0;
  while (v >= 1024.0 && unit < 4) {
    v /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.1f}{}", v, kUnits[unit]);
}

}  // namespace salus::arena
