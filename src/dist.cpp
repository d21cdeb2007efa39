#include "mnist_ddp/dist.hpp"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>
#ifdef MNIST_DDP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/NCCLUtils.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <algorithm>
#include <functional>

#include "mnist_ddp/port.hpp"
#include "mnist_ddp/shared_memory.hpp"

// Note on the store's address. LibTorch's TCPStore listens on every
// interface and has no option to choose one, but a store reachable from the
// network lets anyone there join or disturb the job. The mnist_ddp
// executable exports this bind() (see CMakeLists.txt), so LibTorch's calls
// land here: while open_store() hosts a store, a wildcard address is narrowed
// to --master-addr's (loopback for a single-node run) and the IPv6 wildcard
// is refused, so that the store falls back to that IPv4 address. Every other
// bind passes through unchanged.
namespace {
std::atomic<in_addr_t> g_store_address{INADDR_NONE};
}

extern "C" int bind(int fd, const sockaddr* addr, socklen_t len) {
  using Bind = int (*)(int, const sockaddr*, socklen_t);
  static const auto real_bind = reinterpret_cast<Bind>(dlsym(RTLD_NEXT, "bind"));
  const in_addr_t narrow = g_store_address.load();
  if (narrow != INADDR_NONE && addr) {
    if (addr->sa_family == AF_INET6 &&
        IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr)) {
      errno = EADDRNOTAVAIL;
      return -1;
    }
    if (addr->sa_family == AF_INET && reinterpret_cast<const sockaddr_in*>(addr)->sin_addr.s_addr == INADDR_ANY) {
      sockaddr_in narrowed = *reinterpret_cast<const sockaddr_in*>(addr);
      narrowed.sin_addr.s_addr = narrow;
      return real_bind(fd, reinterpret_cast<const sockaddr*>(&narrowed), sizeof narrowed);
    }
  }
  return real_bind(fd, addr, len);
}

namespace mnist_ddp {
namespace {

// The IPv4 address `host` resolves to.
in_addr_t ipv4_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res)
    throw std::runtime_error("cannot resolve --master-addr " + host + " to an IPv4 address");
  const in_addr_t address = reinterpret_cast<const sockaddr_in*>(res->ai_addr)->sin_addr.s_addr;
  freeaddrinfo(res);
  return address;
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

std::string error_text(const std::exception& e) {
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) return first_line(c10e->what_without_backtrace());
  return first_line(e.what());
}

// The local address that packets to `host` leave from: Gloo listens there, so
// peers on other machines can reach it. Loopback for a single-node job.
std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res)
    throw std::runtime_error("cannot resolve --master-addr " + host);
  std::string address = "127.0.0.1";
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof local;
    char text[INET_ADDRSTRLEN];
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        inet_ntop(AF_INET, &local.sin_addr, text, sizeof text))
      address = text;
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return address;
}


// Waits for `keys`; on timeout throws `describe(missing keys)`.
void wait_for(c10d::Store& store, const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
              const std::function<std::string(const std::vector<std::string>&)>& describe) {
  try {
    store.wait(keys, timeout);
  } catch (const std::exception&) {
    std::vector<std::string> missing;
    try {
      for (const auto& k : keys)
        if (!store.check({k})) missing.push_back(k);
    } catch (const std::exception& e) {
      throw PeerLost("lost the rendezvous store (its host stopped): " + error_text(e));
    }
    if (missing.empty()) throw;
    throw std::runtime_error(describe(missing));
  }
}

// The numbers in keys like "nodes/3/size" or "settings/3", joined: "1, 3".
std::string numbers_in(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) {
    const size_t a = k.find('/') + 1, b = k.find('/', a);
    out += (out.empty() ? "" : ", ") + k.substr(a, b == std::string::npos ? std::string::npos : b - a);
  }
  return out;
}

