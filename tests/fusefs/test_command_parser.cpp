// Unit tests for the command-language parser: every command's happy path, line
// handling, a table of rejected inputs, and a seeded random-input robustness run.
#include <gtest/gtest.h>

#include <bit>
#include <cerrno>
#include <chrono>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include "fusefs/command_parser.hpp"

namespace salus::fusefs {
namespace {

using namespace std::string_literals;
using vgpu::LaunchArg;
using vgpu::TransferCmd;

constexpr arena::Bytes kKiB = 1024, kMiB = kKiB * 1024, kGiB = kMiB * 1024, kTiB = kGiB * 1024;

// The single command of `text`, or nullptr (with a test failure) if parsing
// failed, produced a different number of commands, or a different type.
template <typename T>
const T* single(const ParseResult& r) {
  EXPECT_FALSE(r.error.has_value()) << (r.error ? r.error->message : "");
  EXPECT_EQ(r.commands.size(), 1u);
  if (r.error || r.commands.size() != 1) return nullptr;
  const T* cmd = std::get_if<T>(&r.commands[0].command);
  EXPECT_NE(cmd, nullptr) << "wrong command type, index " << r.commands[0].command.index();
  return cmd;
}

// ---- happy paths -----------------------------------------------------------

TEST(CommandParser, NeedRequiredOnly) {
  const auto r = parse_commands("need persistent=64M ephemeral=1.5G\n");
  const auto* c = single<vgpu::NeedCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->persistent, 64 * kMiB);
  EXPECT_EQ(c->ephemeral, kGiB + kGiB / 2);
  EXPECT_FALSE(c->iters);
  EXPECT_FALSE(c->priority);
  EXPECT_FALSE(c->gpu);
  EXPECT_FALSE(c->name);
}

TEST(CommandParser, NeedEveryOptionAnyOrder) {
  const auto r = parse_commands(
      "need name=train-1.a gpu=3 priority=-7 iters=1000 ephemeral=2G persistent=512MiB");
  const auto* c = single<vgpu::NeedCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->persistent, 512 * kMiB);
  EXPECT_EQ(c->ephemeral, 2 * kGiB);
  EXPECT_EQ(c->iters, 1000u);
  EXPECT_EQ(c->priority, -7);
  EXPECT_EQ(c->gpu, 3);
  EXPECT_EQ(c->name, "train-1.a");
}

TEST(CommandParser, NeedGpuAnyAndLimits) {
  auto r = parse_commands("need persistent=0 ephemeral=0 gpu=any priority=2147483647");
  auto* c = single<vgpu::NeedCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->gpu, vgpu::kAnyGpu);
  EXPECT_EQ(c->priority, 2147483647);
  EXPECT_EQ(c->persistent, 0u);

  r = parse_commands("need persistent=8T ephemeral=1 gpu=1023 priority=-2147483648");
  c = single<vgpu::NeedCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->gpu, 1023);
  EXPECT_EQ(c->priority, INT32_MIN);
  EXPECT_EQ(c->persistent, 8 * kTiB);
  EXPECT_FALSE(c->attached.has_value());

  r = parse_commands("need persistent=1 ephemeral=1 kind=attached");
  c = single<vgpu::NeedCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->attached, true);
  r = parse_commands("need persistent=1 ephemeral=1 kind=hosted");
  c = single<vgpu::NeedCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->attached, false);
}

TEST(CommandParser, AttachWithTheLaneAsRoom) {
  auto r = parse_commands("attach gate=3 bell=4 lane=5 lane_room=1");
  auto* c = single<vgpu::AttachCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->lane_fd, 5);
  EXPECT_TRUE(c->lane_room);
  r = parse_commands("attach gate=3 bell=4 lane=5");
  c = single<vgpu::AttachCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_FALSE(c->lane_room);
}

TEST(CommandParser, AllocAndFree) {
  auto r = parse_commands("alloc weights 64M");
  const auto* a = single<vgpu::AllocCmd>(r);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->name, "weights");
  EXPECT_EQ(a->size, 64 * kMiB);

  r = parse_commands("free weights");
  const auto* f = single<vgpu::FreeCmd>(r);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->name, "weights");
}

TEST(CommandParser, BeginEndRun) {
  const auto r = parse_commands("begin\nend\nbegin\nend x12\nrun 100000\n");
  ASSERT_FALSE(r.error);
  ASSERT_EQ(r.commands.size(), 5u);
  EXPECT_TRUE(std::holds_alternative<vgpu::BeginCmd>(r.commands[0].command));
  EXPECT_EQ(std::get<vgpu::EndCmd>(r.commands[1].command).repeat, 1u);
  EXPECT_EQ(std::get<vgpu::EndCmd>(r.commands[3].command).repeat, 12u);
  EXPECT_EQ(std::get<vgpu::RunCmd>(r.commands[4].command).count, 100000u);
}

