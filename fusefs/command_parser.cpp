#include "fusefs/command_parser.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <climits>
#include <iterator>

#include <fmt/format.h>

#include "fusefs/command_lexer.hpp"

namespace salus::fusefs {

namespace {

using lex::NumStatus;
using vgpu::Bytes;
using vgpu::Command;

constexpr std::size_t kMaxPathLength = 4095;
constexpr std::size_t kMaxFunctionLength = 255;
constexpr std::size_t kMaxLaunchArgs = 64;
constexpr int kMaxGpuIndex = 1023;
constexpr std::uint64_t kMaxSpinUsec = 3600ULL * 1000 * 1000;
constexpr std::uint64_t kMaxGemmDim = 65536;
constexpr std::uint64_t kMaxLaunchDim = (1ULL << 31) - 1;
// Tokens quoted in messages are cut to this many bytes so that one bad
// 4 KiB token does not flood the session log.
constexpr std::size_t kMaxShownToken = 96;

// A token as it appears in an error message: control bytes escaped so the
// message stays one printable line, and long tokens shortened.
std::string show(std::string_view token) {
  std::string out;
  std::size_t n = std::min(token.size(), kMaxShownToken);
  // Back up to a character boundary so the message stays valid UTF-8.
  if (n < token.size()) {
    while (n > 0 && (static_cast<unsigned char>(token[n]) & 0xC0) == 0x80) --n;
  }
  out.reserve(n + 8);
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(token[i]);
    if (c < 0x20 || c == 0x7F) {
      fmt::format_to(std::back_inserter(out), "\\x{:02x}", c);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (n < token.size()) out += "...";
  return out;
}

bool has_control_char(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return c < 0x20 || c == 0x7F;
  });
}

bool is_c_identifier(std::string_view s) {
  if (s.empty() || s.size() > kMaxFunctionLength) return false;
  if (s[0] >= '0' && s[0] <= '9') return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
}

// Tracks which of a command's key=value options were given. Keys include the
// '=' so that they double as the label in messages ("missing ephemeral=").
template <std::size_t N>
struct Options {
  const std::array<std::string_view, N>& keys;
  std::array<bool, N> seen{};

  bool has(std::size_t i) const { return seen[i]; }
};

// Parses one line's tokens into a command; on failure fills `error` and
// returns false. All the message wording lives here.
class LineParser {
 public:
  LineParser(std::uint32_t line, std::string_view text, ParseError& error)
      : line_(line), tokens_(text), error_(error) {}

  // Returns false on error; true with `out` unset for a blank or comment line.
  bool parse(std::optional<Command>& out);

 private:
  template <typename... Args>
  bool fail(int err, fmt::format_string<Args...> format, Args&&... args) {
    error_.line = line_;
    error_.error = err;
    error_.message = fmt::format("line {}: ", line_);
    fmt::format_to(std::back_inserter(error_.message), format, std::forward<Args>(args)...);
    return false;
  }

  bool number_error(NumStatus status, std::string_view kind, std::string_view token,
                    std::string_view what, std::string_view range) {
    switch (status) {
      case NumStatus::negative:
        return fail(EINVAL, "{} must not be negative: '{}' for {}", kind, show(token), what);
      case NumStatus::range:
        return fail(ERANGE, "{} out of range: '{}' for {} ({})", kind, show(token), what, range);
      default:
        return fail(EINVAL, "bad {} '{}' for {}", kind, show(token), what);
    }
  }

  std::string_view next() { return tokens_.next(); }

  // The next positional token, or a "missing" error naming `what`.
  bool require(std::string_view what, std::string_view& token) {
    token = next();
    if (token.empty()) return fail(EINVAL, "{}: missing {}", keyword_, what);
    return true;
  }

  bool finish() {
    const std::string_view extra = next();
    if (!extra.empty()) return fail(EINVAL, "{}: unexpected token '{}'", keyword_, show(extra));
    return true;
  }

