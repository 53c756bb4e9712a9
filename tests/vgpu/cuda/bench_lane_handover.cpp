// What a hand-over of the shared lane (issue 15) costs, per step and per GiB:
// salusd's device makes lane memory (cuMemCreate, POSIX-fd handle) and clears
// it (cuMemsetD8 + synchronize), the program's side imports and maps it
// (cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap,
// cuMemSetAccess) and, when it yields, synchronizes and unmaps it. A hand-over
// between two uids is yield + clear + map; within one uid, yield + map. The
// baseline in the same run is a plain cuMemsetD8 + synchronize of a
// cuMemAlloc buffer of the same size (what a clear cannot beat).
//
// usage: bench_lane_handover [--sizes MIB,MIB,...] [--rounds N]
// Prints one line per size: mib, make_ms, map_ms, yield_ms, clear_ms,
// memset_baseline_ms, handover_ms (yield + clear + map), ms_per_gib.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "vgpu/cuda/cuda_backend.hpp"
#include "vgpu/cuda/cuda_device.hpp"
#include "vgpu/cuda/cuda_driver.hpp"

using salus::vgpu::Bytes;
using salus::vgpu::CudaOptions;
using salus::vgpu::UniqueFd;
using salus::vgpu::cuda::CudaDevice;
using salus::vgpu::cuda::CudaDriver;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

#define CHECK(x)                                                      \
  do {                                                                \
    if (const CUresult r_ = (x); r_ != CUDA_SUCCESS) {                \
      std::fprintf(stderr, "%s: %s\n", #x, d.error_name(r_).c_str()); \
      std::exit(2);                                                   \
    }                                                                 \
  } while (0)

struct Row {
  double make = 1e30, map = 1e30, yield = 1e30, clear = 1e30, baseline = 1e30;
};

void one_round(const CudaDriver& d, CudaDevice& dev, CUstream st, Bytes n, Row& row) {
  std::string why;
  UniqueFd fd;
  auto t0 = Clock::now();
  if (dev.make_lane_memory(n, fd, why) != 0) {
    std::fprintf(stderr, "make_lane_memory: %s\n", why.c_str());
    std::exit(2);
  }
  row.make = std::min(row.make, ms_since(t0));
  // The program's side: import and map (as client/shim/lane.cpp does).
  t0 = Clock::now();
  CUmemGenericAllocationHandle h = 0;
  CHECK(d.mem_import(&h, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd.get())),
                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  CUdeviceptr p = 0;
  CHECK(d.mem_address_reserve(&p, n, 0, 0, 0));
  CHECK(d.mem_map(p, n, 0, h, 0));
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CHECK(d.mem_set_access(p, n, &access, 1));
  row.map = std::min(row.map, ms_since(t0));
  CHECK(d.memset_d8_async(p, 0x5a, n, st));  // the program's work in it
  // salusd hands over only after the iteration completed: its work is done.
  CHECK(d.stream_synchronize(st));
  // The yield: synchronize (nothing left to wait for), unmap.
  t0 = Clock::now();
  CHECK(d.stream_synchronize(st));
  CHECK(d.mem_unmap(p, n));
  row.yield = std::min(row.yield, ms_since(t0));
  t0 = Clock::now();
  if (dev.clear_lane_memory(fd.get(), n, why) != 0) {
    std::fprintf(stderr, "clear_lane_memory: %s\n", why.c_str());
    std::exit(2);
  }
  row.clear = std::min(row.clear, ms_since(t0));
  CHECK(d.mem_address_free(p, n));
  CHECK(d.mem_release(h));
  dev.drop_lane_memory(fd.get());
  // Baseline: a plain memset of the same size.
  CUdeviceptr b = 0;
  CHECK(d.mem_alloc(&b, n));
  CHECK(d.memset_d8_async(b, 1, n, st));
  CHECK(d.stream_synchronize(st));
  t0 = Clock::now();
  CHECK(d.memset_d8_async(b, 0, n, st));
  CHECK(d.stream_synchronize(st));
  row.baseline = std::min(row.baseline, ms_since(t0));
  CHECK(d.mem_free(b));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Bytes> sizes_mib = {64, 128, 256};
  int rounds = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--sizes") == 0) {
      sizes_mib.clear();
      std::stringstream ss(argv[i + 1]);
      for (std::string tok; std::getline(ss, tok, ',');) sizes_mib.push_back(std::stoull(tok));
    }
  }
  std::string why;
  const CudaDriver* dp = CudaDriver::get(why);
  if (dp == nullptr) {
    std::fprintf(stderr, "no CUDA driver: %s\n", why.c_str());
    return 77;
  }
  const CudaDriver& d = *dp;
  if (d.mem_create == nullptr) {
    std::fprintf(stderr, "the driver has no VMM with POSIX fd handles\n");
    return 77;
  }
  CudaOptions options;
  options.memory_fraction = 0.1;  // the lane memory is outside the arena
  auto devices = salus::vgpu::open_cuda_devices(options, why);
  if (devices.empty()) {
    std::fprintf(stderr, "no CUDA GPU: %s\n", why.c_str());
    return 77;
  }
  auto* dev = dynamic_cast<CudaDevice*>(devices[0].get());
  std::printf("# device: %s\n", dev->info().name.c_str());
  CUcontext ctx = nullptr;
  CHECK(d.primary_ctx_retain(&ctx, 0));
  CHECK(d.ctx_set_current(ctx));
  CUstream st = nullptr;
  CHECK(d.stream_create(&st, CU_STREAM_NON_BLOCKING));
  std::printf(
      "mib make_ms map_ms yield_ms clear_ms memset_baseline_ms handover_ms ms_per_gib "
      "clear_vs_memset\n");
  for (const Bytes mib : sizes_mib) {
    Row row;
    for (int r = 0; r < rounds; ++r) one_round(d, *dev, st, mib << 20, row);
    const double handover = row.yield + row.clear + row.map;
    std::printf("%llu %.3f %.3f %.3f %.3f %.3f %.3f %.3f %.2f\n",
                static_cast<unsigned long long>(mib), row.make, row.map, row.yield, row.clear,
                row.baseline, handover, handover * 1024.0 / static_cast<double>(mib),
                row.clear / row.baseline);
  }
  d.stream_destroy(st);
  d.primary_ctx_release(0);
  return 0;
}
