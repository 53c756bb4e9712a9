// libFuzzer entry point for the command-language parser: any bytes must parse
// to commands or to one error with a line number inside the input, never crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fusefs/command_parser.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto result = salus::fusefs::parse_commands(text);
  std::size_t lines = 1;
  for (const char c : text) lines += c == '\n';
  // Properties that a crash-free run could still violate.
  if (result.error) {
    const auto& e = *result.error;
    if (e.line == 0 || e.line > lines || e.message.empty() ||
        e.message.find('\n') != std::string::npos) {
      std::abort();
    }
  }
  std::uint32_t previous = 0;
  for (const auto& c : result.commands) {
    if (c.line <= previous || c.line > lines) std::abort();
    if (result.error && c.line >= result.error->line) std::abort();
    previous = c.line;
  }
  return 0;
}