std::map<std::string, std::string> parse_settings(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const size_t eq = line.find('=');
    out[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return out;
}

// Throws naming the first setting in which `theirs` (rank `other`) differs from `mine`.
void compare_settings(const std::string& mine, int me, const std::string& theirs, int other) {
  const auto a = parse_settings(mine), b = parse_settings(theirs);
  for (const auto& [name, value] : a) {
    const auto it = b.find(name);
    const std::string other_value = it == b.end() ? "(none)" : it->second;
    if (other_value == value) continue;
    std::string flag = name;
    std::replace(flag.begin(), flag.end(), '_', '-');
    throw std::runtime_error("--" + flag + " differs between ranks: rank " + std::to_string(me) + " has '" + value +
                             "', rank " + std::to_string(other) + " has '" + other_value +
                             "'; every node must train with the same settings");
  }
}

GroupPtr create_group(const StorePtr& store, const std::string& backend, int rank, int world_size,
                      const std::string& gloo_address, std::chrono::milliseconds timeout) {
  if (backend == "nccl") {
#ifdef MNIST_DDP_WITH_CUDA
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, options);
#else
    throw std::runtime_error("this mnist_ddp was built without CUDA; NCCL is not available");
#endif
  }
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(gloo_address));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, options);
}

}  // namespace

class Heartbeat {
 public:
  Heartbeat(StorePtr store, int rank) : store_(std::move(store)), key_("heartbeat/" + std::to_string(rank)) {
    thread_ = std::thread([this] { beat(); });
  }
  ~Heartbeat() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void beat() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (int64_t n = 1; !stopping_; ++n) {
      lock.unlock();
      try {
        store_->set(key_, bytes_of(std::to_string(n)));
      } catch (const std::exception&) {
        return;  // the store is gone: so is its host, and someone will say so
      }
      lock.lock();
      cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stopping_; });
    }
  }

  StorePtr store_;
  std::string key_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;
};

std::vector<int> Dist::silent_ranks() const {
  auto read = [this] {
    std::vector<std::string> beats(world_size);
    for (int r = 0; r < world_size; ++r) {
      const std::string key = "heartbeat/" + std::to_string(r);
      if (store->check({key})) beats[r] = text_of(store->get(key));
    }
    return beats;
  };
  std::vector<int> silent;
  try {
    const auto before = read();
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    const auto after = read();
    for (int r = 0; r < world_size; ++r)
      if (r != rank && before[r] == after[r]) silent.push_back(r);
  } catch (const std::exception&) {
    silent = {0};
  }
  return silent;
}

namespace {

// The rank's group, with the store prefix `name`, behind an ordered stream;
// with `shared_memory` (every rank on this host), CPU sums go through a
// SharedMemoryReducer.
std::shared_ptr<Collectives> make_collectives(const StorePtr& store, const std::string& name, const std::string& backend,
                                              int rank, int world_size, const torch::Device& device,
                                              const std::string& gloo_address, std::chrono::milliseconds timeout,
                                              bool shared_memory) {
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store);
  GroupPtr group;
  try {
    group = create_group(prefixed, backend, rank, world_size, gloo_address, timeout);
  } catch (const std::exception& e) {
    try {
      store->check({"settings/0"});
    } catch (const std::exception&) {  // the store's host stopped, and whoever stopped it says why
      throw PeerLost("lost the rendezvous store (its host stopped): " + error_text(e));
    }
    throw std::runtime_error("could not form the process group with all " + std::to_string(world_size) +
                             " ranks within " + std::to_string(timeout.count() / 1000) + " s (" + error_text(e) + ")");
  }
  std::unique_ptr<SharedMemoryReducer> shared;
  if (shared_memory && world_size > 1)
    shared = std::make_unique<SharedMemoryReducer>(*prefixed, rank, world_size, timeout,
                                                   [&] { group->barrier()->wait(); });
  return std::make_shared<Collectives>(group, device, backend == "nccl", std::move(shared));
}

}  // namespace