TEST(CommandParser, FillDefaultsToF32) {
  const auto r = parse_commands("fill w 1.5");
  const auto* c = single<vgpu::FillCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->dst.name, "w");
  EXPECT_EQ(c->dst.offset, 0u);
  EXPECT_EQ(c->dtype, vgpu::DType::f32);
  EXPECT_EQ(c->bits, 0x3FC00000u);
  EXPECT_FALSE(c->length);
}

TEST(CommandParser, FillEveryOption) {
  auto r = parse_commands("fill w -2 dtype=f32 off=4K len=1M");
  auto* c = single<vgpu::FillCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->bits, 0xC0000000u);
  EXPECT_EQ(c->dst.offset, 4 * kKiB);
  EXPECT_EQ(c->length, kMiB);

  r = parse_commands("fill w 1e-3");
  c = single<vgpu::FillCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->bits, std::bit_cast<std::uint32_t>(1e-3f));

  // dtype= may come before or after VALUE.
  r = parse_commands("fill dtype=i32 w -1");
  c = single<vgpu::FillCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->dtype, vgpu::DType::i32);
  EXPECT_EQ(c->bits, 0xFFFFFFFFu);

  r = parse_commands("fill w 2147483647 dtype=i32");
  c = single<vgpu::FillCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->bits, 0x7FFFFFFFu);

  r = parse_commands("fill w 255 len=10 dtype=u8 off=0");
  c = single<vgpu::FillCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->dtype, vgpu::DType::u8);
  EXPECT_EQ(c->bits, 255u);
  EXPECT_EQ(c->length, 10u);
}

TEST(CommandParser, Copy) {
  auto r = parse_commands("copy dst+1K src+2M 4K");
  auto* c = single<vgpu::CopyCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->dst.name, "dst");
  EXPECT_EQ(c->dst.offset, kKiB);
  EXPECT_EQ(c->src.name, "src");
  EXPECT_EQ(c->src.offset, 2 * kMiB);
  EXPECT_EQ(c->length, 4 * kKiB);

  r = parse_commands("copy a b 1");
  c = single<vgpu::CopyCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->dst.offset, 0u);
  EXPECT_EQ(c->src.offset, 0u);
  EXPECT_EQ(c->length, 1u);
}

TEST(CommandParser, Spin) {
  auto r = parse_commands("spin 500");
  auto* c = single<vgpu::SpinCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->usec, 500u);
  EXPECT_EQ(c->util, 1.0);

  r = parse_commands("spin 0 util=0.25");
  c = single<vgpu::SpinCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->usec, 0u);
  EXPECT_EQ(c->util, 0.25);

  r = parse_commands("spin util=1 3600000000");
  c = single<vgpu::SpinCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->usec, 3600000000u);
  EXPECT_EQ(c->util, 1.0);
}

TEST(CommandParser, Gemm) {
  const auto r = parse_commands("gemm 1024 1 65536 a b c");
  const auto* c = single<vgpu::GemmCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->m, 1024u);
  EXPECT_EQ(c->n, 1u);
  EXPECT_EQ(c->k, 65536u);
  EXPECT_EQ(c->a, "a");
  EXPECT_EQ(c->b, "b");
  EXPECT_EQ(c->c, "c");
}

TEST(CommandParser, BareCommands) {
  const auto r = parse_commands("sync\nreset\n");
  ASSERT_FALSE(r.error);
  ASSERT_EQ(r.commands.size(), 2u);
  EXPECT_TRUE(std::holds_alternative<vgpu::SyncCmd>(r.commands[0].command));
  EXPECT_TRUE(std::holds_alternative<vgpu::ResetCmd>(r.commands[1].command));
}

TEST(CommandParser, Priority) {
  auto r = parse_commands("priority -5");
  auto* c = single<vgpu::PriorityCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->priority, -5);
  r = parse_commands("priority 0");
  c = single<vgpu::PriorityCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->priority, 0);
}

TEST(CommandParser, Module) {
  const auto r = parse_commands("module kern.v2 /opt/kernels/my kernels#1.cubin");
  // A space splits tokens, so that path is two tokens: an error.
  ASSERT_TRUE(r.error);
  const auto r2 = parse_commands("module kern.v2 /opt/kernels/k#1.cubin");
  const auto* c = single<vgpu::ModuleCmd>(r2);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->name, "kern.v2");
  EXPECT_EQ(c->path, "/opt/kernels/k#1.cubin");
}

