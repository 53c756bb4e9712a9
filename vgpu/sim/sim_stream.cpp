#include "vgpu/sim/sim_stream.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <exception>
#include <system_error>
#include <variant>

#include <spdlog/spdlog.h>

#include "vgpu/sim/busy_meter.hpp"
#include "vgpu/sim/realtime_contention.hpp"

namespace salus::vgpu::sim {

namespace {
// The runner whose thread this is, if any (for on_own_thread).
thread_local const StreamRunner* t_runner = nullptr;
}  // namespace

StreamRunner::StreamRunner(StreamEnv env) : env_(env) {
  try {
    for (unsigned i = 0; i < kHostThreads; ++i) host_.emplace_back([this] { host_loop(); });
    clock_ = std::thread([this] { clock_loop(); });
  } catch (...) {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    work_.notify_all();
    for (auto& t : host_) t.join();
    throw;
  }
}

StreamRunner::~StreamRunner() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  work_.notify_all();
  env_.contention.stop();
  for (auto& t : host_) t.join();
  clock_.join();
}

bool StreamRunner::on_own_thread() const {
  return t_runner == this;
}

void StreamRunner::enqueue(SimStream& s, const SimOp& op) {
  std::lock_guard lock(mu_);
  const std::int64_t now = env_.contention.now();
  if (const auto* spin = std::get_if<SpinOp>(&op);
      spin && s.state == SimStream::State::idle && s.queue.empty()) {
    // A spin on an idle stream starts now, with no hop to a host thread, as a
    // GPU starts a kernel launched on an idle stream.
    start_spin(s, *spin, now);
    return;
  }
  s.queue.push(SimStream::Queued{op, now});
  // A stream that is ready, running or waiting picks the op up in its turn.
  if (s.state == SimStream::State::idle) make_ready(s);
}

void StreamRunner::drain(SimStream& s) {
  std::unique_lock lock(mu_);
  idle_.wait(lock, [&] { return s.state == SimStream::State::idle && s.queue.empty(); });
}

void StreamRunner::make_ready(SimStream& s) {
  s.state = SimStream::State::ready;
  ready_.push(&s);
  work_.notify_one();
}

void StreamRunner::go_idle(SimStream& s) {
  s.state = SimStream::State::idle;
  idle_.notify_all();
}

void StreamRunner::host_loop() {
  t_runner = this;
  std::unique_lock lock(mu_);
  for (;;) {
    work_.wait(lock, [this] { return !ready_.empty() || stopping_; });
    if (ready_.empty()) return;  // stopping, and every stream drained
    SimStream& s = *ready_.pop();
    s.state = SimStream::State::running;
    guarded(s, lock, true);
  }
}

void StreamRunner::guarded(SimStream& s, std::unique_lock<std::mutex>& lock, bool host) {
  // Ops and completion handlers catch their own; what is left is running out
  // of memory for a queue. It must not end the thread (std::terminate would
  // take salusd down): the stream is left idle and the error logged.
  try {
    drive(s, lock, host);
  } catch (const std::exception& e) {
    if (!lock.owns_lock()) lock.lock();
    spdlog::error("sim gpu{} stream {}: {}", env_.device_index, s.id, e.what());
    go_idle(s);
  }
}

void StreamRunner::clock_loop() {
  t_runner = this;
  std::vector<RealTimeContention::Finished> finished;
  for (;;) {
    finished.clear();
    try {
      if (!env_.contention.wait_finished(finished)) return;
    } catch (const std::exception& e) {  // out of memory for the list: try again
      spdlog::error("sim gpu{} clock: {}", env_.device_index, e.what());
      continue;
    }
    std::unique_lock lock(mu_);
    for (const auto& f : finished) {
      auto& s = *reinterpret_cast<SimStream*>(static_cast<std::uintptr_t>(f.tag));
      env_.busy.end();
      // A kernel's device time is its span on the model's timeline.
      s.device_ns += f.span.finish - f.span.start;
      s.cursor = f.span.finish;
      // What follows is mostly its notify and the next spin: run here, with no
      // hop to a host thread, as the stream's own thread used to.
      s.state = SimStream::State::running;
      guarded(s, lock, false);
    }
  }
}

