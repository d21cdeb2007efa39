#include "mnist_ddp/comm/rendezvous.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef MNIST_DDP_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/comm/runtime.hpp"
#include "mnist_ddp/comm/shared_memory.hpp"

namespace mnist_ddp {
namespace {

// What a rank says when the store stops answering: its host stopped, and
// whoever stopped it says why.
PeerLost store_lost(const std::exception& e) {
  return PeerLost("lost the rendezvous store (its host stopped): " + error_line(e));
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


// Waits for `keys`; on timeout throws `describe(missing keys)`; a store
// that stopped answering is StoreStalled, one that went away PeerLost.
void wait_for(const StoreClient& store, const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
              const std::function<std::string(const std::vector<std::string>&)>& describe) {
  std::vector<std::string> missing;
  try {
    missing = store.wait(keys, timeout);
  } catch (const StoreStalled&) {
    throw;
  } catch (const std::exception& e) {
    throw store_lost(e);
  }
  if (!missing.empty()) throw std::runtime_error(describe(missing));
}

// Values in the store are anyone's to write who can reach it: what the
// rendezvous reads is checked, and a value no mnist_ddp wrote is named.
std::runtime_error foreign_value(const StoreClient& store, const std::string& key, const std::string& value) {
  std::string shown;
  for (char c : value.substr(0, 40)) shown += std::isprint(static_cast<unsigned char>(c)) ? c : '?';
  return std::runtime_error(store.where() + " holds '" + shown + "' at " + key +
                            ", which no mnist_ddp wrote: another process is writing into this job's store");
}

// How a node's launcher claims its --node-rank: its host and pid, so that
// a second launcher with the same --node-rank is told from the first, and
// from anything else a process could write there.
const std::string kClaim = "mnist_ddp launcher ";

std::string this_launchers_claim() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return kClaim + "pid " + std::to_string(getppid()) + " on " + host;
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

// The rank's group, with the store prefix `name`, behind an ordered stream;
// with `shared_memory` (every rank on this host), CPU sums go through a
// SharedMemoryReducer.
std::shared_ptr<CollectiveStream> make_stream(const StorePtr& store, const std::string& name, const std::string& backend,
                                              int rank, int world_size, const torch::Device& device,
                                              const std::string& gloo_address, std::chrono::milliseconds timeout,
                                              bool shared_memory) {
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store);
  GroupPtr group;
  try {
    // Bounded as every store request is (store.hpp, "Note on stalls"): the
    // group meets its peers through the store.
    group = StoreClient::within(timeout + std::chrono::seconds(5),
                                "could not form the process group with all " + std::to_string(world_size) +
                                    " ranks within " + std::to_string(timeout.count() / 1000) +
                                    " s: the store stopped answering",
                                [=] {
                                  use_device(device);  // the helper thread's, as the caller's
                                  return create_group(prefixed, backend, rank, world_size, gloo_address, timeout);
                                });
  } catch (const StoreStalled&) {
    throw;
  } catch (const std::exception& e) {
    try {
      StoreClient(store, std::chrono::seconds(5), "the store").check({"settings/0"});
    } catch (const std::exception&) {
      throw store_lost(e);
    }
    throw std::runtime_error("could not form the process group with all " + std::to_string(world_size) +
                             " ranks within " + std::to_string(timeout.count() / 1000) + " s (" + error_line(e) + ")");
  }
  std::unique_ptr<SharedMemoryReducer> shared;
  if (shared_memory && world_size > 1)
    shared = std::make_unique<SharedMemoryReducer>(*prefixed, rank, world_size, timeout,
                                                   [&] { group->barrier()->wait(); });
  return std::make_shared<CollectiveStream>(group, device, backend == "nccl", std::move(shared));
}

// The store the workers of this start meet in, and which start of the job
// it is: our launcher's (node 0's) store, under the round's prefix;
// torchrun's agent's, under the prefix of the start the ranks agree on;
// else a store rank 0 hosts.
//
// Note on torchrun's restarts. Each agent counts only the restarts its own
// workers caused (TORCHELASTIC_RESTART_COUNT, pytorch#108158): after one
// node's worker fails, the other nodes' workers start again with the old
// count, and a prefix made of it would put the ranks of one start in two
// rooms. The agent's store outlives the starts, so each rank counts its own
// starts there: every start of the job starts every rank once, so the
// counts agree, and name the start.
std::pair<StorePtr, int> open_job_store(const WorkerEnv& env, std::chrono::milliseconds timeout) {
  const bool host = !env.ours() && !env.agent_store && env.rank == 0;
  StorePtr store;
  try {
    store = open_store(env.master_addr, env.master_port, host, timeout);
  } catch (const PortInUse&) {
    throw std::runtime_error("MASTER_PORT " + std::to_string(env.master_port) + " is already in use on " +
                             env.master_addr + ": export MASTER_PORT with a free port for this job");
  }
  if (env.ours()) return {c10::make_intrusive<c10d::PrefixStore>("round/" + std::to_string(env.round), store), env.round};
  if (!env.agent_store) return {store, env.restart};
  const StoreClient client(store, timeout,
                           "torchrun's store at " + env.master_addr + ":" + std::to_string(env.master_port));
  const int start = static_cast<int>(client.add("mnist_ddp/starts/rank_" + std::to_string(env.rank), 1)) - 1;
  return {c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(start), store), start};
}

// This rank's place among the nodes' workers when the launcher left it open:
// each node's local rank 0 claims its node rank and announces its worker
// count; node 0's ranks come first. Returns (rank, world size).
std::pair<int, int> agree_on_ranks(const StoreClient& store, const WorkerEnv& env, std::chrono::milliseconds timeout) {
  const std::string me = "nodes/" + std::to_string(env.node_rank);
  if (env.local_rank == 0) {
    const std::string mine = this_launchers_claim(), key = me + "/claim";
    std::string held = store.compare_set(key, "", mine);
    // Garbage a neighbour left there is no claim: replaced, unless it changes meanwhile.
    if (held != mine && held.rfind(kClaim, 0) != 0) held = store.compare_set(key, held, mine);
    if (held != mine && held.rfind(kClaim, 0) == 0)
      throw std::runtime_error("another node (the launcher with " + held.substr(kClaim.size()) +
                               ") also started with --node-rank " + std::to_string(env.node_rank) +
                               "; give each node its own");
    if (held != mine) throw foreign_value(store, key, held);
    store.set(me + "/size", std::to_string(env.local_world_size));
  }
  std::vector<std::string> keys;
  for (int k = 0; k < env.nnodes; ++k) keys.push_back("nodes/" + std::to_string(k) + "/size");
  wait_for(store, keys, timeout, [&](const std::vector<std::string>& missing) {
    return "node " + numbers_in(missing) + " of " + std::to_string(env.nnodes) + " never joined within " +
           std::to_string(timeout.count() / 1000) + " s: start mnist_ddp there with --nnodes " +
           std::to_string(env.nnodes) + " --node-rank <its rank> --master-addr " + env.master_addr +
           " --master-port " + std::to_string(env.master_port);
  });
  int world_size = 0, first = 0;  // first: this node's first rank
  for (int k = 0; k < env.nnodes; ++k) {
    const std::string text = store.get(keys[k]);
    char* end = nullptr;
    const long size = std::strtol(text.c_str(), &end, 10);
    if (text.empty() || *end || size < 1 || size > (1 << 20)) throw foreign_value(store, keys[k], text);
    if (k < env.node_rank) first += static_cast<int>(size);
    world_size += static_cast<int>(size);
  }
  return {first + env.local_rank, world_size};
}

// Rank 0 checks everyone's settings, everyone checks rank 0's.
void check_settings(const StoreClient& store, int rank, int world_size,
                    const std::vector<std::pair<std::string, std::string>>& settings,
                    std::chrono::milliseconds timeout) {
  std::string mine;
  for (const auto& [name, value] : settings) mine += name + "=" + value + "\n";
  store.set("settings/" + std::to_string(rank), mine);
  auto never_arrived = [&](const std::vector<std::string>& missing) {
    return "rank " + numbers_in(missing) + " of " + std::to_string(world_size) + " never arrived within " +
           std::to_string(timeout.count() / 1000) + " s";
  };
  if (rank == 0) {
    for (int r = 1; r < world_size; ++r) {
      const std::string key = "settings/" + std::to_string(r);
      wait_for(store, {key}, timeout, never_arrived);
      compare_settings(mine, 0, store.get(key), r);
    }
  } else {
    wait_for(store, {"settings/0"}, timeout, never_arrived);
    compare_settings(store.get("settings/0"), 0, mine, rank);
  }
}

}  // namespace