  // Matches a key=value token against `opts`; sets `index` and `value`.
  template <std::size_t N>
  bool option(std::string_view token, Options<N>& opts, std::size_t& index,
              std::string_view& value) {
    const std::size_t eq = token.find('=');
    if (eq == std::string_view::npos) {
      return fail(EINVAL, "{}: unexpected token '{}' (expected key=value)", keyword_, show(token));
    }
    const std::string_view key = token.substr(0, eq + 1);
    for (std::size_t i = 0; i < N; ++i) {
      if (opts.keys[i] != key) continue;
      if (opts.seen[i]) return fail(EINVAL, "{}: duplicate option '{}'", keyword_, show(token));
      opts.seen[i] = true;
      index = i;
      value = token.substr(eq + 1);
      return true;
    }
    return fail(EINVAL, "{}: unknown option '{}'", keyword_, show(token));
  }

  bool size(std::string_view token, std::string_view what, bool positive, Bytes& out) {
    Bytes v = 0;
    NumStatus st = lex::parse_size(token, v);
    if (st == NumStatus::ok && positive && v == 0) st = NumStatus::range;
    if (st != NumStatus::ok) {
      return number_error(st, "size", token, what,
                          positive ? "allowed 1..2^63" : "allowed 0..2^63");
    }
    out = v;
    return true;
  }

  bool unsigned_num(std::string_view token, std::string_view what, std::uint64_t lo,
                    std::uint64_t hi, std::uint64_t& out, bool allow_hex = false) {
    const NumStatus st = lex::parse_unsigned(token, lo, hi, out, allow_hex);
    if (st == NumStatus::ok) return true;
    if (st == NumStatus::range) {
      return fail(ERANGE, "number out of range: '{}' for {} (allowed {}..{})", show(token), what,
                  lo, hi);
    }
    return number_error(st, "number", token, what, {});
  }

  bool signed_num(std::string_view token, std::string_view what, std::int64_t lo, std::int64_t hi,
                  std::int64_t& out) {
    const NumStatus st = lex::parse_signed(token, lo, hi, out);
    if (st == NumStatus::ok) return true;
    if (st == NumStatus::range) {
      return fail(ERANGE, "number out of range: '{}' for {} (allowed {}..{})", show(token), what,
                  lo, hi);
    }
    return number_error(st, "number", token, what, {});
  }

  bool name(std::string_view token, std::string_view what, std::string& out) {
    if (vgpu::is_valid_name(token)) {
      out.assign(token);
      return true;
    }
    if (token.empty()) return fail(EINVAL, "empty name for {}", what);
    if (token.size() > vgpu::kMaxNameLength) {
      return fail(EINVAL, "name too long ({} bytes, max {}): '{}' for {}", token.size(),
                  vgpu::kMaxNameLength, show(token), what);
    }
    if (token[0] == '.') {
      return fail(EINVAL, "name must not start with '.': '{}' for {}", show(token), what);
    }
    return fail(EINVAL, "bad character in name '{}' for {} (allowed: A-Z a-z 0-9 _ . -)",
                show(token), what);
  }

  // NAME or NAME+OFF; names cannot contain '+', so the first '+' splits.
  bool buf_ref(std::string_view token, std::string_view what, vgpu::BufRef& out) {
    const std::size_t plus = token.find('+');
    if (!name(token.substr(0, plus), what, out.name)) return false;
    out.offset = 0;
    if (plus == std::string_view::npos) return true;
    Bytes off = 0;
    const NumStatus st = lex::parse_size(token.substr(plus + 1), off);
    if (st != NumStatus::ok) return number_error(st, "offset", token, what, "allowed 0..2^63");
    out.offset = off;
    return true;
  }

  bool path(std::string_view token, std::string_view what, std::string& out) {
    if (token.empty()) return fail(EINVAL, "empty path for {}", what);
    if (token[0] != '/') {
      return fail(EINVAL, "path must be absolute: '{}' for {}", show(token), what);
    }
    if (token.size() > kMaxPathLength) {
      return fail(EINVAL, "path too long ({} bytes, max {}) for {}", token.size(), kMaxPathLength,
                  what);
    }
    if (has_control_char(token)) {
      return fail(EINVAL, "control character in path '{}' for {}", show(token), what);
    }
    out.assign(token);
    return true;
  }

