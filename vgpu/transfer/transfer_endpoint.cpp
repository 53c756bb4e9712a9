#include "vgpu/transfer/transfer_endpoint.hpp"

#include <linux/magic.h>
#include <sys/vfs.h>

#include <cerrno>
#include <limits>

#include <fmt/format.h>

namespace salus::vgpu {

TransferEndpoint open_transfer_endpoint(const CallerCredentials& who, const TransferCmd& cmd) {
  TransferEndpoint ep;
  const bool up = cmd.direction == TransferCmd::Direction::upload;
  const bool shm = cmd.endpoint == TransferCmd::Endpoint::shm;
  ep.shown = fmt::format("{}:{}", shm ? "shm" : "file", cmd.source);
  auto fail = [&](int err, std::string why) {
    ep.error = err;
    ep.why = std::move(why);
    ep.file = CallerFile{};
    return std::move(ep);
  };
  constexpr auto kMaxOff = static_cast<Bytes>(std::numeric_limits<off_t>::max());
  if (cmd.source_offset > kMaxOff || cmd.length > kMaxOff - cmd.source_offset)
    return fail(ERANGE, fmt::format("{}: offset {} + length {} is past the largest file offset",
                                    ep.shown, cmd.source_offset, cmd.length));
  const Bytes end = cmd.source_offset + cmd.length;
  std::string why;
  if (shm) {
    // POSIX names one object in /dev/shm: a single component, never a path.
    if (!is_valid_name(cmd.source))
      return fail(EINVAL, fmt::format("{}: a segment name is 1-{} of [A-Za-z0-9_.-], not "
                                      "starting with '.'",
                                      ep.shown, kMaxNameLength));
    const std::string path = fmt::format("{}/{}", kShmDir, cmd.source);
    // A download opens the segment for reading too, so that it can be mapped
    // for direct copies; a write-only segment still works, through staging.
    int rc =
        open_caller_file(who, path, up ? FileIntent::read : FileIntent::read_write, ep.file, why);
    if (rc == EACCES && !up)
      rc = open_caller_file(who, path, FileIntent::write_existing, ep.file, why);
    if (rc == ENOENT)
      return fail(ENOENT, fmt::format("{}: no such segment ({} in the caller's mount namespace)",
                                      ep.shown, path));
    if (rc) return fail(rc, fmt::format("{}: {}", ep.shown, why));
    // Segments are mapped and copied from by the engine and the device, where
    // a page fault must never wait for a filesystem: only memory will do
    // (a bind mount over /dev/shm in the caller's namespace could be anything).
    struct statfs fs {};
    if (::fstatfs(ep.file.fd.get(), &fs) != 0 ||
        (fs.f_type != TMPFS_MAGIC && fs.f_type != HUGETLBFS_MAGIC))
      return fail(EINVAL, fmt::format("{}: {} is not on tmpfs; a segment must be shared memory",
                                      ep.shown, path));
    if (ep.file.st.st_uid != who.uid)
      return fail(EACCES, fmt::format("{}: the segment belongs to uid {}; a session uses only "
                                      "segments of its caller (uid {})",
                                      ep.shown, ep.file.st.st_uid, who.uid));
    const auto size = static_cast<Bytes>(ep.file.st.st_size);
    if (end > size)
      return fail(ERANGE, fmt::format("{}: +{} len {} reaches byte {} but the segment holds {}",
                                      ep.shown, cmd.source_offset, cmd.length, end, size));
    return ep;
  }
  const int rc =
      open_caller_file(who, cmd.source, up ? FileIntent::read : FileIntent::write, ep.file, why);
  if (rc) return fail(rc, fmt::format("file:{}", why));
  if (up) {
    const auto size = static_cast<Bytes>(ep.file.st.st_size);
    if (end > size)
      return fail(ERANGE, fmt::format("{}: +{} len {} reaches byte {} but the file holds {}",
                                      ep.shown, cmd.source_offset, cmd.length, end, size));
  }
  return ep;
}

}  // namespace salus::vgpu
