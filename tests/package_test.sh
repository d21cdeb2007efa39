#!/usr/bin/env bash
# The library as another project meets it: installed with cmake --install,
# found with find_package(mnist_ddp), its examples/ built against the
# installed tree and run as one job under our launcher, torchrun, mpirun,
# mpiexec and alone.
#
#   bash tests/package_test.sh CASE SOURCE_DIR BUILD_DIR TORCH_DIR
#
# CASE: build (installs and builds the examples into BUILD_DIR/package; the
# other cases use them), refuse, launchers, run-errors, by-value, warnings,
# subdirectory.
# Exit 0: passed; 77: skipped, the reason printed; else failed, saying what.
# Every command is bounded in time; every port is one the kernel picked.
set -euo pipefail
case_name="${1:-}" src="${2:-}" build="${3:-}" torch_dir="${4:-}"
[ -n "$case_name" ] && [ -d "$src/examples" ] && [ -x "$build/mnist_ddp" ] ||
  { echo "usage: package_test.sh CASE SOURCE_DIR BUILD_DIR TORCH_DIR" >&2; exit 2; }
pkg="$build/package"
examples="$pkg/build"
mnist_ddp="$pkg/prefix/bin/mnist_ddp"  # the installed launcher
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

fail() { echo "FAILED: $*" >&2; exit 1; }
skip() { echo "skipped: $*"; exit 77; }
# run CMD...: runs it with a time limit; sets rc and out (stdout and stderr).
run() {
  rc=0
  out="$(timeout -k 5 300 "$@" 2>&1)" || rc=$?
}
generator=()  # Ninja where the machine has it (a fresh one may lack make)
command -v ninja >/dev/null && generator=(-G Ninja)
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# The flags two_inputs.cpp was compiled with (the build case's), torch.h
# precompiled among them, for a program of our own: its source as C++, not
# as the header the precompiled one was made from.
example_flags() {
  [ -f "$examples/build.ninja" ] || fail "the examples were not configured with Ninja (ninja-build), whose flags this reads"
  local flags
  flags="$(sed -n 's/^ *\(DEFINES\|INCLUDES\|FLAGS\) = //p' "$examples/build.ninja" | head -n 3 | tr '\n' ' ')"
  echo "${flags//-x c++-header/}"
}
# The examples' last lines, without the launcher's name: what every launcher must agree on.
results() { grep -E '^(\[[a-z0-9]+\]:)?[a-z_]+: rank [0-9]+ of' <<<"$1" | sed -E 's/^\[[a-z0-9]+\]://; s/ \([a-z_]+, /(/' | sort; }

