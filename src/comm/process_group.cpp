#include "mnist_ddp/comm/process_group.hpp"

#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <unistd.h>

#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "mnist_ddp/base/errors.hpp"
#include "comm/group.hpp"
#include "comm/rendezvous.hpp"
#include "comm/runtime.hpp"
#include "comm/shared_memory.hpp"

namespace mnist_ddp {
namespace {

// A group of `backend` over `store`'s keys, formed within the timeout
// (bounded as every store request is: store.hpp, "Note on stalls").
GroupPtr form_group(const GroupState& s, const Backend& backend, const c10::intrusive_ptr<c10d::Store>& store) {
  try {
    return StoreClient::within(s.timeout + std::chrono::seconds(5),
                               "could not form the process group with all " + std::to_string(s.world_size) +
                                   " ranks within " + std::to_string(s.timeout.count() / 1000) +
                                   " s: the store stopped answering",
                               [=, device = s.device, address = s.gloo_address, rank = s.rank,
                                world = s.world_size, timeout = s.timeout] {
                                 use_device(device);  // the helper thread's, as the caller's
                                 return backend.create(store, rank, world, timeout, address);
                               });
  } catch (const StoreStalled&) {
    throw;
  } catch (const std::exception& e) {
    try {
      StoreClient(s.store, std::chrono::seconds(5), "the store").check({"settings/0"});
    } catch (const std::exception&) {
      throw store_lost(e);
    }
    throw Timeout("could not form the process group with all " + std::to_string(s.world_size) + " ranks within " +
                  std::to_string(s.timeout.count() / 1000) + " s (" + error_line(e) + ")");
  }
}

// The rank's group, with the store prefix `name`, behind an ordered stream
// that its watch knows as `lane`; with shared memory (every rank on this
// host), CPU sums and the checks go through a SharedMemoryReducer; else
// the checks go through a Gloo group of their own, so that a check never
// waits behind a transfer still in flight (a bucket's), unless the lane's
// transfers never outlive their task (`blocking`).
std::shared_ptr<CollectiveStream> make_stream(GroupState& s, const std::string& name, const std::string& lane,
                                              bool blocking = false) {
  const Backend& backend = backend_named(s.backend);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, s.store);
  GroupPtr group = form_group(s, backend, prefixed);
  std::unique_ptr<SharedMemoryReducer> shared;
  if (s.shared_memory && s.world_size > 1) {
    try {
      shared = std::make_unique<SharedMemoryReducer>(*prefixed, s.rank, s.world_size, s.timeout,
                                                     [&] { group->barrier()->wait(); }, s.watch->names());
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {  // no /dev/shm, or no room in it: in the library's hierarchy
      throw Error("shared memory for the sums on this host: " + error_line(e));
    }
  }
  GroupPtr check_group;
  if (s.world_size > 1 && s.check != Check::off && !shared && (backend.on_device || !blocking))
    check_group = form_group(s, backend_named("gloo"), c10::make_intrusive<c10d::PrefixStore>(name + "/check", s.store));
  auto lane_state = s.watch ? s.watch->lane(lane) : std::make_shared<LaneState>(lane);
  Link link(group, s.device, backend, std::move(shared), s.watch, std::move(lane_state));
  auto stream = std::make_shared<CollectiveStream>(Channel(std::move(link), s.check, std::move(check_group)));
  s.streams.push_back(stream);
  return stream;
}

}  // namespace

int ProcessGroup::rank() const { return state_->rank; }
int ProcessGroup::world_size() const { return state_->world_size; }
int ProcessGroup::local_rank() const { return state_->local_rank; }
int ProcessGroup::local_world_size() const { return state_->local_world_size; }
const torch::Device& ProcessGroup::device() const { return state_->device; }
const std::string& ProcessGroup::backend() const { return state_->backend; }
std::chrono::milliseconds ProcessGroup::timeout() const { return state_->timeout; }
int ProcessGroup::restart() const { return state_->restart; }
const std::string& ProcessGroup::launcher() const { return state_->launcher; }
namespace {

// A failure no wait ever threw (Works nobody waited on): named in one line,
// and the process ends 1, as ProcessGroupNCCL's watchdog ends a process
// whose collectives failed unseen. The others are told this rank ended
// with an error first.
void name_unseen_failures(GroupState& s) {
  std::vector<std::shared_ptr<CollectiveStream>> held;
  for (const auto& weak : s.streams)
    if (auto stream = weak.lock()) held.push_back(std::move(stream));
  for (const auto& stream : held) {
    stream->drain();  // a task still running may yet fail
    const std::exception_ptr unseen = stream->unseen_failure();
    if (!unseen) continue;
    std::string what = "a collective failed";
    try {
      std::rethrow_exception(unseen);
    } catch (const std::exception& e) {
      what = error_line(e);
    }
    const std::string line = "[rank " + std::to_string(s.rank) + "] mnist_ddp: " + what +
                             " (a collective nobody waited for: the program ended without seeing it)\n";
    if (s.watch) s.watch->ended(false);
    if (::write(2, line.data(), line.size()) < 0) {
      // Nowhere to say it: the exit status still does.
    }
    std::_Exit(1);
  }
}

}  // namespace

ProcessGroup::State::~State() {
  const bool unwinding = std::uncaught_exceptions() > 0;
  if (!shut_down && !unwinding && !base) name_unseen_failures(*this);
  // A view has no watch of its own: its base says it.
  if (watch) watch->ended(!shut_down && !unwinding);
  if (!shut_down && !(base && base->shut_down)) return;
  // Shut down (a view: its base): a stream's thread may still wait on a
  // peer; it and its stream are left to the process's end.
  static std::mutex mutex;
  static auto* abandoned = new std::vector<std::shared_ptr<CollectiveStream>>();
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& weak : streams)
    if (auto held = weak.lock()) abandoned->push_back(std::move(held));
  for (const auto& held : {stream, quick})
    if (held) abandoned->push_back(held);
}