void StreamRunner::drive(SimStream& s, std::unique_lock<std::mutex>& lock, bool host) {
  while (!s.queue.empty()) {
    SimStream::Queued& head = s.queue.front();
    if (const auto* notify = std::get_if<NotifyOp>(&head.op)) {
      const std::uint64_t token = notify->token;
      s.queue.pop();
      complete(s, lock, token);
      continue;
    }
    if (const auto* spin = std::get_if<SpinOp>(&head.op)) {
      const SpinOp op = *spin;
      const std::int64_t at = head.at;
      s.queue.pop();
      start_spin(s, op, at);
      if (s.state == SimStream::State::waiting) return;
      continue;
    }
    if (!host) {
      make_ready(s);
      return;
    }
    run_host_op(s, lock);
    // One op, then the other ready streams get their turn: a stream with a long
    // queue of copies does not hold a host thread while others wait.
    if (!s.queue.empty() && !ready_.empty()) {
      make_ready(s);
      return;
    }
  }
  go_idle(s);
}

void StreamRunner::start_spin(SimStream& s, const SpinOp& op, std::int64_t enqueued_at) {
  // A GPU starts a kernel where the stream's previous op ended, or at its launch.
  const std::int64_t ready_at = std::max(s.cursor, enqueued_at);
  const auto r = env_.contention.start(spin_alone_ns(op), spin_util(op), ready_at,
                                       reinterpret_cast<std::uintptr_t>(&s));
  if (r.finished) {
    s.device_ns += r.span.finish - r.span.start;
    s.cursor = r.span.finish;
    return;
  }
  env_.busy.begin();
  s.state = SimStream::State::waiting;  // clock_loop picks it up when it ends
}

void StreamRunner::run_host_op(SimStream& s, std::unique_lock<std::mutex>& lock) {
  const SimStream::Queued q = s.queue.pop();
  lock.unlock();
  int status = 0;
  const auto begin = env_.busy.begin();
  // An exception must not kill the thread (std::terminate would take salusd down);
  // it becomes EIO on the next notify instead.
  try {
    status = execute_op(q.op, env_.memory);
  } catch (const std::exception& e) {
    spdlog::error("sim gpu{} stream {}: op {} threw: {}", env_.device_index, s.id, q.op.index(),
                  e.what());
    status = EIO;
  } catch (...) {
    spdlog::error("sim gpu{} stream {}: op {} threw a non-standard exception", env_.device_index,
                  s.id, q.op.index());
    status = EIO;
  }
  const auto end = env_.busy.end();
  const std::int64_t now = env_.contention.now();
  lock.lock();
  // Host work (fills, copies, gemm on the CPU) takes the wall time it took.
  s.device_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(end - begin).count();
  s.cursor = now;
  if (status != 0 && s.status == 0) {
    // Log the first failure per notify interval only; a broken session would
    // otherwise flood the journal with one line per op.
    if (status != EIO)
      spdlog::warn("sim gpu{} stream {}: op {} failed: {}", env_.device_index, s.id, q.op.index(),
                   std::generic_category().message(status));
    s.status = status;
  }
}

void StreamRunner::complete(SimStream& s, std::unique_lock<std::mutex>& lock, std::uint64_t token) {
  const int status = s.status;
  const std::int64_t device_ns = s.device_ns;
  s.status = 0;
  s.device_ns = 0;
  CompletionSink* sink = env_.sink.load(std::memory_order_acquire);
  if (sink == nullptr) return;
  // Unlocked: the sink may enqueue more work. The stream stays `running`, so
  // nothing else runs its ops meanwhile and completions keep their order.
  lock.unlock();
  try {
    sink->on_complete(s.id, token, status, device_ns);
  } catch (const std::exception& e) {
    spdlog::error("sim gpu{} stream {}: completion handler threw: {}", env_.device_index, s.id,
                  e.what());
  } catch (...) {
    spdlog::error("sim gpu{} stream {}: completion handler threw", env_.device_index, s.id);
  }
  lock.lock();
}

}  // namespace salus::vgpu::sim