// Every rank beats into the store once a second. Its thread may be blocked
// on a stalled store when the job ends: then it is left to the process's
// end rather than waited for.
class Heartbeat {
 public:
  Heartbeat(StorePtr store, int rank, std::chrono::milliseconds timeout)
      : state_(std::make_shared<State>(StoreClient(std::move(store), timeout, "the store"))) {
    std::thread([state = state_, key = "heartbeat/" + std::to_string(rank)] { beat(*state, key); }).detach();
  }
  ~Heartbeat() {
    std::unique_lock<std::mutex> lock(state_->mutex);
    state_->stopping = true;
    state_->cv.notify_all();
    state_->cv.wait_for(lock, std::chrono::seconds(1), [this] { return state_->stopped; });
  }

 private:
  struct State {
    explicit State(StoreClient c) : client(std::move(c)) {}
    StoreClient client;
    std::mutex mutex;
    std::condition_variable cv;
    bool stopping = false, stopped = false;
  };

  static void beat(State& state, const std::string& key) {
    std::unique_lock<std::mutex> lock(state.mutex);
    for (int64_t n = 1; !state.stopping; ++n) {
      lock.unlock();
      try {
        state.client.set(key, std::to_string(n));
      } catch (const std::exception&) {
        lock.lock();
        break;  // the store is gone or stalled: someone will say so
      }
      lock.lock();
      state.cv.wait_for(lock, std::chrono::seconds(1), [&] { return state.stopping; });
    }
    state.stopped = true;
    state.cv.notify_all();
  }

