// A hostile program's side of a gate, for the tests that check salusd against
// one: a thread that scribbles random words over the whole gate, with
// protocol-shaped writes among them so that salusd's paths past validation
// run too (requests, completions, swap answers, lane reports), and rings the
// bell after every burst. Seeded, so that a failure repeats. Shared by the
// attached-session and shared-lane tests.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <thread>

#include "client/salus_gate.h"

namespace salus::test {

class GateScribbler {
 public:
  GateScribbler(salus_gate* gate, int bell, std::uint64_t seed)
      : thread_([this, gate, bell, seed] { run(gate, bell, seed); }) {}
  ~GateScribbler() { stop(); }
  GateScribbler(const GateScribbler&) = delete;
  GateScribbler& operator=(const GateScribbler&) = delete;

  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  template <class T>
  static T load(T& f) {
    return std::atomic_ref<T>(f).load();
  }
  template <class T>
  static void store(T& f, T v) {
    std::atomic_ref<T>(f).store(v);
  }

  void run(salus_gate* g, int bell, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    auto* words = reinterpret_cast<std::uint64_t*>(g);
    const std::size_t n = sizeof(salus_gate) / sizeof(std::uint64_t);
    while (!stop_.load()) {
      for (int i = 0; i < 64; ++i) {
        const std::uint64_t r = rng();
        switch (r % 8) {
          case 0:
            store(g->requested, load(g->granted) + r % 3);
            break;
          case 1:
            store(g->completed, load(g->requested) - r % 2);
            break;
          case 2:
            store(g->swap_done_seq, load(g->swap_seq));
            break;
          case 3:
            store(g->lane_held, load(g->lane_grant));
            break;
          default:
            store(words[(r >> 8) % n], rng());
            break;
        }
      }
      const std::uint64_t one = 1;
      [[maybe_unused]] const ssize_t rung = ::write(bell, &one, sizeof one);  // EAGAIN: full
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace salus::test
