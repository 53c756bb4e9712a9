// One sim stream: a thread that runs its queued ops strictly in order, as a GPU
// stream does, and reports each notify() through the device's completion sink.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

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

class SimStream {
 public:
  // Starts the thread. Throws std::system_error if it cannot be created.
  SimStream(StreamId id, StreamEnv env);
  // Runs every op still queued, then joins the thread.
  ~SimStream();
  SimStream(const SimStream&) = delete;
  SimStream& operator=(const SimStream&) = delete;

  void enqueue(const SimOp& op);
  bool is_own_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  void loop();
  void run_one(const SimOp& op, std::int64_t enqueued_at);
  void complete(std::uint64_t token);

  const StreamId id_;
  const StreamEnv env_;

  // An op and when it was enqueued (the model's clock): the earliest it may start.
  struct Queued {
    SimOp op;
    std::int64_t at = 0;
  };

  std::mutex mu_;
  std::condition_variable work_;
  OpRing<Queued> queue_;   // guarded by mu_
  bool stopping_ = false;  // guarded by mu_

  // Touched only by the stream thread.
  std::int64_t device_ns_ = 0;  // op time since the last notify
  // Where this stream's previous op ended on the contention model's time axis:
  // a kernel queued behind it starts there, as on a GPU, not when the thread wakes.
  std::int64_t cursor_ = 0;
  int status_ = 0;  // first error since the last notify

  std::thread thread_;  // last: starts after everything it uses exists
};

}  // namespace salus::vgpu::sim