TEST(CommandParser, LaunchEveryArgKind) {
  const auto r = parse_commands(
      "launch kern.v2.saxpy grid=128,2,3 block=256 smem=48K x y+4K i32:-1 u32:0xffffffff "
      "i64:-9223372036854775808 u64:18446744073709551615 f32:2.5 f64:-0.125");
  const auto* c = single<vgpu::LaunchCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->module, "kern.v2");
  EXPECT_EQ(c->function, "saxpy");
  EXPECT_EQ(c->grid[0], 128u);
  EXPECT_EQ(c->grid[1], 2u);
  EXPECT_EQ(c->grid[2], 3u);
  EXPECT_EQ(c->block[0], 256u);
  EXPECT_EQ(c->block[1], 1u);
  EXPECT_EQ(c->block[2], 1u);
  EXPECT_EQ(c->shared_mem, 48u * 1024);
  ASSERT_EQ(c->args.size(), 8u);
  EXPECT_EQ(c->args[0].kind, LaunchArg::Kind::buffer);
  EXPECT_EQ(c->args[0].buffer.name, "x");
  EXPECT_EQ(c->args[0].buffer.offset, 0u);
  EXPECT_EQ(c->args[1].kind, LaunchArg::Kind::buffer);
  EXPECT_EQ(c->args[1].buffer.name, "y");
  EXPECT_EQ(c->args[1].buffer.offset, 4 * kKiB);
  EXPECT_EQ(c->args[2].kind, LaunchArg::Kind::i32);
  EXPECT_EQ(c->args[2].bits, 0xFFFFFFFFu);  // zero-extended
  EXPECT_EQ(c->args[3].kind, LaunchArg::Kind::u32);
  EXPECT_EQ(c->args[3].bits, 0xFFFFFFFFu);
  EXPECT_EQ(c->args[4].kind, LaunchArg::Kind::i64);
  EXPECT_EQ(c->args[4].bits, 0x8000000000000000u);
  EXPECT_EQ(c->args[5].kind, LaunchArg::Kind::u64);
  EXPECT_EQ(c->args[5].bits, ~0ULL);
  EXPECT_EQ(c->args[6].kind, LaunchArg::Kind::f32);
  EXPECT_EQ(c->args[6].bits, std::bit_cast<std::uint32_t>(2.5f));
  EXPECT_EQ(c->args[7].kind, LaunchArg::Kind::f64);
  EXPECT_EQ(c->args[7].bits, std::bit_cast<std::uint64_t>(-0.125));
}

TEST(CommandParser, LaunchMinimalAndMaxArgs) {
  auto r = parse_commands("launch m.f block=2147483647,1,1 grid=1");
  auto* c = single<vgpu::LaunchCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->block[0], 2147483647u);
  EXPECT_EQ(c->shared_mem, 0u);
  EXPECT_TRUE(c->args.empty());

  std::string line = "launch m._f9 grid=1 block=1";
  for (int i = 0; i < 64; ++i) line += " u32:" + std::to_string(i);
  r = parse_commands(line);
  c = single<vgpu::LaunchCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->function, "_f9");
  ASSERT_EQ(c->args.size(), 64u);
  EXPECT_EQ(c->args[63].bits, 63u);
}

TEST(CommandParser, UploadDownloadShm) {
  auto r = parse_commands("upload w+1K shm:seg.0+2K 4M");
  auto* c = single<TransferCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->direction, TransferCmd::Direction::upload);
  EXPECT_EQ(c->buffer.name, "w");
  EXPECT_EQ(c->buffer.offset, kKiB);
  EXPECT_EQ(c->endpoint, TransferCmd::Endpoint::shm);
  EXPECT_EQ(c->source, "seg.0");
  EXPECT_EQ(c->source_offset, 2 * kKiB);
  EXPECT_EQ(c->length, 4 * kMiB);

  r = parse_commands("download w shm:seg 1");
  c = single<TransferCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->direction, TransferCmd::Direction::download);
  EXPECT_EQ(c->source, "seg");
  EXPECT_EQ(c->source_offset, 0u);
  EXPECT_EQ(c->buffer.offset, 0u);
}

TEST(CommandParser, UploadDownloadFile) {
  auto r = parse_commands("upload w file:/data/x.bin+1M 64K");
  auto* c = single<TransferCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->endpoint, TransferCmd::Endpoint::file);
  EXPECT_EQ(c->source, "/data/x.bin");
  EXPECT_EQ(c->source_offset, kMiB);
  EXPECT_EQ(c->length, 64 * kKiB);

  // A '+' that is not followed by a size stays in the path.
  r = parse_commands("download w+8 file:/data/c++/out+v2 16");
  c = single<TransferCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->direction, TransferCmd::Direction::download);
  EXPECT_EQ(c->buffer.offset, 8u);
  EXPECT_EQ(c->source, "/data/c++/out+v2");
  EXPECT_EQ(c->source_offset, 0u);

  // Only the last '+SIZE' is the offset.
  r = parse_commands("upload w file:/a+1+2 1");
  c = single<TransferCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->source, "/a+1");
  EXPECT_EQ(c->source_offset, 2u);

  // Non-ASCII paths are fine as long as they are UTF-8.
  r = parse_commands("upload w file:/data/\xC3\xA9t\xC3\xA9.bin 1");
  c = single<TransferCmd>(r);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->source, "/data/\xC3\xA9t\xC3\xA9.bin");
}

// ---- lines, comments, whitespace -----------------------------------------

