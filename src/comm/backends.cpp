#include "comm/backends.hpp"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef MNIST_DDP_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <deque>
#include <mutex>

#include "mnist_ddp/base/errors.hpp"

namespace mnist_ddp {
namespace {

Backend gloo() {
  Backend b;
  b.name = "gloo";
  b.takes = [](const c10::Device& d) { return d.is_cpu() || d.is_cuda(); };
  b.slow_16bit_sums = true;
  b.bfloat16 = false;
  b.create = [](const StorePtr& store, int rank, int world_size, std::chrono::milliseconds timeout,
                const std::string& address) -> GroupPtr {
    // Gloo's own timeout a little later than the group's: a collective that
    // waits that long is the watch's to name (watch.hpp), with where every
    // rank waits, rather than Gloo's "timed out" on one socket.
    auto options = c10d::ProcessGroupGloo::Options::create(timeout + std::chrono::seconds(5));
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(address));
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, options);
  };
  b.shut_down = [](port::Group&) {};
  b.abort = [](port::Group&) {};
  return b;
}

Backend nccl() {
  Backend b;
  b.name = "nccl";
  b.takes = [](const c10::Device& d) { return d.is_cuda(); };
  b.on_device = true;
  b.lanes = false;
  b.reduce_scatter = true;
#ifdef MNIST_DDP_WITH_CUDA
  b.create = [](const StorePtr& store, int rank, int world_size, std::chrono::milliseconds timeout,
                const std::string&) -> GroupPtr {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, options);
  };
  b.shut_down = [](port::Group& group) { port::shut_down_nccl(group); };
  b.abort = [](port::Group& group) { port::abort_nccl(group); };
#else
  b.unavailable = "this build of mnist_ddp has no CUDA (its LibTorch is CPU-only); use gloo";
#endif
  return b;
}

std::mutex g_mutex;
std::deque<Backend>& registry() {  // a deque: what backend_named() returned stays where it is
  static std::deque<Backend> backends{nccl(), gloo()};  // in the order "auto" prefers them
  return backends;
}

}  // namespace

const Backend& backend_named(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::string known;
  for (const Backend& b : registry()) {
    if (b.name == name) {
      if (!b.unavailable.empty()) throw UsageError("backend " + name + ": " + b.unavailable);
      return b;
    }
    known += (known.empty() ? "" : ", ") + b.name;
  }
  throw UsageError("backend '" + name + "': expected auto, " + known);
}

const Backend& default_backend_for(const c10::Device& device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const Backend& b : registry())
    if (b.unavailable.empty() && b.on_device && b.takes(device)) return b;
  for (const Backend& b : registry())
    if (b.name == "gloo") return b;
  throw UsageError("no backend takes " + device.str());
}

}  // namespace mnist_ddp
