// The sim streams of one device and the fixed set of threads that run them.
// A stream is a queue of ops run strictly in order, as a GPU stream does; it
// owns no thread. Spins are timed events of the contention model (one clock
// thread per device collects them); the host work of the other ops (fills,
// copies, gemm, module kernels) runs on a few host threads per device, one op
// at a time per stream, streams taking turns. So salusd's threads on sim do not
// grow with the sessions and lanes users open, and a long spin holds no thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "vgpu/device.hpp"
#include "vgpu/sim/op_ring.hpp"
#include "vgpu/sim/sim_ops.hpp"

namespace salus::vgpu::sim {

class BusyMeter;
class HostMapping;
class RealTimeContention;

// What the streams of one device share; owned by the device, outlives its streams.
struct StreamEnv {
  int device_index;
  HostMapping& memory;
  RealTimeContention& contention;
  BusyMeter& busy;
  const std::atomic<CompletionSink*>& sink;
};

// One stream's state. Every field is guarded by its StreamRunner's lock; the
// thread that drives the stream (state `running`) is the only one that runs
// its ops, so they stay in order.
struct SimStream {
  explicit SimStream(StreamId id) : id(id) {}

  // An op and when it was enqueued (the model's clock): the earliest it may start.
  struct Queued {
    SimOp op;
    std::int64_t at = 0;
  };
  enum class State : std::uint8_t {
    idle,     // nothing queued, nobody on it
    ready,    // in the runner's ready list, for a host thread
    running,  // a host or the clock thread is running its ops
    waiting,  // its spin is a kernel of the contention model
  };

  const StreamId id;
  OpRing<Queued> queue;
  State state = State::idle;
  std::int64_t device_ns = 0;  // op time since the last notify
  // Where this stream's previous op ended on the contention model's time axis:
  // a kernel queued behind it starts there, as on a GPU, not when a thread gets to it.
  std::int64_t cursor = 0;
  int status = 0;  // first error since the last notify
};

class StreamRunner {
 public:
  // Host threads per device: enough for host ops of several lanes to overlap.
  static constexpr unsigned kHostThreads = 4;

  // Starts the threads. Throws std::system_error if one cannot be created.
  explicit StreamRunner(StreamEnv env);
  // Precondition: every stream drained (drain()). Stops and joins the threads.
  ~StreamRunner();
  StreamRunner(const StreamRunner&) = delete;
  StreamRunner& operator=(const StreamRunner&) = delete;

  void enqueue(SimStream& s, const SimOp& op);
  // Returns once `s` has nothing queued and nothing running.
  void drain(SimStream& s);
  // Whether the calling thread is one of this runner's (a completion callback).
  bool on_own_thread() const;

 private:
  void host_loop();
  void clock_loop();
  // Runs `s`'s ops from its head while that needs no host thread (notify, a
  // spin's start), and host ops too when `host` is set, one op then back of
  // the ready list. Leaves `s` idle, ready or waiting. Called with `lock` held.
  void drive(SimStream& s, std::unique_lock<std::mutex>& lock, bool host);
  // drive() inside the threads' one catch-all.
  void guarded(SimStream& s, std::unique_lock<std::mutex>& lock, bool host);
  void start_spin(SimStream& s, const SpinOp& op, std::int64_t enqueued_at);
  void run_host_op(SimStream& s, std::unique_lock<std::mutex>& lock);
  void complete(SimStream& s, std::unique_lock<std::mutex>& lock, std::uint64_t token);
  void make_ready(SimStream& s);
  void go_idle(SimStream& s);

  const StreamEnv env_;
  std::mutex mu_;
  std::condition_variable work_;  // host threads: ready_ not empty, or stopping_
  std::condition_variable idle_;  // drain(): a stream went idle
  OpRing<SimStream*> ready_;      // guarded by mu_
  bool stopping_ = false;         // guarded by mu_

  std::vector<std::thread> host_;
  std::thread clock_;  // last: starts after everything it uses exists
};

}  // namespace salus::vgpu::sim