TEST(CommandParser, EmptyInput) {
  for (const char* text : {"", "\n", "\n\n\n", "   \t \n", "# only a comment", "\r\n"}) {
    const auto r = parse_commands(text);
    EXPECT_FALSE(r.error) << text;
    EXPECT_TRUE(r.commands.empty()) << text;
  }
}

TEST(CommandParser, MultiLineWithCommentsAndLineNumbers) {
  const auto r = parse_commands(
      "# a training step\n"
      "need persistent=1G ephemeral=2G   # declare\n"
      "\n"
      "alloc w 64M\n"
      "\t  begin\t\n"
      "  # inside\n"
      "fill w 0 # zero it\n"
      "end x3\n"
      "run 10");  // no trailing newline
  ASSERT_FALSE(r.error) << r.error->message;
  ASSERT_EQ(r.commands.size(), 6u);
  const std::uint32_t lines[] = {2, 4, 5, 7, 8, 9};
  for (std::size_t i = 0; i < 6; ++i) EXPECT_EQ(r.commands[i].line, lines[i]) << i;
  EXPECT_EQ(std::get<vgpu::RunCmd>(r.commands[5].command).count, 10u);
}

TEST(CommandParser, CrLfLineEndings) {
  const auto r = parse_commands("alloc w 1K\r\nfree w\r\nsync\r");
  ASSERT_FALSE(r.error) << r.error->message;
  ASSERT_EQ(r.commands.size(), 3u);
  EXPECT_EQ(std::get<vgpu::FreeCmd>(r.commands[1].command).name, "w");
}

TEST(CommandParser, HashInsideTokenIsNotAComment) {
  const auto r = parse_commands("alloc w#1 4K");
  ASSERT_TRUE(r.error);
  EXPECT_NE(r.error->message.find("'w#1'"), std::string::npos) << r.error->message;
}

TEST(CommandParser, CommandsBeforeTheBadLineAreReturned) {
  const auto r = parse_commands(
      "alloc a 1K\n"
      "# comment\n"
      "alloc b 2K\n"
      "\n"
      "alloc c 0x10\n"
      "alloc d 4K\n");
  ASSERT_TRUE(r.error);
  EXPECT_EQ(r.error->line, 5u);
  EXPECT_EQ(r.error->error, EINVAL);
  ASSERT_EQ(r.commands.size(), 2u);
  EXPECT_EQ(std::get<vgpu::AllocCmd>(r.commands[0].command).name, "a");
  EXPECT_EQ(r.commands[0].line, 1u);
  EXPECT_EQ(std::get<vgpu::AllocCmd>(r.commands[1].command).name, "b");
  EXPECT_EQ(r.commands[1].line, 3u);
}

TEST(CommandParser, ExactMessages) {
  auto r = parse_commands("sync\nfrobnicate now\n");
  ASSERT_TRUE(r.error);
  EXPECT_EQ(r.error->message, "line 2: unknown command 'frobnicate'");

  r = parse_commands("need persistent=1G\n");
  ASSERT_TRUE(r.error);
  EXPECT_EQ(r.error->message, "line 1: need: missing ephemeral=");

  r = parse_commands("sync\nsync\nsync\nneed persistent=1G ephemeral=abc\n");
  ASSERT_TRUE(r.error);
  EXPECT_EQ(r.error->message, "line 4: bad size 'abc' for ephemeral=");

  r = parse_commands("\n\nalloc w -5M");
  ASSERT_TRUE(r.error);
  EXPECT_EQ(r.error->message.rfind("line 3: size must not be negative: '-5M'", 0), 0u)
      << r.error->message;

  r = parse_commands("sync\n\xFF");
  ASSERT_TRUE(r.error);
  EXPECT_EQ(r.error->message, "line 2: invalid UTF-8");

  r = parse_commands("a\0b"s);
  ASSERT_TRUE(r.error);
  EXPECT_EQ(r.error->message, "line 1: embedded NUL byte");
}

TEST(CommandParser, MessagesEscapeControlBytesAndTruncate) {
  auto r = parse_commands("alloc w\x1b[31m 1K");
  ASSERT_TRUE(r.error);
  EXPECT_NE(r.error->message.find("w\\x1b[31m"), std::string::npos) << r.error->message;

  r = parse_commands("x" + std::string(4000, 'y'));
  ASSERT_TRUE(r.error);
  EXPECT_LT(r.error->message.size(), 200u);
  EXPECT_NE(r.error->message.find("..."), std::string::npos);
}

TEST(CommandParser, LongestLineIsAccepted) {
  std::string line = "spin 1";
  line += std::string(kMaxLineLength - line.size() - 2, ' ') + "#x";
  ASSERT_EQ(line.size(), kMaxLineLength);
  const auto r = parse_commands(line + "\r\n");
  EXPECT_FALSE(r.error) << r.error->message;
  EXPECT_EQ(r.commands.size(), 1u);
}

