#!/usr/bin/env bash
# Builds what scripts/gpu_check.sh runs on a GPU host (which has no Bazel) and packs it into
# gpu_bundle/ (git-ignored): elrun, elrun-train and the CUDA unit test, plus the shared libraries
# they need that are neither torch's, NVIDIA's nor the C library's (Debian's spdlog, fmt, zlib,
# libstdc++), and Debian's Fashion-MNIST files (30 MB), which the GPU host does not have. On the GPU host the binaries then load that host's own torch and NVIDIA libraries
# through LD_LIBRARY_PATH (their RPATH folders, under this machine's ~/.cache/elrun, do not exist
# there), so no CUDA runtime soname of this machine is needed there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh run >/dev/null
bazel build //launcher:elrun //trainer/app:elrun-train //tests/trainer:cuda_test
out=gpu_bundle
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
cp bazel-bin/launcher/elrun bazel-bin/trainer/app/elrun-train bazel-bin/tests/trainer/cuda_test "$out/bin/"
# ldd on Bazel's own outputs: their RPATH ($ORIGIN/../_solib_k8) finds the project's shared
# libraries (a test binary links them dynamically) only from there, not from the copies.
for bin in bazel-bin/launcher/elrun bazel-bin/trainer/app/elrun-train bazel-bin/tests/trainer/cuda_test; do
  ldd "$bin" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  case "$lib" in
    */torch/lib/* | */nvidia/* | */libc.so* | */libm.so* | */libpthread.so* | */libdl.so* | */librt.so* | \
      */ld-linux* | */libcuda.so*) ;;
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done
cp -r /usr/share/datasets/fashion-mnist "$out/fashion-mnist"
{ git rev-parse --short HEAD && { git diff --quiet HEAD || echo " plus uncommitted changes"; }; } 2>/dev/null | tr -d "\n" >"$out/COMMIT" || true
du -sh "$out"
ls "$out/lib"
