#!/usr/bin/env bash
# Installs what elrun needs to build, test and benchmark, from Debian 12's packages only.
# Idempotent: asks apt only for packages that are missing, so a second run does nothing.
set -euo pipefail

PACKAGES=(
  # Build: Bazel (offline, with Debian's rules_java for its JDK toolchain) and a C++17 compiler.
  bazel-bootstrap bazel-rules-java g++ pkg-config
  # Libraries: gRPC and Protobuf (rendezvous), Abseil (Status), spdlog, CLI11, doctest.
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libspdlog-dev libcli11-dev doctest-dev
  # LibTorch (CPU, c10d + Gloo) for the trainer; Python torch for interop tests and references.
  libtorch-dev libgloo-dev zlib1g-dev python3-torch
  # Data and benchmark plots.
  dataset-fashion-mnist python3-matplotlib
  # Integration tests: procps (ps) and iproute2 (ss) for process and port checks.
  procps iproute2 time
  # TLS tests make a throw-away CA and certificates.
  openssl
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
echo "setup: installing ${missing[*]}"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
echo "setup: done"