const std::shared_ptr<CollectiveStream>& bulk_stream(const ProcessGroup& group) {
  return GroupAccess::state(group).stream;
}
const std::shared_ptr<CollectiveStream>& quick_stream(const ProcessGroup& group) {
  return GroupAccess::state(group).quick;
}

GroupState& base_of(const ProcessGroup& group) {
  GroupState& s = GroupAccess::state(group);
  return s.base ? *s.base : s;
}

std::shared_ptr<CollectiveStream> new_stream(const ProcessGroup& group) {
  GroupState& s = base_of(group);
  if (s.world_size == 1) return s.stream;
  const int n = ++s.streams_made;
  return make_stream(s, "stream/" + std::to_string(n), "stream " + std::to_string(n));
}

std::vector<std::shared_ptr<CollectiveStream>> streams_of(const ProcessGroup& group) {
  std::vector<std::shared_ptr<CollectiveStream>> live;
  for (const auto& stream : base_of(group).streams)
    if (auto s = stream.lock()) live.push_back(std::move(s));
  return live;
}

ModelPlace model_group(const ProcessGroup& group) {
  const std::shared_ptr<std::atomic<int>> models = base_of(group).models;
  const int k = (*models)++;
  if (k == 0 || group.world_size() == 1) return {group, k, models};
  GroupState& s = GroupAccess::state(group);
  auto view = std::make_shared<GroupState>();
  view->rank = s.rank;
  view->world_size = s.world_size;
  view->local_rank = s.local_rank;
  view->local_world_size = s.local_world_size;
  view->backend = s.backend;
  view->device = s.device;
  view->timeout = s.timeout;
  view->restart = s.restart;
  view->launcher = s.launcher;
  view->gloo_address = s.gloo_address;
  view->shared_memory = s.shared_memory;
  view->check = s.check;
  view->store = s.store;
  view->node_of_rank = s.node_of_rank;
  view->base = s.base ? s.base : GroupAccess::share(group);
  view->stream = view->quick = new_stream(group);
  return {GroupAccess::make(view), k, models};
}

int node_of(const ProcessGroup& group, int rank) {
  const GroupState& s = GroupAccess::state(group);
  const auto& nodes = s.node_of_rank;
  if (rank >= 0 && rank < static_cast<int>(nodes.size())) return nodes[static_cast<size_t>(rank)];
  return rank / std::max(1, s.local_world_size);
}