TEST(CommandParser, ValidUtf8IsAccepted) {
  // 2-, 3- and 4-byte characters at the edges of their ranges.
  const auto r = parse_commands(
      "# \xC2\x80 \xDF\xBF \xE0\xA0\x80 \xED\x9F\xBF \xEE\x80\x80 \xEF\xBF\xBF "
      "\xF0\x90\x80\x80 \xF4\x8F\xBF\xBF\nsync # caf\xC3\xA9 \xF0\x9F\x98\x80");
  EXPECT_FALSE(r.error) << r.error->message;
  EXPECT_EQ(r.commands.size(), 1u);
}

// ---- rejected inputs -------------------------------------------------------

struct BadCase {
  const char* label;
  std::string text;
  int error;
  std::uint32_t line;
  std::string expect_in_message;
};

// Keeps gtest from dumping the struct's bytes when a case fails.
void PrintTo(const BadCase& c, std::ostream* os) {
  *os << c.label;
}

std::string launch_with_args(int n) {
  std::string s = "launch m.f grid=1 block=1";
  for (int i = 0; i < n; ++i) s += " a" + std::to_string(i);
  return s;
}

const BadCase kBadCases[] = {
    {"UnknownCommand", "frobnicate", EINVAL, 1, "unknown command 'frobnicate'"},
    {"UppercaseKeyword", "SYNC", EINVAL, 1, "unknown command 'SYNC'"},
    {"BadSize", "need persistent=abc ephemeral=1G", EINVAL, 1, "bad size 'abc' for persistent="},
    {"BadSizeSuffix", "alloc w 12Q", EINVAL, 1, "bad size '12Q'"},
    {"FractionalByteSize", "alloc w 1.5", EINVAL, 1, "bad size '1.5'"},
    {"EmptyOptionValue", "need persistent= ephemeral=1G", EINVAL, 1, "bad size '' for persistent="},
    {"NegativeSize", "sync\nsync\nalloc w -5M", EINVAL, 3, "size must not be negative: '-5M'"},
    {"NegativeRun", "run -3", EINVAL, 1, "must not be negative: '-3'"},
    {"NegativeGpu", "need persistent=1 ephemeral=1 gpu=-1", EINVAL, 1, "negative: '-1' for gpu="},
    {"NegativeOffset", "copy a+-1K b 1", EINVAL, 1, "negative: 'a+-1K'"},
    {"NegativeU8", "fill w -1 dtype=u8", EINVAL, 1, "negative: '-1'"},
    {"NegativeUtil", "spin 1 util=-0.5", EINVAL, 1, "negative: '-0.5'"},
    {"OverflowRun", "run 99999999999999999999", ERANGE, 1, "'99999999999999999999'"},
    {"OverflowSizeSuffix", "alloc w 20000000T", ERANGE, 1, "out of range: '20000000T'"},
    {"OverflowSizePlain", "need persistent=99999999999999999999 ephemeral=1", ERANGE, 1,
     "out of range: '99999999999999999999' for persistent="},
    {"OverflowIters", "need persistent=1 ephemeral=1 iters=18446744073709551616", ERANGE, 1,
     "iters="},
    {"UnknownKey", "need persistent=1G ephemeral=1G color=red", EINVAL, 1,
     "unknown option 'color=red'"},
    {"UnknownFillKey", "fill w 1 stride=2", EINVAL, 1, "unknown option 'stride=2'"},
    {"DuplicateKey", "need persistent=1G persistent=2G ephemeral=1G", EINVAL, 1,
     "duplicate option 'persistent=2G'"},
    {"DuplicateUtil", "spin 5 util=0.5 util=0.5", EINVAL, 1, "duplicate option 'util=0.5'"},
    {"MissingEphemeral", "need persistent=1G", EINVAL, 1, "need: missing ephemeral="},
    {"MissingPersistent", "need ephemeral=1G", EINVAL, 1, "need: missing persistent="},
    {"NeedPositional", "need 1G 2G", EINVAL, 1, "unexpected token '1G'"},
    {"TrailingJunkSync", "sync now", EINVAL, 1, "unexpected token 'now'"},
    {"TrailingJunkAlloc", "alloc w 1M extra", EINVAL, 1, "unexpected token 'extra'"},
    {"TrailingJunkEnd", "end x2 x3", EINVAL, 1, "unexpected token 'x3'"},
    {"MissingSize", "alloc w", EINVAL, 1, "alloc: missing SIZE"},
    {"MissingRunCount", "run", EINVAL, 1, "run: missing N"},
    {"BadNameChars", "alloc w/x 1M", EINVAL, 1, "bad character in name 'w/x'"},
    {"BadNameUnicode", "free caf\xC3\xA9", EINVAL, 1, "bad character in name 'caf\xC3\xA9'"},
    {"NameTooLong", "alloc " + std::string(65, 'n') + " 1M", EINVAL, 1, "name too long"},
    {"NameLeadingDot", "free ..", EINVAL, 1, "must not start with '.': '..'"},
    {"BadNeedName", "need persistent=1 ephemeral=1 name=a:b", EINVAL, 1, "'a:b' for name="},
    {"BadNeedKind", "need persistent=1 ephemeral=1 kind=gpu", EINVAL, 1,
     "need: bad kind 'gpu': expected hosted or attached"},
    {"LaneRoomWithoutLane", "attach gate=3 bell=4 lane_room=1", EINVAL, 1,
     "attach: lane_room=1 without lane="},
    {"LaneRoomNotABool", "attach gate=3 bell=4 lane=5 lane_room=2", ERANGE, 1,
     "'2' for lane_room="},
    {"EndX0", "end x0", ERANGE, 1, "'0' for end xN"},
    {"EndWithoutX", "end 3", EINVAL, 1, "'3' (expected xN)"},
    {"EndBareX", "end x", EINVAL, 1, "for end xN"},
    {"EndSpacedX", "end x 3", EINVAL, 1, "bad number '' for end xN"},
    {"Run0", "run 0", ERANGE, 1, "out of range: '0' for run N"},
    {"RunHex", "run 0x10", EINVAL, 1, "bad number '0x10'"},
    {"RunLeadingPlus", "run +5", EINVAL, 1, "bad number '+5'"},
    {"Alloc0", "alloc w 0", ERANGE, 1, "out of range: '0' for alloc SIZE"},
    {"Util0", "spin 10 util=0", ERANGE, 1, "out of range: '0' for util="},
    {"Util1p5", "spin 10 util=1.5", ERANGE, 1, "out of range: '1.5' for util="},
    {"UtilNotANumber", "spin 10 util=nan", EINVAL, 1, "'nan' for util="},
    {"SpinTooLong", "spin 3600000001", ERANGE, 1, "'3600000001' for spin USEC"},
    {"SpinMissing", "spin util=0.5", EINVAL, 1, "spin: missing USEC"},
    {"Utf8LoneContinuation", "sync # \x80", EINVAL, 1, "invalid UTF-8"},
    {"Utf8Overlong2", "alloc \xC0\xAF 1K", EINVAL, 1, "invalid UTF-8"},
    {"Utf8Overlong3", "sync\n\xE0\x80\xAF", EINVAL, 2, "invalid UTF-8"},
    {"Utf8Overlong4", "\xF0\x80\x80\xAF", EINVAL, 1, "invalid UTF-8"},
    {"Utf8Surrogate", "free \xED\xA0\x80", EINVAL, 1, "invalid UTF-8"},
    {"Utf8AboveMax", "# \xF4\x90\x80\x80", EINVAL, 1, "invalid UTF-8"},
    {"Utf8TruncatedAtEnd", "sync # \xE2\x82", EINVAL, 1, "invalid UTF-8"},
    {"Utf8TruncatedMidLine", "sync # \xE2\x82 x", EINVAL, 1, "invalid UTF-8"},
    {"Utf8ByteFF", "sync\nsync\n\xFF", EINVAL, 3, "invalid UTF-8"},
    {"Utf8LeadF5", "# \xF5\x80\x80\x80", EINVAL, 1, "invalid UTF-8"},
    {"EmbeddedNul", "sync\nalloc w\0 1K"s, EINVAL, 2, "embedded NUL byte"},
    {"NulInComment", "sync # \0"s, EINVAL, 1, "embedded NUL byte"},
    {"OverlongLine", "sync\n# " + std::string(kMaxLineLength, 'x'), EINVAL, 2, "line too long"},
    {"BadDtype", "fill w 1 dtype=f64", EINVAL, 1, "bad dtype 'f64'"},
    {"U8Is256", "fill w 256 dtype=u8", ERANGE, 1, "out of range: '256'"},
    {"I32Overflow", "fill w 2147483648 dtype=i32", ERANGE, 1, "out of range: '2147483648'"},
    {"I32Underflow", "fill w -2147483649 dtype=i32", ERANGE, 1, "'-2147483649'"},
    {"I32NotInteger", "fill w 1.5 dtype=i32", EINVAL, 1, "bad number '1.5'"},
    {"F32Overflow", "fill w 1e39", ERANGE, 1, "'1e39'"},
    {"F32Junk", "fill w 1.5x", EINVAL, 1, "bad f32 value '1.5x'"},
    {"F32Inf", "fill w inf", EINVAL, 1, "bad f32 value 'inf'"},
    {"FillMissingValue", "fill w dtype=u8", EINVAL, 1, "fill: missing VALUE"},
    {"FillLen0", "fill w 1 len=0", ERANGE, 1, "'0' for len="},
    {"BufferOffsetEmpty", "copy a+ b 1K", EINVAL, 1, "bad offset 'a+' for copy DST"},
    {"BufferOffsetJunk", "copy a b+x 1K", EINVAL, 1, "bad offset 'b+x' for copy SRC"},
    {"BufferOffsetTwice", "copy a+1+2 b 1K", EINVAL, 1, "bad offset 'a+1+2'"},
    {"BufferNameEmpty", "copy +5 b 1K", EINVAL, 1, "empty name for copy DST"},
    {"CopyLen0", "copy a b 0", ERANGE, 1, "for copy LEN"},
    {"GemmTooBig", "gemm 65537 1 1 a b c", ERANGE, 1, "'65537' for gemm M"},
    {"GemmZero", "gemm 1 1 0 a b c", ERANGE, 1, "'0' for gemm K"},
    {"GemmMissingC", "gemm 1 1 1 a b", EINVAL, 1, "gemm: missing C"},
    {"PriorityOverflow", "priority 2147483648", ERANGE, 1, "'2147483648' for priority N"},
    {"PriorityPlus", "priority +1", EINVAL, 1, "bad number '+1'"},
    {"GpuTooHigh", "need persistent=1 ephemeral=1 gpu=1024", ERANGE, 1, "'1024' for gpu="},
    {"IterZero", "need persistent=1 ephemeral=1 iters=0", ERANGE, 1, "'0' for iters="},
    {"RelativeModulePath", "module m lib/k.so", EINVAL, 1, "path must be absolute: 'lib/k.so'"},
    {"ModulePathControlChar", "module m /a\x01b", EINVAL, 1, "control character in path"},
    {"ModuleMissingPath", "module m", EINVAL, 1, "module: missing PATH"},
    {"TooManyLaunchArgs", launch_with_args(65), EINVAL, 1, "too many arguments (max 64) at 'a64'"},
    {"BadLaunchArgType", "launch m.f grid=1 block=1 x16:5", EINVAL, 1, "bad argument type 'x16'"},
    {"LaunchU32Overflow", "launch m.f grid=1 block=1 u32:4294967296", ERANGE, 1,
     "'4294967296' for launch u32:"},
    {"LaunchU64Negative", "launch m.f grid=1 block=1 u64:-1", EINVAL, 1, "negative: '-1'"},
    {"LaunchF64Nan", "launch m.f grid=1 block=1 f64:nan", EINVAL, 1, "bad f64 value 'nan'"},
    {"LaunchMissingGrid", "launch m.f block=1", EINVAL, 1, "launch: missing grid="},
    {"LaunchGridZero", "launch m.f grid=0 block=1", ERANGE, 1, "'0' for grid="},
    {"LaunchBlockTooBig", "launch m.f grid=1 block=1,2147483648", ERANGE, 1, "'2147483648'"},
    {"LaunchFourDims", "launch m.f grid=1,1,1,1 block=1", EINVAL, 1, "bad dimensions '1,1,1,1'"},
    {"LaunchEmptyDim", "launch m.f grid=1,,1 block=1", EINVAL, 1, "bad number '' for grid="},
    {"LaunchNoDot", "launch kernel grid=1 block=1", EINVAL, 1, "expected MOD.FUNC, got 'kernel'"},
    {"LaunchBadFunction", "launch m.9f grid=1 block=1", EINVAL, 1, "bad function name '9f'"},
    {"LaunchBadModule", "launch .f grid=1 block=1", EINVAL, 1, "empty name for launch MOD"},
    {"LaunchSmemTooBig", "launch m.f grid=1 block=1 smem=4G", ERANGE, 1, "'4G' for smem="},
    {"UploadBadEndpoint", "upload w http:x 1K", EINVAL, 1, "expected shm:SEG or file:PATH"},
    {"UploadRelativeFile", "upload w file:data.bin 1K", EINVAL, 1,
     "path must be absolute: 'data.bin'"},
    {"UploadBadSegment", "download w shm:a/b 1K", EINVAL, 1, "bad character in name 'a/b'"},
    {"UploadLen0", "upload w shm:s 0", ERANGE, 1, "for upload LEN"},
    {"DownloadMissingLen", "download w shm:s", EINVAL, 1, "download: missing LEN"},
    {"FirstErrorWins", "alloc a 1K\nrun 0\nfrobnicate", ERANGE, 2, "run N"},
};