Dist make_dist(StorePtr store, int rank, int world_size, const std::string& backend, torch::Device device,
               std::chrono::milliseconds timeout, bool shared_memory) {
  Dist d;
  d.rank = rank;
  d.world_size = world_size;
  d.backend = backend;
  d.device = device;
  d.timeout = timeout;
  d.store = std::move(store);
  d.comm = make_collectives(d.store, "main", backend, rank, world_size, device, d.gloo_address, timeout,
                            shared_memory && backend == "gloo" && device.is_cpu());
  return d;
}

std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string text_of(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

namespace {
// Whether this process's stores use libuv: tried where LibTorch offers it,
// given up for good once LibTorch says it was built without.
std::atomic<bool> g_store_libuv{port::kStoreMayUseLibUv};
}  // namespace

c10::intrusive_ptr<c10d::TCPStore> open_store(const std::string& addr, int port, bool host,
                                              std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(port);
  so.isServer = host;
  so.waitWorkers = false;  // the world size may not be known yet; connect() waits for the ranks
  so.timeout = timeout;
  try {
    if (host) g_store_address = ipv4_address(addr);
    c10::intrusive_ptr<c10d::TCPStore> store;
    for (;;) {
      port::set_store_libuv(so, g_store_libuv);
      try {
        store = c10::make_intrusive<c10d::TCPStore>(addr, so);
        break;
      } catch (const std::exception& e) {
        if (!g_store_libuv || error_text(e).find("libuv") == std::string::npos) throw;
        g_store_libuv = false;  // this LibTorch has no libuv: its classic store
      }
    }
    g_store_address = INADDR_NONE;
    return store;
  } catch (const std::exception& e) {
    g_store_address = INADDR_NONE;
    const std::string why = error_text(e);
    if (host) {
      if (why.find("Address already in use") != std::string::npos || why.find("errno: 98") != std::string::npos ||
          why.find("EADDRINUSE") != std::string::npos)
        throw std::runtime_error("--master-port " + std::to_string(port) +
                                 " is already in use on this machine; choose another port or 0 for a free one");
      throw std::runtime_error("cannot host the rendezvous store at " + addr + ":" + std::to_string(port) + ": " + why);
    }
    throw std::runtime_error("could not reach the rendezvous store at " + addr + ":" + std::to_string(port) +
                             " within " + std::to_string(timeout.count() / 1000) + " s (" + why + ")");
  }
}

Dist connect(const WorkerEnv& env, const Placement& placement, double timeout_seconds, const Settings& settings) {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  const auto seconds = std::to_string(static_cast<int64_t>(timeout_seconds)) + " s";
  torch::Device device = torch::kCPU;
  if (!placement.devices.empty()) {
    if (env.local_rank >= static_cast<int>(placement.devices.size()))
      throw UsageError("local rank " + std::to_string(env.local_rank) + " has no GPU: this node's --gpus (or visible " +
                       "GPUs) give " + std::to_string(placement.devices.size()) + "; name one per local worker, " +
                       "repeat ids with --backend gloo, or train on the CPU with --backend gloo");
    const int index = placement.devices[env.local_rank];
    if (index >= static_cast<int>(torch::cuda::device_count()))
      throw std::runtime_error("CUDA device " + std::to_string(index) + " does not exist (" +
                               std::to_string(torch::cuda::device_count()) + " visible)");
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
    use_device(device);
  }

  // ---- The store: our launcher's (node 0's), torchrun's agent's, else rank 0's. ----
  const bool host = env.round < 0 && !env.agent_store && env.rank == 0;
  StorePtr store;
  try {
    store = open_store(env.master_addr, env.master_port, host, timeout);
  } catch (const std::runtime_error& e) {
    if (!host || std::string(e.what()).find("already in use") == std::string::npos) throw;
    throw std::runtime_error("MASTER_PORT " + std::to_string(env.master_port) + " is already in use on " +
                             env.master_addr + ": export MASTER_PORT with a free port for this job");
  }
  if (env.round >= 0) store = c10::make_intrusive<c10d::PrefixStore>("round/" + std::to_string(env.round), store);
  if (env.agent_store)
    store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(env.restart), store);

  // ---- Ranks: given by torchrun or Slurm, else agreed by the nodes. ----
  int rank = env.rank, world_size = env.world_size;
  if (rank < 0) {
    const std::string me = "nodes/" + std::to_string(env.node_rank);
    if (env.local_rank == 0) {
      if (store->add(me + "/claims", 1) > 1)
        throw std::runtime_error("another node also started with --node-rank " + std::to_string(env.node_rank) +
                                 "; give each node its own");
      store->set(me + "/size", bytes_of(std::to_string(env.local_world_size)));
    }
    std::vector<std::string> keys;
    for (int k = 0; k < env.nnodes; ++k) keys.push_back("nodes/" + std::to_string(k) + "/size");
    wait_for(*store, keys, timeout, [&](const std::vector<std::string>& missing) {
      return "node " + numbers_in(missing) + " of " + std::to_string(env.nnodes) + " never joined within " + seconds +
             ": start mnist_ddp there with --nnodes " + std::to_string(env.nnodes) +
             " --node-rank <its rank> --master-addr " + env.master_addr + " --master-port " +
             std::to_string(env.master_port);
    });
    world_size = 0;
    int first = 0;  // this node's first rank
    for (int k = 0; k < env.nnodes; ++k) {
      const int size = std::stoi(text_of(store->get(keys[k])));
      if (k < env.node_rank) first += size;
      world_size += size;
    }
    rank = first + env.local_rank;
  }

  // ---- Settings: rank 0 checks everyone's, everyone checks rank 0's. ----
  std::string mine;
  for (const auto& [name, value] : settings) mine += name + "=" + value + "\n";
  store->set("settings/" + std::to_string(rank), bytes_of(mine));
  auto never_arrived = [&](const std::vector<std::string>& missing) {
    return "rank " + numbers_in(missing) + " of " + std::to_string(world_size) + " never arrived within " + seconds;
  };
  if (rank == 0) {
    for (int r = 1; r < world_size; ++r) {
      const std::string key = "settings/" + std::to_string(r);
      wait_for(*store, {key}, timeout, never_arrived);
      compare_settings(mine, 0, text_of(store->get(key)), r);
    }
  } else {
    wait_for(*store, {"settings/0"}, timeout, never_arrived);
    compare_settings(text_of(store->get("settings/0")), 0, mine, rank);
  }

  Dist d;
  d.rank = rank;
  d.world_size = world_size;
  d.backend = placement.backend;
  d.device = device;
  d.timeout = timeout;
  d.restart = env.restart;
  d.gloo_address = local_address_towards(env.master_addr);
  d.store = store;
  d.heartbeat_ = std::make_shared<Heartbeat>(store, rank);
  // A CPU job on one host sums through shared memory (shared_memory.hpp).
  const bool one_host = world_size == env.local_world_size;
  d.comm = make_collectives(d.store, "main", d.backend, rank, world_size, device, d.gloo_address, timeout,
                            one_host && d.backend == "gloo" && device.is_cpu());
  return d;
}

Runtime runtime_of(const torch::Device& device) {
  Runtime r;
  r.libtorch = TORCH_VERSION;
  r.store = g_store_libuv ? "libuv" : "classic";
  r.device = device.str();
#ifdef MNIST_DDP_WITH_CUDA
  r.cuda = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
  r.nccl = c10d::getNcclVersion();
  if (device.is_cuda()) r.device += std::string(" (") + at::cuda::getDeviceProperties(device.index())->name + ")";
#endif
  return r;
}

std::string Runtime::describe() const {
  const std::string store_kind = ", " + store + " store";
  if (cuda.empty()) return "LibTorch " + libtorch + " (CPU only: no CUDA, no NCCL)" + store_kind;
  return "LibTorch " + libtorch + ", CUDA " + cuda + ", NCCL " + nccl + ", device " + device + store_kind;
}

void use_device(const torch::Device& device) {
  if (device.is_cuda()) c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(device);
}

}  // namespace mnist_ddp
