// Byte sizes with K/M/G/T suffixes: parsing for commands, flags and traces, and
// human-readable formatting for status files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace salus::arena {

using Bytes = std::uint64_t;

// Every arena allocation and lane boundary is aligned to this many bytes.
inline constexpr Bytes kAlignment = 256;

constexpr Bytes align_up(Bytes n) {
  return (n + kAlignment - 1) & ~(kAlignment - 1);
}

// Parses "4096", "64K", "64M", "1.5G", "2T" (binary units; an optional trailing
// "B"/"iB" is accepted, e.g. "64MiB"). Returns nullopt on junk, a negative sign,
// a fraction that is not a whole byte count, or overflow past 2^63.
std::optional<Bytes> parse_size(std::string_view text);

// The same, telling why a text is not a size: `out_of_range` for a well-formed
// size past 2^63 (so callers can say ERANGE rather than "junk").
enum class SizeParse : std::uint8_t { ok, malformed, out_of_range };
SizeParse parse_size(std::string_view text, Bytes& out);

// "64.0M", "1.5G", "512" — the inverse of parse_size, rounded to one decimal.
std::string format_size(Bytes n);

}  // namespace salus::arena
