// The CompletionSink test double every backend test uses: it records each
// completion (with the time it arrived) and lets a test wait for one, with a
// bound, so a broken backend fails its test instead of hanging it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <vector>

#include "vgpu/device.hpp"

namespace salus::test {

class RecordingSink : public vgpu::CompletionSink {
 public:
  using Clock = std::chrono::steady_clock;
  struct Event {
    vgpu::StreamId stream = 0;
    std::uint64_t token = 0;
    int status = 0;
    std::int64_t device_ns = 0;
    Clock::time_point at{};
  };
  static constexpr std::chrono::milliseconds kDefaultWait{30'000};

  // Completions this returns true for went elsewhere (e.g. to a TransferEngine
  // owning the stream) and are not recorded.
  std::function<bool(vgpu::StreamId, std::uint64_t, int, std::int64_t)> forward;

  void on_complete(vgpu::StreamId stream, std::uint64_t token, int status,
                   std::int64_t device_ns) override {
    if (forward && forward(stream, token, status, device_ns)) return;
    std::lock_guard lock(mu_);
    events_.push_back(Event{stream, token, status, device_ns, Clock::now()});
    cv_.notify_all();
  }

  // The completion of (stream, token), or nullopt once `timeout` has passed.
  std::optional<Event> wait(vgpu::StreamId stream, std::uint64_t token,
                            std::chrono::milliseconds timeout = kDefaultWait) {
    return wait_for([&](const Event& e) { return e.stream == stream && e.token == token; },
                    timeout);
  }
  // The completion of `token` on whichever stream, or nullopt after `timeout`.
  std::optional<Event> wait_token(std::uint64_t token,
                                  std::chrono::milliseconds timeout = kDefaultWait) {
    return wait_for([&](const Event& e) { return e.token == token; }, timeout);
  }
  // The status of `token`'s completion, or -1 (never an errno) after `timeout`.
  int status_of(std::uint64_t token, std::chrono::milliseconds timeout = kDefaultWait) {
    const auto e = wait_token(token, timeout);
    return e ? e->status : -1;
  }
  // Without waiting.
  std::optional<Event> find(vgpu::StreamId stream, std::uint64_t token) {
    return wait(stream, token, std::chrono::milliseconds(0));
  }
  std::vector<Event> events() {
    std::lock_guard lock(mu_);
    return events_;
  }

 private:
  template <class Match>
  std::optional<Event> wait_for(Match match, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    std::optional<Event> found;
    cv_.wait_for(lock, timeout, [&] {
      for (const Event& e : events_) {
        if (match(e)) {
          found = e;
          return true;
        }
      }
      return false;
    });
    return found;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Event> events_;
};

}  // namespace salus::test
