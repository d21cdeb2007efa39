// Every difference between the LibTorch versions we build against (Debian
// 12's 1.13, Debian 13's 2.6 for the CPU and with CUDA, PyTorch 2.x's) in
// one place, so that no other file asks which LibTorch it is built with.
#pragma once

#include <torch/version.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif
#if defined(MNIST_DDP_WITH_CUDA)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace mnist_ddp::port {

// LibTorch 1.13 calls the group type ProcessGroup, 2.x calls the per-backend
// type Backend; `Group` names whichever this LibTorch has.
#if TORCH_VERSION_MAJOR >= 2
using Group = c10d::Backend;
#else
using Group = c10d::ProcessGroup;
#endif
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// Shuts an NCCL group down: newer LibTorch warns at exit about one left
// open. ProcessGroupNCCL::shutdown() exists from 2.2; 1.13 to 2.1 have none
// (their destructor tears the communicators down).
inline void shut_down_nccl(Group& group) {
#if defined(MNIST_DDP_WITH_CUDA) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2))
  static_cast<c10d::ProcessGroupNCCL&>(group).shutdown();
#endif
}

// Aborts an NCCL group's communicators, so that its collectives still in
// flight (waiting on a peer that will not come) end with an error:
// ProcessGroupNCCL::abort() from 2.2; before, nothing to call (its
// watchdog, which c10d runs itself there, is the only way).
inline void abort_nccl(Group& group) {
#if defined(MNIST_DDP_WITH_CUDA) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2))
  static_cast<c10d::ProcessGroupNCCL&>(group).abort();
#endif
}

// Autocast for `device`'s type: on or off, and the dtype it lowers to.
// LibTorch 2.4 on names the device type; before, the CPU and CUDA have
// functions of their own (which 2.x keeps, deprecated, for a while).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline bool autocast_enabled(c10::DeviceType type) { return at::autocast::is_autocast_enabled(type); }
inline c10::ScalarType autocast_dtype(c10::DeviceType type) { return at::autocast::get_autocast_dtype(type); }
inline void set_autocast(c10::DeviceType type, bool enabled, c10::ScalarType dtype) {
  at::autocast::set_autocast_dtype(type, dtype);
  at::autocast::set_autocast_enabled(type, enabled);
}
#else
inline bool autocast_enabled(c10::DeviceType type) {
  return type == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
}
inline c10::ScalarType autocast_dtype(c10::DeviceType type) {
  return type == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
}
inline void set_autocast(c10::DeviceType type, bool enabled, c10::ScalarType dtype) {
  if (type == c10::DeviceType::CUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
    at::autocast::set_cpu_enabled(enabled);
  }
}
#endif

// Records every operator run while it lives and writes a Chrome trace to
// `path` at its end (bench.cpp's CPU profile): 1.x's legacy RecordProfile,
// which 2.x no longer has.
#if TORCH_VERSION_MAJOR < 2
using RecordProfile = torch::autograd::profiler::RecordProfile;
#else
struct RecordProfile {
  explicit RecordProfile(const std::string&) {
    throw std::runtime_error("profile: this needs LibTorch 1.x's legacy profiler");
  }
};
#endif

// TCPStoreOptions::useLibUV exists from LibTorch 2.2 on (and is true by
// default from 2.4), but a LibTorch built without libuv (Debian 13's, CPU
// and CUDA) refuses a store that asks for it. Detected by the field, not by
// a version number.
template <typename Options, typename = void>
struct HasLibUvOption : std::false_type {};
template <typename Options>
struct HasLibUvOption<Options, std::void_t<decltype(std::declval<Options&>().useLibUV)>> : std::true_type {};

constexpr bool kStoreMayUseLibUv = HasLibUvOption<c10d::TCPStoreOptions>::value;

// Sets whether the store uses libuv, where this LibTorch has the choice.
template <typename Options = c10d::TCPStoreOptions>
void set_store_libuv(Options& options, bool libuv) {
  if constexpr (HasLibUvOption<Options>::value) options.useLibUV = libuv;
}

}  // namespace mnist_ddp::port
