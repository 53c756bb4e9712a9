#!/bin/sh
# Gathers built salusd tools, the shim, the GPU test and benchmark programs and
# every shared library they need beyond glibc and libstdc++ into one folder, so
# that they run on a machine with a GPU driver but no development packages (a
# lent GPU box):
#
#   tools/bundle.sh BUILD_DIR OUT_DIR
#
# OUT_DIR has the build directory's layout (tools/salusd, tools/salus-run,
# client/shim/libsalus-shim.so, tests/...), so every script that takes a build
# takes it too (SALUS_BUILD=OUT_DIR tools/pytorch-eval.sh ..., tools/gpu-eval.sh
# OUT_DIR ...). Each program finds its libraries in OUT_DIR/lib through an RPATH
# (patchelf), not LD_LIBRARY_PATH, which would reach the PyTorch programs that
# salus-run starts and could replace their own libraries. salus-run finds the
# automark and the Python client in OUT_DIR/share/salus, as when installed.
# Never bundled: the mock libcuda and NVML of the tests (the real driver's are
# on the GPU box).
set -eu
build=${1:?usage: tools/bundle.sh BUILD_DIR OUT_DIR}
out=${2:?usage: tools/bundle.sh BUILD_DIR OUT_DIR}
command -v patchelf >/dev/null || { echo "bundle.sh: patchelf is not installed (tools/dev.sh installs it)" >&2; exit 1; }
src=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$out"
mkdir -p "$out/lib"

programs="tools/salusd tools/salusctl tools/salus-run tools/salus-bench tools/salus-sim
  tools/salus-trace-gen tools/salus-trace-import client/shim/libsalus-shim.so
  tests/integration/swap_program tests/integration/lane_program
  tests/vgpu/cuda/test_cuda_device tests/vgpu/cuda/test_cuda_driver tests/vgpu/cuda/test_nvml_gpu
  tests/vgpu/cuda/bench_lane_handover tests/vgpu/cuda/bench_shim_launch"
data="tools/salus_bench_kernels.ptx tests/vgpu/cuda/test_kernels.fatbin tests/vgpu/cuda/test_kernels.ptx"
for f in $programs $data; do
  [ -e "$build/$f" ] || continue
  mkdir -p "$out/$(dirname "$f")"
  cp "$build/$f" "$out/$f"
done
[ -x "$out/tools/salusd" ] || { echo "bundle.sh: $build/tools/salusd is not built" >&2; exit 1; }
cp "$(command -v fusermount3)" "$out/tools/"
mkdir -p "$out/share/salus/automark" "$out/share/salus/python"
cp "$src"/client/automark/*.py "$out/share/salus/automark/"
cp "$src/client/salus.py" "$src/client/salus_gate.py" "$out/share/salus/python/"

# Every library the programs load beyond glibc (backward compatible: the
# target's newer one runs what was linked here) and libstdc++/libgcc_s (the
# target's own are newer and compatible).
for f in $programs; do
  [ -e "$out/$f" ] && ldd "$build/$f" 2>/dev/null | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so.* | libm.so.* | libdl.so.* | libpthread.so.* | librt.so.* | ld-linux*) ;;
    libstdc++.so.* | libgcc_s.so.*) ;;
    libcuda.so.* | libnvidia-ml.so.*) ;;  # the mocks; the target has the real ones
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done

# DT_RPATH rather than RUNPATH: it also serves the libraries' own dependencies
# (libsystemd's libgcrypt, ...), and it comes before LD_LIBRARY_PATH.
for f in $programs; do
  [ -e "$out/$f" ] || continue
  up=$(dirname "$f" | sed 's|[^/]*|..|g')
  patchelf --force-rpath --set-rpath "\$ORIGIN/$up/lib" "$out/$f"
  strip --strip-debug "$out/$f" 2>/dev/null || true
done
for l in "$out"/lib/*; do
  [ -e "$l" ] && patchelf --force-rpath --set-rpath '$ORIGIN' "$l"
done
du -sh "$out"
