// The broker's error convention (docs/style.md): a pure status is 0 or a
// positive errno, a value-or-error is the value or -errno, and "wait and run the
// line again" is never an errno.
#include <gtest/gtest.h>

#include <cerrno>

#include "vgpu/broker/broker.hpp"
#include "vgpu/sim/sim_device.hpp"

using namespace salus;
using namespace salus::vgpu;

namespace {

std::unique_ptr<Broker> make_broker() {
  std::vector<std::unique_ptr<Device>> devs;
  devs.push_back(std::make_unique<SimDevice>(0, Bytes{64} << 20));
  return std::make_unique<Broker>(std::move(devs), BrokerConfig{});
}

const Caller kRoot{0, 0, 0, true};
const Caller kAlice{1000, 1000, 0, false};

}  // namespace

TEST(BrokerErrors, RemoveBufferGivesAPositiveErrno) {
  auto b = make_broker();
  const auto id = static_cast<SessionId>(b->create_session(kAlice, ""));
  EXPECT_EQ(b->remove_buffer(id + 100, kAlice, "x"), ENOENT);  // no such session
  EXPECT_EQ(b->remove_buffer(id, Caller{2000, 2000, 0, false}, "x"), EACCES);
  EXPECT_EQ(b->remove_buffer(id, kAlice, "x"), ENOENT);  // no such buffer
  b->end_session(id);
  EXPECT_EQ(b->remove_buffer(id, kRoot, "x"), ENOENT);  // gone
}

TEST(BrokerErrors, CreateBufferGivesTheIdOrMinusErrno) {
  auto b = make_broker();
  const auto id = static_cast<SessionId>(b->create_session(kAlice, ""));
  EXPECT_EQ(b->create_buffer(id + 100, kAlice, "x"), -ENOENT);
  EXPECT_EQ(b->create_buffer(id, kAlice, "bad name"), -EINVAL);
  EXPECT_EQ(b->create_buffer(id, kAlice, "x"), -ENXIO);  // no `need` yet: no GPU
}
