#!/bin/sh
# Set-up for a fresh Debian 12 machine, run as root, idempotent:
#   tools/dev.sh run    install dependencies, build, run salusd in the foreground
#   tools/dev.sh test   install dependencies, build, run every test
set -eu
cd "$(dirname "$0")/.."

PACKAGES="meson ninja-build g++ pkg-config fuse3 libfuse3-dev liburing-dev libboost-dev
  libgtest-dev libgmock-dev libcli11-dev libfmt-dev libspdlog-dev libtomlplusplus-dev
  libsystemd-dev libbenchmark-dev python3 python3-pytest util-linux procps systemd
  pandoc man-db busybox-static podman runc slurm-wlm libslurm-dev munge prometheus
  libgrpc++-dev protobuf-compiler protobuf-compiler-grpc python3-grpcio python3-protobuf python3-yaml
  python3-torch python3-ipykernel python3-jupyter-client clang-format patchelf"

install_deps() {
  missing=""
  for p in $PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
  done
  if [ -n "$missing" ]; then
    echo "dev.sh: installing:$missing"
    if [ "$(id -u)" -ne 0 ]; then echo "dev.sh: run as root to install packages" >&2; exit 1; fi
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing
  fi
}

# build DIR MESON-ARGS...: the daemon runs from a release build (no internal
# assertions); tests use a debug-optimized build that checks every invariant.
build() {
  dir=$1
  shift
  if [ ! -f "$dir/build.ninja" ]; then
    meson setup "$dir" "$@"
  fi
  ninja -C "$dir"
}

case "${1:-}" in
  run)
    install_deps
    build build-release --buildtype=release -Db_ndebug=true -Dtests=false
    shift
    exec ./build-release/tools/salusd --mount "${SALUS_MOUNT:-/salus}" "$@"
    ;;
  test)
    install_deps
    build build --buildtype=debugoptimized
    meson test -C build --print-errorlogs --num-processes 2
    ;;
  *)
    echo "usage: $0 run [salusd flags] | test" >&2
    exit 2
    ;;
esac
