// The backends a process group is made of, in one place: Gloo, and NCCL
// where the LibTorch has CUDA. Everything the rest of the library asks of a
// backend is a field here, so a new one (MPI, UCC) joins as one more entry
// of backends.cpp's registry, without a change to the collectives. Not
// installed.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "base/port.hpp"
#include "comm/store.hpp"

namespace mnist_ddp {

using GroupPtr = c10::intrusive_ptr<port::Group>;

struct Backend {
  std::string name;  // "gloo", "nccl"
  // Why this build cannot make it ("" : it can), for the one-line refusal.
  std::string unavailable;
  // Which devices' tensors its collectives take.
  std::function<bool(const c10::Device&)> takes;
  // Its small blocking collectives (broadcasts of bytes, checks) travel on
  // the rank's device (NCCL) rather than the CPU (Gloo, whose every
  // collective takes CPU tensors).
  bool on_device = false;
  // Groups over one store prefix each may run their collectives at the same
  // time (Gloo: the bulk and the quick lane are two groups); false: a rank's
  // lanes share one group (NCCL serialises a device's collectives anyway).
  bool lanes = true;
  // Adds 16-bit floats one element at a time (Gloo): large float16 and
  // bfloat16 sums go round the library's own ring instead (collectives.hpp).
  bool slow_16bit_sums = false;
  // Knows bfloat16 (Gloo of LibTorch 1.13 does not): where it does not, a
  // bfloat16 tensor is broadcast or gathered as the float16 of its bytes
  // (moved, never added: the bits arrive as they left).
  bool bfloat16 = true;
  // Has a reduce_scatter of its own, each rank receiving only its chunk
  // (NCCL); where not, the library sums the whole input and keeps its chunk.
  bool reduce_scatter = false;
  // Forms this rank's group over `store` (whose keys it owns) within
  // `timeout`. `address`: where a socket-based backend listens.
  std::function<GroupPtr(const StorePtr& store, int rank, int world_size, std::chrono::milliseconds timeout,
                         const std::string& address)>
      create;
  // Lets go of a group cleanly at the end of a run (NCCL warns otherwise).
  std::function<void(port::Group&)> shut_down;
  // Ends a group's collectives still in flight, for good (NCCL: aborts its
  // communicators, so that kernels waiting on a peer return); a no-op where
  // a waiter can be woken otherwise (Gloo).
  std::function<void(port::Group&)> abort;
};

// The backend `name` names; UsageError naming the known ones, or why this
// build has none of that name.
const Backend& backend_named(const std::string& name);
// The backend "auto" stands for on `device`: the first registered that
// takes it and prefers it (NCCL on a GPU), else Gloo.
const Backend& default_backend_for(const c10::Device& device);

}  // namespace mnist_ddp
