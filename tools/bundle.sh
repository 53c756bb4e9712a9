#!/bin/sh
# Gathers built salusd tools, the GPU test programs and every shared library
# they need beyond glibc into one folder, so they run on a machine that has a
# GPU driver but no development packages (e.g. a lent GPU box):
#   tools/bundle.sh BUILD_DIR OUT_DIR
# then there: LD_LIBRARY_PATH=OUT_DIR/lib PATH=OUT_DIR/bin:$PATH ...
set -eu
build=${1:?usage: tools/bundle.sh BUILD_DIR OUT_DIR}
out=${2:?usage: tools/bundle.sh BUILD_DIR OUT_DIR}
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/data"
for f in tools/salusd tools/salusctl tools/salus-bench tools/salus-sim tools/salus-trace-gen tools/salus-trace-import \
         tests/vgpu/cuda/test_cuda_device tests/vgpu/cuda/test_cuda_driver tests/vgpu/cuda/test_nvml_gpu; do
  [ -x "$build/$f" ] && cp "$build/$f" "$out/bin/"
done
for f in tests/vgpu/cuda/test_kernels.fatbin tests/vgpu/cuda/test_kernels.ptx tools/salus_bench_kernels.ptx; do
  [ -f "$build/$f" ] && cp "$build/$f" "$out/data/"
done
cp "$(command -v fusermount3)" "$out/bin/"
# Every non-glibc library the binaries load (glibc is backward compatible; the
# target's newer one runs what was linked here).
for b in "$out"/bin/*; do
  ldd "$b" 2>/dev/null | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*) ;;
    libstdc++.so.*|libgcc_s.so.*) ;;  # the target's own are newer and compatible
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done
strip --strip-debug "$out"/bin/* 2>/dev/null || true
du -sh "$out"