  std::shared_ptr<State> state_;
};

std::vector<int> Job::silent_ranks() const {
  const StoreClient client(store, std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(5)), "the store");
  auto read = [&] {
    std::vector<std::string> beats(world_size);
    for (int r = 0; r < world_size; ++r) {
      const std::string key = "heartbeat/" + std::to_string(r);
      if (client.check({key})) beats[r] = client.get(key);
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
  } catch (const StoreStalled&) {
    // A stalled store says nothing about who is gone.
  } catch (const std::exception&) {
    silent = {0};
  }
  return silent;
}

Job make_job(StorePtr store, int rank, int world_size, const std::string& backend, torch::Device device,
             std::chrono::milliseconds timeout, bool shared_memory, const std::string& gloo_address) {
  Job job;
  job.rank = rank;
  job.world_size = world_size;
  job.backend = backend;
  job.device = device;
  job.timeout = timeout;
  job.gloo_address = gloo_address;
  job.store = std::move(store);
  job.heartbeat_ = std::make_shared<Heartbeat>(job.store, rank, timeout);
  const bool shm = shared_memory && backend == "gloo" && device.is_cpu();
  job.stream = make_stream(job.store, "main", backend, rank, world_size, device, gloo_address, timeout, shm);
  job.quick = backend == "nccl" || world_size == 1
                  ? job.stream
                  : make_stream(job.store, "quick", backend, rank, world_size, device, gloo_address, timeout, shm);
  return job;
}

Job join_job(const WorkerEnv& env, const std::string& backend, torch::Device device,
             std::chrono::milliseconds timeout, const std::vector<std::pair<std::string, std::string>>& settings) {
  use_device(device);
  const auto [store, restart] = open_job_store(env, timeout);
  const StoreClient client(store, timeout,
                           "the rendezvous store at " + env.master_addr + ":" + std::to_string(env.master_port));
  const auto [rank, world_size] = env.rank < 0 ? agree_on_ranks(client, env, timeout)
                                               : std::pair<int, int>{env.rank, env.world_size};
  check_settings(client, rank, world_size, settings, timeout);
  // A CPU job on one host sums through shared memory (shared_memory.hpp).
  const bool one_host = world_size == env.local_world_size;
  Job job = make_job(store, rank, world_size, backend, device, timeout, one_host,
                     local_address_towards(env.master_addr));
  job.restart = restart;
  return job;
}

}  // namespace mnist_ddp
