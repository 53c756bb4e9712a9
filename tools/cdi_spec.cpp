#include "tools/cdi_spec.hpp"

#include <cctype>
#include <stdexcept>

#include <fmt/format.h>

namespace salus::tools {

namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// CDI's rules: vendor is a domain-like name, class an identifier.
bool valid_kind(const std::string& kind) {
  const auto slash = kind.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == kind.size()) return false;
  auto alnum = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; };
  const std::string vendor = kind.substr(0, slash), cls = kind.substr(slash + 1);
  if (!std::isalpha(static_cast<unsigned char>(vendor[0])) || !alnum(vendor.back())) return false;
  for (const char c : vendor)
    if (!alnum(c) && c != '.' && c != '-' && c != '_') return false;
  if (!std::isalpha(static_cast<unsigned char>(cls[0])) || !alnum(cls.back())) return false;
  for (const char c : cls)
    if (!alnum(c) && c != '-' && c != '_') return false;
  return true;
}

std::string mount_entry(const std::string& path, const char* options) {
  return fmt::format(R"({{"hostPath": {0}, "containerPath": {0}, "options": [{1}]}})",
                     json_string(path), options);
}

}  // namespace

CdiSpec make_cdi_spec(const CdiInput& in) {
  if (!valid_kind(in.kind))
    throw std::invalid_argument(fmt::format(
        "--kind {}: expected VENDOR/CLASS, e.g. salus.io/gpu (letters, digits, . - _)", in.kind));
  if (in.mount.empty() || in.mount[0] != '/')
    throw std::invalid_argument(fmt::format("mount {}: not an absolute path", in.mount));
  CdiSpec spec;
  std::vector<std::string> mounts;
  // A bind of the FUSE mount itself dies with salusd; a bind of the directory
  // above it, with slave propagation, receives the next salusd's mount
  // (docs/containers.md, "Restarts").
  const auto slash = in.mount.rfind('/');
  const std::string parent = slash == 0 ? "/" : in.mount.substr(0, slash);
  if (parent == "/") {
    mounts.push_back(mount_entry(in.mount, R"("rbind", "rw")"));
    spec.notes.push_back(fmt::format(
        "salusd mounts at {}: containers lose it when salusd restarts; mount it one level "
        "below a directory (mount = \"/run/salus/fs\") to keep them working",
        in.mount));
  } else {
    mounts.push_back(mount_entry(parent, R"("rbind", "rslave", "rw")"));
  }
  std::vector<std::string> env = {json_string("SALUS_MOUNT=" + in.mount)};
  if (in.shim) {
    mounts.push_back(
        fmt::format(R"({{"hostPath": {}, "containerPath": {}, "options": ["bind", "ro"]}})",
                    json_string(*in.shim), json_string(kContainerShim)));
    env.push_back(json_string(std::string("LD_PRELOAD=") + kContainerShim));
  } else {
    spec.notes.push_back(
        "no libsalus-shim.so: containers get the mount only, not attached CUDA sessions "
        "(--shim PATH names it)");
  }
  std::string devices;
  auto device = [&](const std::string& name) {
    if (!devices.empty()) devices += ",\n";
    devices += fmt::format(R"(    {{"name": {}, "containerEdits": {{"env": [{}]}}}})",
                           json_string(name), json_string("SALUS_GPU=" + name));
  };
  for (const auto& g : in.gpus) device(g);
  device("any");
  std::string mount_list, env_list;
  for (const auto& m : mounts) mount_list += (mount_list.empty() ? "" : ",\n      ") + m;
  for (const auto& e : env) env_list += (env_list.empty() ? "" : ", ") + e;
  spec.json = fmt::format(
      "{{\n  \"cdiVersion\": \"0.5.0\",\n  \"kind\": {},\n  \"devices\": [\n{}\n  ],\n"
      "  \"containerEdits\": {{\n    \"env\": [{}],\n    \"mounts\": [\n      {}\n    ]\n"
      "  }}\n}}\n",
      json_string(in.kind), devices, env_list, mount_list);
  return spec;
}

}  // namespace salus::tools
