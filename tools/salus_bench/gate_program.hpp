// The program's side of an attached session's gate, for salus-bench: a sealed
// memfd gate and an eventfd bell, attached by writing `attachment()` as this
// process, then driven as libsalus-shim.so drives it at each boundary.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "client/salus_gate.h"

namespace salus::bench {

class GateProgram {
 public:
  GateProgram();
  ~GateProgram();
  GateProgram(const GateProgram&) = delete;
  GateProgram& operator=(const GateProgram&) = delete;

  int memfd() const { return memfd_; }
  int bell() const { return bell_; }
  // The `attach` command naming this process's fds.
  std::string attachment() const;
  // Marks explicitly and waits for iteration 1's grant.
  void start();
  // Boundaries k = 1, 2, ...: iteration k - lag reported done, k + 1 asked for
  // and waited for. lag 1: the pipelined case (the next iteration is granted
  // while the last one runs); lag 0: the lane drains and comes back. Runs
  // `warmup` unmeasured boundaries, then until `count` are measured or `until`
  // passes; returns each measured round trip in microseconds.
  std::vector<double> boundaries(std::uint64_t lag, std::size_t warmup, std::size_t count,
                                 std::chrono::steady_clock::time_point until);

 private:
  void wait_granted(std::uint64_t k);
  void ring() const;

  int memfd_ = -1;
  int bell_ = -1;
  salus_gate* g_ = nullptr;
  std::uint64_t k_ = 0;  // the last boundary passed
};

}  // namespace salus::bench