class BadInput : public testing::TestWithParam<BadCase> {};

TEST_P(BadInput, IsRejected) {
  const BadCase& c = GetParam();
  const auto r = parse_commands(c.text);
  ASSERT_TRUE(r.error.has_value()) << "accepted: " << c.text;
  EXPECT_EQ(r.error->error, c.error) << r.error->message;
  EXPECT_EQ(r.error->line, c.line) << r.error->message;
  const std::string prefix = "line " + std::to_string(c.line) + ": ";
  EXPECT_EQ(r.error->message.rfind(prefix, 0), 0u) << r.error->message;
  EXPECT_NE(r.error->message.find(c.expect_in_message), std::string::npos)
      << "message: " << r.error->message << "\nwanted: " << c.expect_in_message;
  EXPECT_EQ(r.error->message.find('\n'), std::string::npos);
  EXPECT_EQ(r.commands.size(), c.line - 1u) << "every earlier line here is one good command";
}

INSTANTIATE_TEST_SUITE_P(CommandParser, BadInput, testing::ValuesIn(kBadCases),
                         [](const testing::TestParamInfo<BadCase>& info) {
                           return std::string(info.param.label);
                         });

// ---- robustness ------------------------------------------------------------

// Checks the invariants every result must satisfy, whatever the input.
void check_result(const std::string& text, const ParseResult& r) {
  std::uint32_t lines = 1;
  for (const char ch : text) lines += ch == '\n';
  std::uint32_t previous = 0;
  for (const auto& c : r.commands) {
    ASSERT_GT(c.line, previous);
    ASSERT_LE(c.line, lines);
    previous = c.line;
  }
  if (r.error) {
    ASSERT_GE(r.error->line, 1u);
    ASSERT_LE(r.error->line, lines);
    ASSERT_GT(r.error->line, previous);
    ASSERT_TRUE(r.error->error == EINVAL || r.error->error == ERANGE) << r.error->error;
    const std::string prefix = "line " + std::to_string(r.error->line) + ": ";
    ASSERT_EQ(r.error->message.rfind(prefix, 0), 0u) << r.error->message;
    ASSERT_EQ(r.error->message.find('\n'), std::string::npos);
  }
}