case "$case_name" in
  build)
    rm -rf "$pkg"
    run cmake --install "$build" --prefix "$pkg/prefix"
    [ "$rc" = 0 ] || fail "cmake --install: $out"
    [ -f "$pkg/prefix/include/mnist_ddp/ddp.hpp" ] || fail "no include/mnist_ddp/ddp.hpp installed"
    [ -f "$pkg/prefix/lib/cmake/mnist_ddp/mnist_ddpConfig.cmake" ] || fail "no package config installed"
    [ -x "$mnist_ddp" ] || fail "no bin/mnist_ddp installed (the launcher)"
    # The API is what is installed: the application's headers and the
    # internals' stay out, and a program that names one does not compile.
    leaked="$(cd "$pkg/prefix" && find . -name '*.hpp' | grep -vE '^\./include/mnist_ddp/' || true)"
    [ -z "$leaked" ] || fail "installed outside include/mnist_ddp: $leaked"
    for internal in "$src"/src/*/*.hpp "$src"/app/*.hpp "$src"/app/*/*.hpp; do
      name="$(basename "$internal")"
      [ -z "$(find "$pkg/prefix" -name "$name")" ] || fail "$name is installed"
    done
    for internal in base/environment comm/store comm/collectives comm/group parallel/reducer; do
      printf '#include <mnist_ddp/%s.hpp>\n' "$internal" >"$tmp/probe.cpp"
      if c++ -E -I"$pkg/prefix/include" "$tmp/probe.cpp" >/dev/null 2>"$tmp/probe.err" ||
         ! grep -q "No such file" "$tmp/probe.err"; then
        fail "a program that includes mnist_ddp/$internal.hpp finds it: $(cat "$tmp/probe.err")"
      fi
    done
    # Unoptimised: the examples' own code is glue around the library, and parsing torch.h is the cost.
    run cmake -S "$src/examples" -B "$examples" "${generator[@]}" -DCMAKE_BUILD_TYPE= \
      "-DCMAKE_PREFIX_PATH=$pkg/prefix" "-DTorch_DIR=$torch_dir"
    [ "$rc" = 0 ] || fail "configuring examples/ against the installed package: $out"
    run cmake --build "$examples" -j "$(nproc)"
    [ "$rc" = 0 ] || fail "building examples/: $out"
    for e in two_inputs resnet dcgan; do [ -x "$examples/$e" ] || fail "no $e built"; done
    grep -q "mnist_ddp_LAUNCHER" "$pkg/prefix/lib/cmake/mnist_ddp/mnist_ddpConfig.cmake" ||
      fail "the package config names no launcher"
    echo "installed into $pkg/prefix; examples/ built against it in $examples"
    ;;

  refuse)
    # Another LibTorch than the one the package was built against: refused
    # before anything compiles, in one line naming both.
    config="$pkg/prefix/lib/cmake/mnist_ddp/mnist_ddpConfig.cmake"
    [ -f "$config" ] || fail "no installed package: the build case runs first"
    version="$(sed -n 's/^set(mnist_ddp_LIBTORCH_VERSION "\(.*\)")$/\1/p' "$config")"
    cuda="$(sed -n 's/^set(mnist_ddp_LIBTORCH_HAS_CUDA \(.*\))$/\1/p' "$config")"
    abi="$(sed -n 's/^set(mnist_ddp_LIBTORCH_CXX11_ABI \(.*\))$/\1/p' "$config")"
    mkdir -p "$tmp/project"
    printf 'cmake_minimum_required(VERSION 3.18)\nproject(consumer LANGUAGES CXX)\nfind_package(mnist_ddp CONFIG REQUIRED)\n' \
      >"$tmp/project/CMakeLists.txt"
    refused() {  # refused NAME VERSION HAS_CUDA ABI WORDS...: a stand-in LibTorch that way is refused
      local name="$1" v="$2" c="$3" a="$4" word line
      shift 4
      mkdir -p "$tmp/$name"
      printf 'set(PACKAGE_VERSION "%s")\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n' "$v" >"$tmp/$name/TorchConfigVersion.cmake"
      {
        echo "set(TORCH_CXX_FLAGS \"-D_GLIBCXX_USE_CXX11_ABI=$a\")"
        [ "$c" = 1 ] && echo 'set(TORCH_CUDA_LIBRARIES /stand-in/libcudart.so)'
        echo 'if(NOT TARGET torch)'
        echo '  add_library(torch INTERFACE IMPORTED)'
        echo 'endif()'
      } >"$tmp/$name/TorchConfig.cmake"
      run cmake -S "$tmp/project" -B "$tmp/$name-build" "${generator[@]}" "-DCMAKE_PREFIX_PATH=$pkg/prefix" "-DTorch_DIR=$tmp/$name"
      [ "$rc" != 0 ] || fail "$name: a LibTorch $v (CUDA $c, ABI $a) was taken"
      line="$(grep -E '^ +mnist_ddp [0-9.]+ was built against' <<<"$out" | sed 's/^ *//')" ||
        fail "$name: no one-line refusal in: $out"
      [ "$(wc -l <<<"$line")" = 1 ] || fail "$name: the refusal is not one line: $out"
      for word in "$@"; do [[ "$line" == *"$word"* ]] || fail "$name: '$word' missing from: $line"; done
      echo "$name: $line"
    }
    refused other-version 9.9.0 "$cuda" "$abi" "LibTorch $version" "this project's is 9.9.0"
    if [ "$cuda" = 1 ]; then
      refused other-cuda "$version" 0 "$abi" "with CUDA" "is CPU only"
    else
      refused other-cuda "$version" 1 "$abi" "CPU only" "has CUDA"
    fi
    refused other-abi "$version" "$cuda" "$((1 - abi))" "uses the other C++ ABI"
    ;;

  launchers)
    # The same two-rank job under every launcher: the same losses, and
    # identical replicas (each example checks them before it prints). A
    # launcher that is not here is named, and the case skips at its end.
    [ -x "$examples/two_inputs" ] || fail "no examples built: the build case runs first"
    missing=()
    run "$examples/two_inputs" 12
    [ "$rc" = 0 ] || fail "two_inputs alone: $out"
    [[ "$out" == *"rank 0 of 1 (alone, cpu)"* ]] || fail "two_inputs alone: $out"
    run "$mnist_ddp" run --nproc 2 -- "$examples/two_inputs" 12
    [ "$rc" = 0 ] || fail "mnist_ddp run two_inputs: $out"
    ours="$(results "$out")"
    [ "$(wc -l <<<"$ours")" = 2 ] || fail "mnist_ddp run: expected two ranks' results, got: $out"
    echo "mnist_ddp run:"$'\n'"$ours"
    python=""
    for p in /usr/bin/python3 python3; do
      if "$p" -c 'import torch.distributed.run' >/dev/null 2>&1; then python="$p"; break; fi
    done
    if [ -n "$python" ]; then
      run "$python" "$src/tests/torchrun.py" --nproc_per_node 2 --master_port "$(free_port)" --redirects 1 --tee 1 \
        --no_python "$examples/two_inputs" 12
      [ "$rc" = 0 ] || fail "torchrun two_inputs: $out"
      [ "$(results "$out")" = "$ours" ] || fail "torchrun's job differs from mnist_ddp run's: $out"
      echo "torchrun: the same"
    else
      missing+=("torchrun (python3-torch)")
    fi
    if command -v mpirun.openmpi >/dev/null; then
      run mpirun.openmpi --allow-run-as-root --oversubscribe -np 2 -x MASTER_PORT="$(free_port)" "$examples/two_inputs" 12
      [ "$rc" = 0 ] || fail "mpirun two_inputs: $out"
      [ "$(results "$out")" = "$ours" ] || fail "mpirun's job differs from mnist_ddp run's: $out"
      echo "mpirun: the same"
    else
      missing+=("mpirun (openmpi-bin)")
    fi
    if command -v mpiexec.mpich >/dev/null; then
      run env MASTER_PORT="$(free_port)" mpiexec.mpich -n 2 "$examples/two_inputs" 12
      [ "$rc" = 0 ] || fail "mpiexec two_inputs: $out"
      [ "$(results "$out")" = "$ours" ] || fail "mpiexec's job differs from mnist_ddp run's: $out"
      echo "mpiexec: the same"
    else
      missing+=("mpiexec (mpich)")
    fi
    # A Kubeflow pod per rank, started without torchrun.
    port="$(free_port)"
    for r in 0 1; do
      env RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" PET_NNODES=2 PET_NODE_RANK=$r \
        PET_NPROC_PER_NODE=1 timeout -k 5 300 "$examples/two_inputs" 12 >"$tmp/pod$r" 2>&1 &
      pods[r]=$!
    done
    for r in 0 1; do wait "${pods[r]}" || fail "Kubeflow pod $r: $(cat "$tmp/pod$r")"; done
    [ "$(results "$(cat "$tmp/pod0" "$tmp/pod1")")" = "$ours" ] || fail "the pods' job differs: $(cat "$tmp"/pod*)"
    echo "Kubeflow pods: the same"

    # The other examples under our launcher, the DCGAN under torchrun too.
    run "$mnist_ddp" run --nproc 2 -- "$examples/dcgan" 10
    [ "$rc" = 0 ] && [ "$(results "$out" | grep -c 'replicas identical')" = 2 ] || fail "dcgan: $out"
    dcgan="$(results "$out")"
    echo "$dcgan"
    if [ -n "$python" ]; then
      run "$python" "$src/tests/torchrun.py" --nproc_per_node 2 --master_port "$(free_port)" --redirects 1 --tee 1 \
        --no_python "$examples/dcgan" 10
      [ "$rc" = 0 ] && [ "$(results "$out")" = "$dcgan" ] || fail "dcgan under torchrun differs: $out"
      echo "dcgan under torchrun: the same"
    fi
    [ -s /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] ||
      skip "no Fashion-MNIST for examples/resnet.cpp: install dataset-fashion-mnist (scripts/install_deps.sh test does)"
    mkdir -p "$tmp/fashion"
    for f in /usr/share/datasets/fashion-mnist/*-ubyte.gz; do gunzip -c "$f" >"$tmp/fashion/$(basename "$f" .gz)"; done
    run "$mnist_ddp" run --nproc 2 -- "$examples/resnet" "$tmp/fashion" 8
    [ "$rc" = 0 ] && [ "$(results "$out" | grep -c 'replicas identical')" = 2 ] || fail "resnet: $out"
    results "$out"
    [ "${#missing[@]}" = 0 ] || skip "every other launcher ran the examples alike; not here: ${missing[*]}"
    ;;

  run-errors)
    # mnist_ddp run's bad inputs: one line, exit 2; a failing worker stops
    # the others and names itself; nothing is left running.
    run "$mnist_ddp" run --nproc 2
    [ "$rc" = 2 ] && [ "$(wc -l <<<"$out")" = 1 ] && [[ "$out" == *"no program"* ]] || fail "no program: rc $rc: $out"
    echo "$out"
    run "$mnist_ddp" run --nproc 2 -- no-such-program-of-ours
    [ "$rc" = 2 ] && [ "$(wc -l <<<"$out")" = 1 ] && [[ "$out" == *"no-such-program-of-ours: no such program on PATH"* ]] ||
      fail "unknown program: rc $rc: $out"
    echo "$out"
    run "$mnist_ddp" run --nproc 0 -- true
    [ "$rc" = 2 ] && [ "$(wc -l <<<"$out")" = 1 ] && [[ "$out" == *"--nproc"* ]] || fail "--nproc 0: rc $rc: $out"
    echo "$out"
    # Rank 0 says which process it is (it execs sleep, so its pid is the
    # sleep's) and would sleep for a minute; rank 1 fails once rank 0 has
    # said so (or after 10 s), so that the launcher has a sleeper to stop.
    printf '#!/bin/sh\nif [ "$LOCAL_RANK" = 1 ]; then\n  i=0\n  while [ ! -s "%s/sleeper" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done\n  exit 3\nfi\necho $$ >"%s/sleeper.tmp" && mv "%s/sleeper.tmp" "%s/sleeper"\nexec sleep 60\n' \
      "$tmp" "$tmp" "$tmp" "$tmp" >"$tmp/flaky"
    chmod 755 "$tmp/flaky"
    start=$SECONDS
    run "$mnist_ddp" run --nproc 2 -- "$tmp/flaky"
    [ "$rc" = 3 ] && [[ "$out" == *"worker rank 1"*"exited with status 3"* ]] || fail "a failing worker: rc $rc: $out"
    [ $((SECONDS - start)) -lt 30 ] || fail "the launcher took $((SECONDS - start)) s to stop the other worker"
    sleeper="$(cat "$tmp/sleeper" 2>/dev/null || true)"
    [[ "$sleeper" =~ ^[1-9][0-9]*$ ]] || fail "rank 0 never started (no pid written): $out"
    ! kill -0 "$sleeper" 2>/dev/null || fail "rank 0 (pid $sleeper) outlived its launcher"
    echo "$out"
    # Restarts: the program starts again, with the restart count it can read.
    printf '#!/bin/sh\necho "start $MNIST_DDP_ROUND rank $LOCAL_RANK"\n[ "$MNIST_DDP_ROUND" = 0 ] && [ "$LOCAL_RANK" = 0 ] && exit 1\nexit 0\n' \
      >"$tmp/once"
    chmod 755 "$tmp/once"
    run "$mnist_ddp" run --nproc 2 --max-restarts 1 -- "$tmp/once"
    [ "$rc" = 0 ] && [[ "$out" == *"restart 1 of 1"* ]] && [[ "$out" == *"start 1 rank 0"* ]] || fail "a restart: rc $rc: $out"
    echo "restarted once, then exit 0"
    ;;

  by-value)
    # A model held by value, as pytorch/examples' cpp/mnist holds one, is
    # refused at compile time in one sentence. The include directories and
    # flags are the examples' own, read from their build (the build case's).
    flags="$(example_flags)"
    printf '%s\n' '#include <mnist_ddp/ddp.hpp>' \
      'struct Net : torch::nn::Module {};' \
      'int main() { auto group = mnist_ddp::init_process_group(); Net model; mnist_ddp::DistributedDataParallel ddp(model, group); }' \
      >"$tmp/by_value.cpp"
    # shellcheck disable=SC2086  # $flags is several words
    if c++ $flags -fsyntax-only "$tmp/by_value.cpp" >"$tmp/by_value.err" 2>&1; then
      fail "a model held by value compiled"
    fi
    grep -q "takes the model by std::shared_ptr or as a TORCH_MODULE holder" "$tmp/by_value.err" ||
      fail "a model held by value is not refused in our words: $(grep -m 3 error "$tmp/by_value.err")"
    echo "a model held by value: $(grep -m 1 -o 'DistributedDataParallel takes the model[^:]*' "$tmp/by_value.err")"
    ;;

  warnings)
    # A program using the API (a hook of its own, the options, a DDP, join)
    # compiled with -Wall -Wextra -Werror against the installed headers
    # fails on one line only: the no_sync() guard it drops at once
    # ([[nodiscard]]). No warning comes from the library: its headers are
    # read with -I, as a Makefile would, not -isystem as CMake's imported
    # target does, which would hide their warnings. One compile.
    flags="$(example_flags)"
    flags="${flags//-isystem $pkg\/prefix\/include/-I $pkg/prefix/include}"
    [[ "$flags" == *"-I $pkg/prefix/include"* ]] || fail "the examples' flags do not name the installed headers: $flags"
    cat >"$tmp/strict.cpp" <<'CPP'
#include <mnist_ddp/ddp.hpp>
#include <torch/torch.h>

struct Halving : mnist_ddp::hooks::CommHook {
  std::string name() const override { return "halving"; }
  mnist_ddp::FuturePtr run(const mnist_ddp::hooks::GradBucket& bucket, mnist_ddp::hooks::Wire& wire) override {
    return wire.allreduce_mean(bucket.buffer());
  }
};

int main() {
  auto group = mnist_ddp::init_process_group(mnist_ddp::ProcessGroupOptions().check_collectives(true));
  auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
  mnist_ddp::DistributedDataParallel ddp(model, group, mnist_ddp::DdpOptions().static_graph(false));
  ddp.register_comm_hook(std::make_shared<Halving>());
  auto guard = ddp.no_sync();
  ddp.join([] {}, mnist_ddp::JoinOptions().divide_by_initial_world_size(false));
  ddp.no_sync();  // line 18: the one diagnostic
  return 0;
}
CPP
    # shellcheck disable=SC2086  # $flags is several words
    if c++ $flags -Wall -Wextra -Werror -fsyntax-only "$tmp/strict.cpp" >"$tmp/strict.err" 2>&1; then
      fail "a no_sync() guard dropped at once compiled without a warning"
    fi
    grep -q "strict.cpp:18:.*\(nodiscard\|ignoring return value\)" "$tmp/strict.err" ||
      fail "a dropped no_sync() guard is not a warning: $(grep -m 3 -E 'error|warning' "$tmp/strict.err")"
    others="$(grep -E '(error|warning):' "$tmp/strict.err" | grep -v 'strict.cpp:18:' || true)"
    [ -z "$others" ] || fail "the API does not compile cleanly under -Wall -Wextra -Werror: $(head -n 3 <<<"$others")"
    echo "the API compiles under -Wall -Wextra -Werror but for the dropped no_sync() guard: $(grep -m 1 -o 'strict.cpp:18:.*' "$tmp/strict.err")"
    ;;

  subdirectory)
    # A project that pulls the checkout in with add_subdirectory gets
    # mnist_ddp::ddp and nothing else: no application, tests or examples to
    # build, nothing to install. Its program, built against it, runs as one
    # job of two ranks under the installed launcher, whose gradients DDP
    # averages: both ranks print the same sum.
    mkdir -p "$tmp/parent"
    printf '%s\n' "cmake_minimum_required(VERSION 3.18)" "project(parent LANGUAGES CXX)" \
      "add_subdirectory(\"$src\" mnist_ddp)" "add_executable(train train.cpp)" \
      "target_link_libraries(train PRIVATE mnist_ddp::ddp)" >"$tmp/parent/CMakeLists.txt"
    cat >"$tmp/parent/train.cpp" <<'EOF'
#include <mnist_ddp/ddp.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>

// One step of a linear model, each rank on data of its own: DDP averages the gradients.
int main() try {
  auto group = mnist_ddp::init_process_group();
  torch::manual_seed(0);
  auto model = std::make_shared<torch::nn::LinearImpl>(4, 1);
  mnist_ddp::DistributedDataParallel ddp(model, group);
  torch::manual_seed(1 + group.rank());
  ddp.forward(torch::randn({8, 4})).sum().backward();
  std::cout << "train: rank " << group.rank() << " of " << group.world_size() << ", gradient sum "
            << model->weight.grad().sum().item<double>() << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "train: " << mnist_ddp::error_line(e) << std::endl;
  std::_Exit(1);
}
EOF
    command -v ninja >/dev/null || skip "no ninja to list the parent project's targets (ninja-build)"
    # Unoptimised, as the examples are built: parsing torch.h is the cost.
    run cmake -S "$tmp/parent" -B "$tmp/parent-build" -G Ninja -DCMAKE_BUILD_TYPE=None "-DTorch_DIR=$torch_dir"
    [ "$rc" = 0 ] || fail "configuring a project that adds the checkout as a subdirectory: $out"
    targets="$(ninja -C "$tmp/parent-build" -t targets all 2>&1)"
    grep -q 'libmnist_ddp\.a' <<<"$targets" || fail "no mnist_ddp library to build in the parent project: $targets"
    for unwanted in 'mnist_ddp/mnist_ddp:' 'mnist_ddp/tests/' 'libmnist_ddp_app' 'examples'; do
      ! grep -q "$unwanted" <<<"$targets" || fail "the parent project would build $unwanted: $(grep "$unwanted" <<<"$targets")"
    done
    ! grep -q '^install' <<<"$targets" || fail "the parent project installs mnist_ddp's files"
    run cmake --build "$tmp/parent-build" -j "$(nproc)"
    [ "$rc" = 0 ] || fail "building the parent project's program with mnist_ddp::ddp: $out"
    run "$mnist_ddp" run --nproc 2 -- "$tmp/parent-build/train"
    [ "$rc" = 0 ] || fail "the parent project's program under mnist_ddp run --nproc 2: rc $rc: $out"
    lines="$(grep -E '^train: rank [01] of 2, gradient sum ' <<<"$out" | sort)" || true
    [ "$(grep -c . <<<"$lines")" = 2 ] || fail "expected a line from each of two ranks: $out"
    [ "$(sed 's/^train: rank [01] //' <<<"$lines" | sort -u | wc -l)" = 1 ] || fail "the ranks' gradients differ: $out"
    echo "a parent project gets mnist_ddp::ddp alone, and its program trains on 2 ranks:"
    echo "$lines"
    ;;

  *) echo "package_test.sh: unknown case $case_name" >&2; exit 2 ;;
esac