  // X, X,Y or X,Y,Z; missing dimensions are 1.
  bool dims(std::string_view value, std::string_view what, std::uint32_t (&out)[3]) {
    std::size_t count = 0;
    std::string_view rest = value;
    while (true) {
      const std::size_t comma = rest.find(',');
      const std::string_view part = rest.substr(0, comma);
      if (count == 3) {
        return fail(EINVAL, "bad dimensions '{}' for {} (at most 3)", show(value), what);
      }
      std::uint64_t v = 0;
      if (!unsigned_num(part, what, 1, kMaxLaunchDim, v)) return false;
      out[count++] = static_cast<std::uint32_t>(v);
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
    for (; count < 3; ++count) out[count] = 1;
    return true;
  }

  bool parse_need(Command& out);
  bool parse_alloc(Command& out);
  bool parse_free(Command& out);
  bool parse_end(Command& out);
  bool parse_run(Command& out);
  bool parse_fill(Command& out);
  bool parse_copy(Command& out);
  bool parse_spin(Command& out);
  bool parse_gemm(Command& out);
  bool parse_priority(Command& out);
  bool parse_attach(Command& out);
  bool parse_module(Command& out);
  bool parse_launch(Command& out);
  bool parse_launch_arg(std::string_view token, vgpu::LaunchArg& arg);
  bool parse_transfer(Command& out, vgpu::TransferCmd::Direction direction);

  template <typename T>
  bool parse_bare(Command& out) {
    out.emplace<T>();
    return finish();
  }

  std::uint32_t line_;
  lex::Tokenizer tokens_;
  ParseError& error_;
  std::string_view keyword_;
};

bool LineParser::parse(std::optional<Command>& out) {
  keyword_ = next();
  if (keyword_.empty()) return true;
  Command& cmd = out.emplace();
  using Dir = vgpu::TransferCmd::Direction;
  const std::string_view k = keyword_;
  if (k == "need") return parse_need(cmd);
  if (k == "alloc") return parse_alloc(cmd);
  if (k == "free") return parse_free(cmd);
  if (k == "begin") return parse_bare<vgpu::BeginCmd>(cmd);
  if (k == "end") return parse_end(cmd);
  if (k == "run") return parse_run(cmd);
  if (k == "fill") return parse_fill(cmd);
  if (k == "copy") return parse_copy(cmd);
  if (k == "spin") return parse_spin(cmd);
  if (k == "gemm") return parse_gemm(cmd);
  if (k == "sync") return parse_bare<vgpu::SyncCmd>(cmd);
  if (k == "priority") return parse_priority(cmd);
  if (k == "reset") return parse_bare<vgpu::ResetCmd>(cmd);
  if (k == "module") return parse_module(cmd);
  if (k == "launch") return parse_launch(cmd);
  if (k == "upload") return parse_transfer(cmd, Dir::upload);
  if (k == "download") return parse_transfer(cmd, Dir::download);
  if (k == "attach") return parse_attach(cmd);
  return fail(EINVAL, "unknown command '{}'", show(k));
}

bool LineParser::parse_need(Command& out) {
  static constexpr std::array<std::string_view, 7> kKeys = {
      "persistent=", "ephemeral=", "iters=", "priority=", "gpu=", "name=", "kind="};
  auto& cmd = out.emplace<vgpu::NeedCmd>();
  Options<kKeys.size()> opts{kKeys};
  for (std::string_view token = next(); !token.empty(); token = next()) {
    std::size_t i = 0;
    std::string_view value;
    if (!option(token, opts, i, value)) return false;
    const std::string_view key = kKeys[i];
    switch (i) {
      case 0:
        if (!size(value, key, false, cmd.persistent)) return false;
        break;
      case 1:
        if (!size(value, key, false, cmd.ephemeral)) return false;
        break;
      case 2: {
        std::uint64_t n = 0;
        if (!unsigned_num(value, key, 1, UINT64_MAX, n)) return false;
        cmd.iters = n;
        break;
      }
      case 3: {
        std::int64_t n = 0;
        if (!signed_num(value, key, INT32_MIN, INT32_MAX, n)) return false;
        cmd.priority = static_cast<std::int32_t>(n);
        break;
      }
      case 4: {
        if (value == "any") {
          cmd.gpu = vgpu::kAnyGpu;
          break;
        }
        std::uint64_t n = 0;
        if (!unsigned_num(value, key, 0, kMaxGpuIndex, n)) return false;
        cmd.gpu = static_cast<int>(n);
        break;
      }
      case 5:
        if (!name(value, key, cmd.name.emplace())) return false;
        break;
      default:
        if (value != "hosted" && value != "attached")
          return fail(EINVAL, "need: bad kind '{}': expected hosted or attached", show(value));
        cmd.attached = value == "attached";
        break;
    }
  }
  if (!opts.has(0)) return fail(EINVAL, "need: missing persistent=");
  if (!opts.has(1)) return fail(EINVAL, "need: missing ephemeral=");
  return true;
}

bool LineParser::parse_attach(Command& out) {
  static constexpr std::array<std::string_view, 4> kKeys = {
      "gate=", "bell=", "lane=", "lane_room="};
  auto& cmd = out.emplace<vgpu::AttachCmd>();
  Options<kKeys.size()> opts{kKeys};
  for (std::string_view token = next(); !token.empty(); token = next()) {
    std::size_t i = 0;
    std::string_view value;
    if (!option(token, opts, i, value)) return false;
    std::uint64_t n = 0;
    if (!unsigned_num(value, kKeys[i], 0, i == 3 ? 1 : INT32_MAX, n)) return false;
    if (i == 3)
      cmd.lane_room = n == 1;
    else
      (i == 0 ? cmd.gate_fd : i == 1 ? cmd.bell_fd : cmd.lane_fd) = static_cast<int>(n);
  }
  if (!opts.has(0)) return fail(EINVAL, "attach: missing gate=");
  if (!opts.has(1)) return fail(EINVAL, "attach: missing bell=");
  if (cmd.lane_room && !opts.has(2)) return fail(EINVAL, "attach: lane_room=1 without lane=");
  return true;
}

bool LineParser::parse_alloc(Command& out) {
  auto& cmd = out.emplace<vgpu::AllocCmd>();
  std::string_view token;
  if (!require("NAME", token) || !name(token, "alloc NAME", cmd.name)) return false;
  if (!require("SIZE", token) || !size(token, "alloc SIZE", true, cmd.size)) return false;
  return finish();
}

bool LineParser::parse_free(Command& out) {
  auto& cmd = out.emplace<vgpu::FreeCmd>();
  std::string_view token;
  if (!require("NAME", token) || !name(token, "free NAME", cmd.name)) return false;
  return finish();
}

bool LineParser::parse_end(Command& out) {
  auto& cmd = out.emplace<vgpu::EndCmd>();
  const std::string_view token = next();
  if (token.empty()) return true;
  if (token[0] != 'x') {
    return fail(EINVAL, "end: unexpected token '{}' (expected xN)", show(token));
  }
  if (!unsigned_num(token.substr(1), "end xN", 1, UINT64_MAX, cmd.repeat)) return false;
  return finish();
}

bool LineParser::parse_run(Command& out) {
  auto& cmd = out.emplace<vgpu::RunCmd>();
  std::string_view token;
  if (!require("N", token) || !unsigned_num(token, "run N", 1, UINT64_MAX, cmd.count)) {
    return false;
  }
  return finish();
}

bool LineParser::parse_fill(Command& out) {
  static constexpr std::array<std::string_view, 3> kKeys = {"dtype=", "off=", "len="};
  auto& cmd = out.emplace<vgpu::FillCmd>();
  Options<kKeys.size()> opts{kKeys};
  std::string_view buf, value;
  // dtype= may come after VALUE, so VALUE is parsed once every token is read.
  for (std::string_view token = next(); !token.empty(); token = next()) {
    if (token.find('=') == std::string_view::npos) {
      if (buf.empty()) {
        buf = token;
        if (!name(buf, "fill BUF", cmd.dst.name)) return false;
      } else if (value.empty()) {
        value = token;
      } else {
        return fail(EINVAL, "fill: unexpected token '{}'", show(token));
      }
      continue;
    }
    std::size_t i = 0;
    std::string_view v;
    if (!option(token, opts, i, v)) return false;
    if (i == 0) {
      if (v == "f32") {
        cmd.dtype = vgpu::DType::f32;
      } else if (v == "i32") {
        cmd.dtype = vgpu::DType::i32;
      } else if (v == "u8") {
        cmd.dtype = vgpu::DType::u8;
      } else {
        return fail(EINVAL, "fill: bad dtype '{}' for dtype= (f32, i32 or u8)", show(v));
      }
    } else if (i == 1) {
      if (!size(v, "off=", false, cmd.dst.offset)) return false;
    } else {
      if (!size(v, "len=", true, cmd.length.emplace())) return false;
    }
  }
  if (buf.empty()) return fail(EINVAL, "fill: missing BUF");
  if (value.empty()) return fail(EINVAL, "fill: missing VALUE");
  switch (cmd.dtype) {
    case vgpu::DType::f32: {
      float f = 0;
      const NumStatus st = lex::parse_float(value, f);
      if (st != NumStatus::ok)
        return number_error(st, "f32 value", value, "fill VALUE", "beyond f32");
      cmd.bits = std::bit_cast<std::uint32_t>(f);
      break;
    }
    case vgpu::DType::i32: {
      std::int64_t n = 0;
      if (!signed_num(value, "fill i32 VALUE", INT32_MIN, INT32_MAX, n)) return false;
      cmd.bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(n));
      break;
    }
    case vgpu::DType::u8: {
      std::uint64_t n = 0;
      if (!unsigned_num(value, "fill u8 VALUE", 0, 255, n)) return false;
      cmd.bits = static_cast<std::uint32_t>(n);
      break;
    }
  }
  return true;
}

bool LineParser::parse_copy(Command& out) {
  auto& cmd = out.emplace<vgpu::CopyCmd>();
  std::string_view token;
  if (!require("DST", token) || !buf_ref(token, "copy DST", cmd.dst)) return false;
  if (!require("SRC", token) || !buf_ref(token, "copy SRC", cmd.src)) return false;
  if (!require("LEN", token) || !size(token, "copy LEN", true, cmd.length)) return false;
  return finish();
}

bool LineParser::parse_spin(Command& out) {
  static constexpr std::array<std::string_view, 1> kKeys = {"util="};
  auto& cmd = out.emplace<vgpu::SpinCmd>();
  Options<kKeys.size()> opts{kKeys};
  bool have_usec = false;
  for (std::string_view token = next(); !token.empty(); token = next()) {
    if (token.find('=') == std::string_view::npos) {
      if (have_usec) return fail(EINVAL, "spin: unexpected token '{}'", show(token));
      if (!unsigned_num(token, "spin USEC", 0, kMaxSpinUsec, cmd.usec)) return false;
      have_usec = true;
      continue;
    }
    std::size_t i = 0;
    std::string_view v;
    if (!option(token, opts, i, v)) return false;
    double util = 0;
    NumStatus st = lex::parse_double(v, util);
    if (st == NumStatus::ok && !(util > 0.0 && util <= 1.0)) {
      st = util < 0.0 ? NumStatus::negative : NumStatus::range;
    }
    if (st != NumStatus::ok) return number_error(st, "utilization", v, "util=", "allowed (0, 1]");
    cmd.util = util;
  }
  if (!have_usec) return fail(EINVAL, "spin: missing USEC");
  return true;
}

bool LineParser::parse_gemm(Command& out) {
  static constexpr std::string_view kDimWhat[] = {"gemm M", "gemm N", "gemm K"};
  static constexpr std::string_view kNameWhat[] = {"gemm A", "gemm B", "gemm C"};
  auto& cmd = out.emplace<vgpu::GemmCmd>();
  std::uint32_t* const dims[] = {&cmd.m, &cmd.n, &cmd.k};
  std::string* const names[] = {&cmd.a, &cmd.b, &cmd.c};
  std::string_view token;
  for (int i = 0; i < 3; ++i) {
    std::uint64_t v = 0;
    if (!require(kDimWhat[i].substr(5), token) ||
        !unsigned_num(token, kDimWhat[i], 1, kMaxGemmDim, v)) {
      return false;
    }
    *dims[i] = static_cast<std::uint32_t>(v);
  }
  for (int i = 0; i < 3; ++i) {
    if (!require(kNameWhat[i].substr(5), token) || !name(token, kNameWhat[i], *names[i])) {
      return false;
    }
  }
  return finish();
}

bool LineParser::parse_priority(Command& out) {
  auto& cmd = out.emplace<vgpu::PriorityCmd>();
  std::string_view token;
  std::int64_t n = 0;
  if (!require("N", token) || !signed_num(token, "priority N", INT32_MIN, INT32_MAX, n)) {
    return false;
  }
  cmd.priority = static_cast<std::int32_t>(n);
  return finish();
}

bool LineParser::parse_module(Command& out) {
  auto& cmd = out.emplace<vgpu::ModuleCmd>();
  std::string_view token;
  if (!require("NAME", token) || !name(token, "module NAME", cmd.name)) return false;
  if (!require("PATH", token) || !path(token, "module PATH", cmd.path)) return false;
  return finish();
}

bool LineParser::parse_launch_arg(std::string_view token, vgpu::LaunchArg& arg) {
  using Kind = vgpu::LaunchArg::Kind;
  const std::size_t colon = token.find(':');
  if (colon == std::string_view::npos) {
    arg.kind = Kind::buffer;
    return buf_ref(token, "launch ARG", arg.buffer);
  }
  const std::string_view type = token.substr(0, colon);
  const std::string_view value = token.substr(colon + 1);
  // Scalars occupy the low bytes of `bits`; the rest stay zero.
  if (type == "i32" || type == "i64") {
    const bool wide = type == "i64";
    std::int64_t n = 0;
    if (!signed_num(value, wide ? "launch i64:" : "launch i32:", wide ? INT64_MIN : INT32_MIN,
                    wide ? INT64_MAX : INT32_MAX, n)) {
      return false;
    }
    arg.kind = wide ? Kind::i64 : Kind::i32;
    arg.bits = wide ? static_cast<std::uint64_t>(n)
                    : static_cast<std::uint32_t>(static_cast<std::int32_t>(n));
    return true;
  }
  if (type == "u32" || type == "u64") {
    const bool wide = type == "u64";
    if (!unsigned_num(value, wide ? "launch u64:" : "launch u32:", 0,
                      wide ? UINT64_MAX : UINT32_MAX, arg.bits, true)) {
      return false;
    }
    arg.kind = wide ? Kind::u64 : Kind::u32;
    return true;
  }
  if (type == "f32") {
    float f = 0;
    const NumStatus st = lex::parse_float(value, f);
    if (st != NumStatus::ok)
      return number_error(st, "f32 value", value, "launch f32:", "beyond f32");
    arg.kind = Kind::f32;
    arg.bits = std::bit_cast<std::uint32_t>(f);
    return true;
  }
  if (type == "f64") {
    double d = 0;
    const NumStatus st = lex::parse_double(value, d);
    if (st != NumStatus::ok)
      return number_error(st, "f64 value", value, "launch f64:", "beyond f64");
    arg.kind = Kind::f64;
    arg.bits = std::bit_cast<std::uint64_t>(d);
    return true;
  }
  return fail(EINVAL,
              "launch: bad argument type '{}' in '{}' (expected i32, u32, i64, u64, f32 or f64)",
              show(type), show(token));
}

bool LineParser::parse_launch(Command& out) {
  static constexpr std::array<std::string_view, 3> kKeys = {"grid=", "block=", "smem="};
  auto& cmd = out.emplace<vgpu::LaunchCmd>();
  std::string_view token;
  if (!require("MOD.FUNC", token)) return false;
  // Module names may contain '.', function names may not: the last '.' splits.
  const std::size_t dot = token.rfind('.');
  if (dot == std::string_view::npos) {
    return fail(EINVAL, "launch: expected MOD.FUNC, got '{}'", show(token));
  }
  if (!name(token.substr(0, dot), "launch MOD", cmd.module)) return false;
  const std::string_view func = token.substr(dot + 1);
  if (!is_c_identifier(func)) {
    return fail(EINVAL, "launch: bad function name '{}' (a C identifier of at most {} chars)",
                show(func), kMaxFunctionLength);
  }
  cmd.function.assign(func);

  // Size the argument vector once; a copy of the tokenizer counts ahead.
  std::size_t arg_count = 0;
  for (lex::Tokenizer ahead = tokens_; !(token = ahead.next()).empty();) {
    if (token.find('=') == std::string_view::npos) ++arg_count;
  }
  cmd.args.reserve(std::min(arg_count, kMaxLaunchArgs));

  Options<kKeys.size()> opts{kKeys};
  for (token = next(); !token.empty(); token = next()) {
    if (token.find('=') == std::string_view::npos) {
      if (cmd.args.size() == kMaxLaunchArgs) {
        return fail(EINVAL, "launch: too many arguments (max {}) at '{}'", kMaxLaunchArgs,
                    show(token));
      }
      if (!parse_launch_arg(token, cmd.args.emplace_back())) return false;
      continue;
    }
    std::size_t i = 0;
    std::string_view v;
    if (!option(token, opts, i, v)) return false;
    if (i == 0) {
      if (!dims(v, "grid=", cmd.grid)) return false;
    } else if (i == 1) {
      if (!dims(v, "block=", cmd.block)) return false;
    } else {
      Bytes smem = 0;
      NumStatus st = lex::parse_size(v, smem);
      if (st == NumStatus::ok && smem > UINT32_MAX) st = NumStatus::range;
      if (st != NumStatus::ok) return number_error(st, "size", v, "smem=", "allowed 0..4294967295");
      cmd.shared_mem = static_cast<std::uint32_t>(smem);
    }
  }
  if (!opts.has(0)) return fail(EINVAL, "launch: missing grid=");
  if (!opts.has(1)) return fail(EINVAL, "launch: missing block=");
  return true;
}

bool LineParser::parse_transfer(Command& out, vgpu::TransferCmd::Direction direction) {
  using Endpoint = vgpu::TransferCmd::Endpoint;
  using Dir = vgpu::TransferCmd::Direction;
  const bool up = direction == Dir::upload;
  auto& cmd = out.emplace<vgpu::TransferCmd>();
  cmd.direction = direction;
  std::string_view token;
  if (!require("BUF", token) || !buf_ref(token, up ? "upload BUF" : "download BUF", cmd.buffer)) {
    return false;
  }
  if (!require("shm:SEG or file:PATH", token)) return false;
  if (token.starts_with("shm:")) {
    cmd.endpoint = Endpoint::shm;
    vgpu::BufRef seg;
    if (!buf_ref(token.substr(4), up ? "upload shm:SEG" : "download shm:SEG", seg)) return false;
    cmd.source = std::move(seg.name);
    cmd.source_offset = seg.offset;
  } else if (token.starts_with("file:")) {
    cmd.endpoint = Endpoint::file;
    std::string_view p = token.substr(5);
    // Paths may contain '+': only a trailing "+SIZE" is an offset.
    const std::size_t plus = p.rfind('+');
    if (plus != std::string_view::npos) {
      if (const auto off = arena::parse_size(p.substr(plus + 1))) {
        cmd.source_offset = *off;
        p = p.substr(0, plus);
      }
    }
    if (!path(p, up ? "upload file:PATH" : "download file:PATH", cmd.source)) return false;
  } else {
    return fail(EINVAL, "{}: expected shm:SEG or file:PATH, got '{}'", keyword_, show(token));
  }
  if (!require("LEN", token) ||
      !size(token, up ? "upload LEN" : "download LEN", true, cmd.length)) {
    return false;
  }
  return finish();
}

}  // namespace