TEST(CommandParser, RandomInputsNeverCrash) {
  static const char* const kValid[] = {
      "need persistent=1G ephemeral=2G iters=10 priority=-1 gpu=any name=j",
      "alloc w 64M",
      "free w",
      "begin",
      "end x3",
      "run 100000",
      "fill w 1.5 dtype=f32 off=4K len=1M",
      "fill w 7 dtype=u8",
      "copy a+1K b+2K 4K",
      "spin 100 util=0.5",
      "gemm 64 64 64 a b c",
      "sync",
      "priority 3",
      "reset",
      "module m /opt/k.cubin",
      "launch m.f grid=1,2,3 block=256 smem=1K a b+4 i32:-1 u64:0x10 f32:1 f64:2",
      "upload w+1K shm:s+2K 1M",
      "download w file:/tmp/x+8 16",
      "# comment",
      "",
  };
  static const char kAlphabet[] =
      " \t\n\r#=+-.,:/0123456789xKMGTiBaefnuz_\x80\xBF\xC2\xE0\xED\xF0\xF4\xFF";
  std::mt19937_64 rng(20240611);
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  std::size_t with_error = 0;
  for (int iter = 0; iter < 100000; ++iter) {
    std::string text;
    if (iter % 2 == 0) {
      // Random bytes, half the time from an alphabet that reaches deeper into the grammar.
      const std::size_t len = pick(120);
      const bool alphabet = pick(2) == 0;
      for (std::size_t i = 0; i < len; ++i) {
        text.push_back(alphabet ? kAlphabet[pick(sizeof(kAlphabet) - 1)]
                                : static_cast<char>(pick(256)));
      }
    } else {
      // A few valid lines, then a few byte-level mutations.
      const std::size_t lines = 1 + pick(4);
      for (std::size_t i = 0; i < lines; ++i) {
        text += kValid[pick(std::size(kValid))];
        text += '\n';
      }
      const std::size_t mutations = pick(4);
      for (std::size_t m = 0; m < mutations && !text.empty(); ++m) {
        const std::size_t at = pick(text.size());
        switch (pick(5)) {
          case 0:
            text[at] = static_cast<char>(pick(256));
            break;
          case 1:
            text.insert(at, 1, kAlphabet[pick(sizeof(kAlphabet) - 1)]);
            break;
          case 2:
            text.erase(at, 1 + pick(4));
            break;
          case 3:
            text.insert(at, text.substr(at, pick(12)));
            break;
          default:
            text.insert(at, std::to_string(rng()));
            break;
        }
      }
    }
    const auto r = parse_commands(text);
    with_error += r.error.has_value();
    ASSERT_NO_FATAL_FAILURE(check_result(text, r)) << "iteration " << iter;
  }
  // Both outcomes must actually occur, or the generator is not testing much.
  EXPECT_GT(with_error, 10000u);
  EXPECT_LT(with_error, 100000u);
}

TEST(CommandParser, HotPathIsFast) {
  // Generous bound: about a microsecond is expected; this only catches a
  // pathological regression, even in unoptimized or instrumented builds.
  constexpr int kIters = 200000;
  std::size_t total = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kIters; ++i) total += parse_commands("run 100000\n").commands.size();
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(total, static_cast<std::size_t>(kIters));
  const double ns = std::chrono::duration<double, std::nano>(elapsed).count() / kIters;
  RecordProperty("ns_per_run_line", static_cast<int>(ns));
  EXPECT_LT(ns, 50000.0);
}

}  // namespace
}  // namespace salus::fusefs
