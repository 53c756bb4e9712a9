// Drives a Broker through its public API as the FUSE layer does: parse the
// text, submit it, wait for the (possibly deferred) reply. Bounded, so that a
// broken broker fails its test instead of hanging it. Shared by the broker and
// attached-session tests.
#pragma once

#include <cerrno>
#include <chrono>
#include <future>
#include <optional>
#include <string>
#include <utility>

#include "fusefs/command_parser.hpp"
#include "vgpu/broker/broker.hpp"

namespace salus::test {

inline constexpr std::chrono::seconds kReplyBound{10};

// Submits `text` for `who` and returns the reply's errno and text (ETIMEDOUT
// when none came within kReplyBound). A parse error goes to the broker, as
// the FUSE layer passes it, so the reply and the log say which line.
inline std::pair<int, std::string> run_commands(vgpu::Broker& b, vgpu::SessionId id,
                                                const std::string& text, const vgpu::Caller& who) {
  auto parsed = fusefs::parse_commands(text);
  std::optional<std::pair<std::uint32_t, std::pair<int, std::string>>> perr;
  if (parsed.error) perr = {parsed.error->line, {parsed.error->error, parsed.error->message}};
  std::promise<std::pair<int, std::string>> p;
  auto f = p.get_future();
  b.submit(id, who, text.size(), std::move(parsed.commands), std::move(perr),
           [&p](int err, std::string reply) {
             p.set_value({err, std::move(reply)});
           });
  if (f.wait_for(kReplyBound) != std::future_status::ready) return {ETIMEDOUT, {}};
  return f.get();
}

// What a read of the session's `wait` file returns once its work is done.
inline std::pair<int, std::string> wait_session(vgpu::Broker& b, vgpu::SessionId id) {
  std::promise<std::pair<int, std::string>> p;
  auto f = p.get_future();
  b.wait(id, [&p](int err, std::string text) { p.set_value({err, std::move(text)}); });
  if (f.wait_for(kReplyBound) != std::future_status::ready) return {ETIMEDOUT, {}};
  return f.get();
}

}  // namespace salus::test
