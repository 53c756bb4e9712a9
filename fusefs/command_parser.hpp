// The command language's parser: a pure function from the bytes of one write()
// to typed commands, or to the first error with its line number and errno.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "vgpu/broker/command.hpp"

namespace salus::fusefs {

struct ParseError {
  std::uint32_t line = 0;  // 1-based
  int error = 0;           // errno: EINVAL for malformed text, ERANGE for out-of-range numbers
  std::string message;     // one line, no trailing newline, names the offending token
};

struct ParseResult {
  // Every line before the first error, in order. Blank and comment-only lines
  // produce nothing but still count for line numbers.
  std::vector<vgpu::CommandLine> commands;
  std::optional<ParseError> error;
};

// Longest accepted line; longer lines are an EINVAL error.
inline constexpr std::size_t kMaxLineLength = 4096;

// Parses `text`: one command per line ('\n' separated, an optional trailing '\r'
// is ignored), '#' starts a comment, tokens are separated by spaces or tabs.
// Rejects non-UTF-8 bytes and embedded NULs (EINVAL). Never throws.
ParseResult parse_commands(std::string_view text);

}  // namespace salus::fusefs