std::optional<std::vector<int>> silent_ranks(const ProcessGroup& group) {
  const GroupState& s = GroupAccess::state(group);
  const StoreClient client(s.store, std::min<std::chrono::milliseconds>(s.timeout, std::chrono::seconds(5)),
                           "the store");
  auto read = [&] {
    std::vector<std::string> beats(s.world_size);
    for (int r = 0; r < s.world_size; ++r) {
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
    for (int r = 0; r < s.world_size; ++r)
      if (r != s.rank && before[r] == after[r]) silent.push_back(r);
  } catch (const StoreStalled&) {
    return std::nullopt;  // a stalled store says nothing about who is gone
  } catch (const std::exception&) {
    silent = {0};
  }
  return silent;
}

std::shared_ptr<GroupState> form(StorePtr store, int rank, int world_size, const Backend& backend,
                                 torch::Device device, std::chrono::milliseconds timeout, bool shared_memory,
                                 const std::string& gloo_address, std::optional<Check> check, RankNames names) {
  auto s = std::make_shared<GroupState>();
  s->check = check ? *check : backend.on_device ? Check::alongside : Check::before;
  s->rank = rank;
  s->world_size = world_size;
  s->backend = backend.name;
  s->device = device;
  s->timeout = timeout;
  s->gloo_address = gloo_address;
  s->store = std::move(store);
  s->shared_memory = shared_memory && !backend.on_device && device.is_cpu();
  if (world_size > 1) s->watch = std::make_shared<CollectiveWatch>(s->store, rank, world_size, timeout, std::move(names));
  s->stream = make_stream(*s, "main", "bulk");
  s->quick = !backend.lanes || world_size == 1 ? s->stream : make_stream(*s, "quick", "quick", /*blocking=*/true);
  return s;
}

namespace {

std::mutex g_default_mutex;
std::weak_ptr<GroupState> g_default;
bool g_joined = false;  // init_process_group(options) formed a group in this process

ProcessGroup made_default(ProcessGroup group, const std::shared_ptr<GroupState>& state) {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  if (g_default.expired()) g_default = state;
  return group;
}

// A second init_process_group(): the group of the first, where the options
// ask for nothing else; nullopt for the first, and once that group was shut
// down or let go (PyTorch's destroy_process_group()): the job's group is
// then formed anew.
std::optional<ProcessGroup> joined_before(const ProcessGroupOptions& options) {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  if (!g_joined) return std::nullopt;
  const auto state = g_default.lock();
  if (!state || state->shut_down) return std::nullopt;
  std::string other;
  if (options.backend() != "auto" && options.backend() != state->backend)
    other = "backend " + options.backend() + " (the group's is " + state->backend + ")";
  else if (options.device() && *options.device() != state->device)
    other = "device " + options.device()->str() + " (the group's is " + state->device.str() + ")";
  else if (options.timeout() && *options.timeout() != state->timeout)
    other = "another timeout";
  else if (!options.settings().empty())
    other = "settings to compare";
  else if (options.check_collectives() != (state->check != Check::off))
    other = std::string("the check of collectives ") + (options.check_collectives() ? "on" : "off");
  if (!other.empty())
    throw UsageError("init_process_group: called a second time, asking for " + other +
                     "; a process joins its job once: call it once and pass the group on");
  return GroupAccess::make(state);
}


// The device a rank takes when it is not told: its launcher's plan, else
// a GPU of its own where CUDA sees GPUs, else the CPU.
torch::Device device_for(const WorkerEnv& env, const ProcessGroupOptions& options) {
  if (options.device()) return *options.device();
  if (env.ours() && !env.backend.empty()) return cuda_device_or_cpu(env.device);
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (gpus == 0) return torch::kCPU;
  if (gpus == 1) return cuda_device_or_cpu(0);
  if (env.local_rank < gpus) return cuda_device_or_cpu(env.local_rank);
  throw UsageError("local rank " + std::to_string(env.local_rank) + " has no GPU of its own: CUDA sees " +
                   std::to_string(gpus) + "; start at most " + std::to_string(gpus) +
                   " processes a machine, or choose each one's device (ProcessGroupOptions().device(...))");
}

const Backend& backend_for(const WorkerEnv& env, const ProcessGroupOptions& options, const torch::Device& device) {
  std::string name = options.backend();
  if (name == "auto" && env.ours() && !env.backend.empty()) name = env.backend;
  const Backend& backend = name == "auto" ? default_backend_for(device) : backend_named(name);
  if (!backend.takes(device))
    throw UsageError("backend " + backend.name + " does not take this rank's device, " + device.str() +
                     (device.is_cpu() ? ": use gloo" : ""));
  return backend;
}

// The timeout the options name, else the one our launcher was given, else 5 minutes.
std::chrono::milliseconds timeout_for(const WorkerEnv& env, const ProcessGroupOptions& options) {
  if (options.timeout()) return *options.timeout();
  if (env.timeout_ms > 0) return std::chrono::milliseconds(env.timeout_ms);
  return std::chrono::minutes(5);
}

}  // namespace

ProcessGroup make_process_group(StorePtr store, int rank, int world_size, const std::string& backend,
                                c10::Device device, std::chrono::milliseconds timeout, bool shared_memory,
                                const std::string& gloo_address, std::optional<Check> check) {
  return GroupAccess::make(form(std::move(store), rank, world_size, backend_named(backend), device, timeout,
                                shared_memory, gloo_address, check));
}

namespace {

// The job's group over `job`'s store, from `env` resolved against the
// options. `formed` > 0: the job's group formed anew (after shutdown(), or
// once every handle to the last one went), its keys under "formed/<n>/" and
// its ranks the first forming's (`plan`).
ProcessGroup join(const WorkerEnv& env, const JobStore& job, const ProcessGroupOptions& options, int formed,
                  std::optional<RankPlan>& plan) {
  const torch::Device device = device_for(env, options);
  const Backend& backend = backend_for(env, options, device);
  const auto timeout = timeout_for(env, options);
  use_device(device);
  auto keys = [formed](const StorePtr& store) -> StorePtr {
    if (formed == 0) return store;
    return c10::make_intrusive<c10d::PrefixStore>("formed/" + std::to_string(formed), store);
  };
  const StorePtr store = keys(job.store);
  const std::string where = "the rendezvous store at " + env.master_addr + ":" + std::to_string(env.master_port);
  const StoreClient client(store, timeout, where), root(keys(job.root), timeout, where);
  // Under our launcher no worker reads a secret file (the launcher did).
  auto refused = [&](int ranks) {
    return env.ours() ? std::function<void()>()
                      : [&root, &job, ranks] { refused_secret(root, job.secret_keys, ranks, job.hosted); };
  };
  if (!plan)
    plan = env.rank < 0 ? agree_on_ranks(client, env, timeout, refused(0)) : RankPlan{env.rank, env.world_size, {}};
  const int rank = plan->rank, world_size = plan->world_size;
  check_settings(client, rank, world_size, options.settings(), timeout, refused(world_size));
  // A CPU job on one host sums through shared memory (shared_memory.hpp).
  const bool one_host = world_size == env.local_world_size;
  auto state = form(store, rank, world_size, backend, device, timeout, one_host, local_address_towards(env.master_addr),
                    options.check_collectives() ? std::nullopt : std::optional<Check>(Check::off));
  state->restart = job.start;
  state->local_rank = env.local_rank;
  state->local_world_size = env.local_world_size;
  state->launcher = env.launcher;
  state->node_of_rank = plan->node_of_rank;
  return GroupAccess::make(state);
}

WorkerEnv resolved(const WorkerEnv& launched, const ProcessGroupOptions& options) {
  WorkerEnv env = launched;
  resolve_store_address(env, options.master_addr(), !options.master_addr().empty(), options.master_port(),
                        options.master_port() > 0);
  return env;
}

// The job this process joined through init_process_group(options): kept
// (never freed) so that its group can be formed anew over the same store,
// which so outlives every group (a store this rank hosts stays up for the
// ranks still on it). Guarded by init_process_group's mutex.
struct Joined {
  bool alone = false;  // a world of 1, no launcher
  WorkerEnv env;       // resolved
  JobStore job;
  std::optional<RankPlan> plan;
  int formed = 0;
};
Joined* g_job = nullptr;

ProcessGroup alone(const ProcessGroupOptions& options) {
  WorkerEnv alone;
  alone.rank = 0;
  alone.world_size = 1;
  const torch::Device device = device_for(alone, options);
  auto state = form(c10::make_intrusive<c10d::HashStore>(), 0, 1, backend_for(alone, options, device), device,
                    timeout_for(alone, options), false, "127.0.0.1", std::nullopt);
  return GroupAccess::make(state);
}

ProcessGroup join_or_stay_alone(const ProcessGroupOptions& options) {
  if (g_job) {  // forming anew
    if (g_job->alone) return alone(options);
    return join(g_job->env, g_job->job, options, ++g_job->formed, g_job->plan);
  }
  const Environment environment = read_environment();
  std::optional<WorkerEnv> worker = launched_worker(environment);
  if (!worker) worker = pod_worker(environment);
  if (!worker) {
    g_job = new Joined{true, {}, {}, std::nullopt, 0};
    return alone(options);
  }
  const WorkerEnv env = resolved(*worker, options);
  auto job = std::make_unique<Joined>(Joined{false, env, open_job_store(env, timeout_for(env, options)), std::nullopt, 0});
  ProcessGroup group = join(job->env, job->job, options, 0, job->plan);
  g_job = job.release();
  return group;
}

}  // namespace

ProcessGroup init_process_group(const WorkerEnv& launched, const ProcessGroupOptions& options) {
  const WorkerEnv env = resolved(launched, options);
  std::optional<RankPlan> plan;
  ProcessGroup group = join(env, open_job_store(env, timeout_for(env, options)), options, 0, plan);
  return made_default(group, GroupAccess::share(group));
}

ProcessGroup init_process_group(const ProcessGroupOptions& options) {
  // One join a process: a thread that calls while another joins waits for
  // that group, and gets it (or is refused, as any second call).
  static std::mutex joining;
  std::lock_guard<std::mutex> one_at_a_time(joining);
  if (const auto joined = joined_before(options)) return *joined;
  try {
    ProcessGroup group = join_or_stay_alone(options);
    std::lock_guard<std::mutex> lock(g_default_mutex);
    g_joined = true;
    g_default = GroupAccess::share(group);
    return group;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // a port in use, shared memory, a device: one line, in the hierarchy
    throw Error("init_process_group: " + error_line(e));
  }
}

std::optional<ProcessGroup> default_process_group() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  if (auto state = g_default.lock()) return GroupAccess::make(state);
  return std::nullopt;
}

}  // namespace mnist_ddp
