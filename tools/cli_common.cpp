// cli_common: see cli_common.hpp.
#include "cli_common.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cctype>

#include "vgpu/unique_fd.hpp"

namespace salus::cli {

// Quotes a word for sh if it needs quoting.
std::string sh_quote(std::string_view s) {
  const bool safe = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("/._-+=:,@%^", c);
  });
  if (safe) return std::string(s);
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

// A hint for errors that mean "there is no salusd at the mount point".
std::string mount_hint(const Ctx& ctx, int err) {
  if (err != ENOENT && err != ENOTCONN) return {};
  struct stat st;
  if (::stat(ctx.path("version").c_str(), &st) == 0) return {};
  if (err == ENOTCONN || errno == ENOTCONN)
    return fmt::format(" (salusd at {} is gone; clean up with `fusermount3 -u {}`)", ctx.mount,
                       ctx.mount);
  return fmt::format(" (no salusd is mounted at {}; use --mount or $SALUS_MOUNT)", ctx.mount);
}

[[noreturn]] void fail_file(const Ctx& ctx, const std::string& path, int err,
                            std::string_view extra) {
  std::string msg = fmt::format("{}: {}", path, std::strerror(err));
  if (!extra.empty()) msg += fmt::format(": {}", extra);
  fail(msg + mount_hint(ctx, err));
}

// ---------------------------------------------------------------- file I/O

// Reads a whole file into `out`; 0 or an errno. Synthetic files are snapshots taken
// at open, so one open and reads to EOF give a consistent view.
int try_read(const std::string& path, std::string& out) {
  const vgpu::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return errno;
  out.clear();
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return 0;
}

std::string read_file(const Ctx& ctx, const std::string& path) {
  std::string out;
  if (const int err = try_read(path, out)) fail_file(ctx, path, err);
  return out;
}

// One write() of `text`; 0 or an errno.
int try_write(const std::string& path, std::string_view text) {
  const vgpu::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) return errno;
  const ssize_t n = ::write(fd.get(), text.data(), text.size());
  return n < 0 ? errno : 0;
}

using KeyValues = std::map<std::string, std::string>;

// "key: value" lines (status, info, memory) or "key value" lines (stats).
KeyValues parse_kv(std::string_view text, std::string_view sep) {
  KeyValues out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t nl = text.find('\n', pos);
    if (nl == std::string_view::npos) nl = text.size();
    const std::string_view line = text.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.empty() || line[0] == '#') continue;
    const std::size_t at = line.find(sep);
    if (at == std::string_view::npos) continue;
    out[std::string(line.substr(0, at))] = std::string(line.substr(at + sep.size()));
  }
  return out;
}

std::string get(const KeyValues& kv, const std::string& key, std::string fallback) {
  auto it = kv.find(key);
  return it == kv.end() ? fallback : it->second;
}

std::vector<std::string> split_lines(std::string_view text) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t nl = text.find('\n', pos);
    if (nl == std::string_view::npos) nl = text.size();
    out.emplace_back(text.substr(pos, nl - pos));
    pos = nl + 1;
  }
  return out;
}

std::vector<std::string> split_words(std::string_view line) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos < line.size()) {
    const std::size_t start = line.find_first_not_of(" \t", pos);
    if (start == std::string_view::npos) break;
    std::size_t end = line.find_first_of(" \t", start);
    if (end == std::string_view::npos) end = line.size();
    out.emplace_back(line.substr(start, end - start));
    pos = end;
  }
  return out;
}

// Rows of a table file (gpus/N/lanes, gpus/N/queue): '#' lines are headers.
std::vector<std::vector<std::string>> parse_rows(std::string_view text) {
  std::vector<std::vector<std::string>> rows;
  for (const std::string& line : split_lines(text)) {
    if (line.empty() || line[0] == '#') continue;
    rows.push_back(split_words(line));
  }
  return rows;
}

std::optional<unsigned long long> to_u64(const std::string& s) {
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::strtoull(s.c_str(), nullptr, 10);
}

// The last line of a session's log, without its timestamp.
std::string last_log_line(const Ctx& ctx, const std::string& dir) {
  std::string log;
  if (try_read(ctx.path(dir + "/log"), log)) return {};
  const auto lines = split_lines(log);
  if (lines.empty()) return {};
  std::string l = lines.back();
  if (!l.empty() && l[0] == '[') {
    const std::size_t close = l.find("] ");
    if (close != std::string::npos) l.erase(0, close + 2);
  }
  return l;
}

int exit_status_of(int wstatus) {
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) return 128 + WTERMSIG(wstatus);
  return 1;
}

}  // namespace salus::cli
