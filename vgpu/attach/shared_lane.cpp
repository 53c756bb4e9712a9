#include "vgpu/attach/shared_lane.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "client/salus_gate.h"

namespace salus::vgpu {

namespace {
constexpr Bytes kGranularity = Bytes{2} << 20;
}

Bytes lane_bytes_for(Bytes ephemeral) {
  return (ephemeral + kGranularity - 1) / kGranularity * kGranularity;
}

int send_lane_memory(int sock, int memory_fd, Bytes bytes, std::uint32_t generation,
                     std::string& why) {
  salus_lane_msg msg{};
  msg.magic = SALUS_LANE_MAGIC;
  msg.bytes = bytes;
  msg.generation = generation;
  iovec iov{&msg, sizeof msg};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&mh);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &memory_fd, sizeof(int));
  // Never blocks: a program that does not read its socket fills it, and then
  // loses the lane (EAGAIN), not salusd a thread.
  const ssize_t n = ::sendmsg(sock, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n == static_cast<ssize_t>(sizeof msg)) return 0;
  const int e = n < 0 ? errno : EIO;
  why = fmt::format("cannot send the lane memory over the program's lane socket: {}",
                    e == EAGAIN  ? "its buffer is full (the program does not read it)"
                    : e == EPIPE ? "the program closed its end"
                                 : std::strerror(e));
  return e;
}

bool process_exited(int pidfd) {
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLIN | POLLHUP)) != 0;
}

}  // namespace salus::vgpu