ParseResult parse_commands(std::string_view text) {
  ParseResult result;
  // One allocation for the common case; capped so that a write of blank lines
  // cannot make the parser reserve far more than it will use.
  const auto lines = static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')) + 1;
  result.commands.reserve(std::min<std::size_t>(lines, 1024));

  ParseError err;
  std::uint32_t line_no = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    ++line_no;
    const std::size_t nl = text.find('\n', pos);
    const std::size_t end = nl == std::string_view::npos ? text.size() : nl;
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);

    if (line.size() > kMaxLineLength) {
      result.error = ParseError{line_no, EINVAL,
                                fmt::format("line {}: line too long ({} bytes, max {})", line_no,
                                            line.size(), kMaxLineLength)};
      break;
    }
    const lex::LineProblem problem = lex::check_line_bytes(line);
    if (problem != lex::LineProblem::none) {
      result.error = ParseError{
          line_no, EINVAL,
          fmt::format("line {}: {}", line_no,
                      problem == lex::LineProblem::nul ? "embedded NUL byte" : "invalid UTF-8")};
      break;
    }
    std::optional<Command> cmd;
    if (!LineParser(line_no, line, err).parse(cmd)) {
      result.error = std::move(err);
      break;
    }
    if (cmd) result.commands.push_back({line_no, std::move(*cmd)});
  }
  return result;
}

}  // namespace salus::fusefs
