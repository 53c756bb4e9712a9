#include "vgpu/sim/sim_stream.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <exception>
#include <system_error>

#include <spdlog/spdlog.h>

#include "vgpu/sim/busy_meter.hpp"
#include "vgpu/sim/realtime_contention.hpp"

namespace salus::vgpu::sim {

SimStream::SimStream(StreamId id, StreamEnv env)
    : id_(id), env_(env), thread_([this] { loop(); }) {}

SimStream::~SimStream() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  work_.notify_one();
  thread_.join();
}

void SimStream::enqueue(const SimOp& op) {
  std::lock_guard lock(mu_);
  // The thread sleeps only on an empty queue, so only the first op needs a wake-up.
  const bool was_empty = queue_.empty();
  queue_.push(Queued{op, env_.contention.now()});
  if (was_empty) work_.notify_one();
}

void SimStream::loop() {
  for (;;) {
    Queued q;
    {
      std::unique_lock lock(mu_);
      work_.wait(lock, [this] { return !queue_.empty() || stopping_; });
      if (queue_.empty()) return;  // stopping, and drained
      q = queue_.pop();
    }
    if (const auto* notify = std::get_if<NotifyOp>(&q.op)) {
      complete(notify->token);
    } else {
      run_one(q.op, q.at);
    }
  }
}

void SimStream::run_one(const SimOp& op, std::int64_t enqueued_at) {
  int status = 0;
  KernelTiming timing;
  timing.ready_at = std::max(cursor_, enqueued_at);
  const auto begin = env_.busy.begin();
  // An exception must not kill the thread (std::terminate would take salusd down);
  // it becomes EIO on the next notify instead.
  try {
    status = execute_op(op, env_.memory, env_.contention, &timing);
  } catch (const std::exception& e) {
    spdlog::error("sim gpu{} stream {}: op {} threw: {}", env_.device_index, id_, op.index(),
                  e.what());
    status = EIO;
  } catch (...) {
    spdlog::error("sim gpu{} stream {}: op {} threw a non-standard exception", env_.device_index,
                  id_, op.index());
    status = EIO;
  }
  const auto end = env_.busy.end();
  if (timing.timed) {
    // A kernel's device time is its span on the model's timeline (see run_kernel).
    device_ns_ += timing.finish - timing.start;
    cursor_ = timing.finish;
  } else {
    // Host work (fills, copies, gemm on the CPU) takes the wall time it took.
    device_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(end - begin).count();
    cursor_ = env_.contention.now();
  }
  if (status != 0 && status_ == 0) {
    // Log the first failure per notify interval only; a broken session would
    // otherwise flood the journal with one line per op.
    if (status != EIO)
      spdlog::warn("sim gpu{} stream {}: op {} failed: {}", env_.device_index, id_, op.index(),
                   std::generic_category().message(status));
    status_ = status;
  }
}

void SimStream::complete(std::uint64_t token) {
  const int status = status_;
  const std::int64_t device_ns = device_ns_;
  status_ = 0;
  device_ns_ = 0;
  CompletionSink* sink = env_.sink.load(std::memory_order_acquire);
  if (sink == nullptr) return;
  try {
    sink->on_complete(id_, token, status, device_ns);
  } catch (const std::exception& e) {
    spdlog::error("sim gpu{} stream {}: completion handler threw: {}", env_.device_index, id_,
                  e.what());
  } catch (...) {
    spdlog::error("sim gpu{} stream {}: completion handler threw", env_.device_index, id_);
  }
}

}  // namespace salus::vgpu::sim
