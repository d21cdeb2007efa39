// mnist_ddp_bench: measurements that need no dataset.
//
//   mnist_ddp_bench sync-bn [STEPS]    cost of SyncBatchNorm per training step,
//                                      2 CPU processes over Gloo (a table)
//   mnist_ddp_bench breakdown [STEPS]  where a 2-process step's time goes: ms
//                                      per step with BatchNorm2d or
//                                      SyncBatchNorm, each with DDP keeping
//                                      local gradients or averaging them
//   mnist_ddp_bench profile STEPS TRACE  rank 0 of 2 processes (SyncBatchNorm,
//                                      DDP averaging) under LibTorch 1.x's
//                                      profiler; prints ms/step, writes a
//                                      Chrome trace to TRACE
//   mnist_ddp_bench allreduce NUMEL ROUNDS  microseconds per sum of NUMEL
//                                      floats over 2 idle CPU processes,
//                                      through Gloo and through shared memory
//   mnist_ddp_bench library [STEPS]     examples/resnet's model, batch 32, one
//                                      core a process: two processes at once,
//                                      each alone (the floor), and 2 ranks
//                                      under our DDP with BatchNorm and with
//                                      SyncBatchNorm, and under our DDP with
//                                      no communication (each rank's own
//                                      gradients, no buffer broadcast);
//                                      prints "floor F floor_met M ddp D
//                                      ddp_syncbn S ddp_local L" in ms/step
//                                      (M: alone, but meeting at a barrier
//                                      after each step)
//   mnist_ddp_bench compute-limit [STEPS] [--plain | --cuda]
//                                      one process on one core, no DDP, no
//                                      communication: Net's training step at
//                                      batch 32; --plain skips the worker's
//                                      process set-up (LibTorch's defaults),
//                                      --cuda runs on the first GPU.
//                                      Prints "images/s ms/step forward backward optimizer".
//   mnist_ddp_bench check-cost RANK ADDR PORT MINE HOOK STEPS
//                                      rank RANK of 2 (rank 0 hosts the store
//                                      at ADDR:PORT; Gloo listens at MINE):
//                                      Net under DDP and HOOK on a checked and
//                                      an unchecked group, step by step in
//                                      turn; prints "checked C unchecked U"
//                                      in ms/step (scripts/bench_check.sh)
//   mnist_ddp_bench store WORLD [SECONDS]  the collective check's load on the
//                                      store: WORLD ranks as threads of one
//                                      process (shared memory), every store
//                                      request counted; prints the requests
//                                      a second while they train (a small
//                                      sum every 10 ms) and while all but
//                                      rank 0 wait for it in a collective
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <thread>

#include "mnist_ddp/parallel/comm_hooks.hpp"
#include "mnist_ddp/parallel/distributed.hpp"
#include "mnist_ddp/comm/process_group.hpp"
#include "app/base/files.hpp"
#include "app/base/options.hpp"
#include "app/train/model.hpp"
#include "base/port.hpp"
#include "comm/group.hpp"
#include "comm/store.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "base/environment.hpp"
#include "app/base/placement.hpp"
#include "app/worker.hpp"
#include "examples/resnet_model.hpp"

namespace mnist_ddp {
namespace {

using Clock = std::chrono::steady_clock;

// Runs fn(group) in `world` forked processes (forked before LibTorch starts
// any thread), set up as training workers on one host are (by default, sums
// through shared memory), over a FileStore. Returns false if any process
// failed.
bool run_processes(int world, const std::function<void(ProcessGroup&)>& fn, bool shared_memory = true) {
  char templ[] = "/tmp/mnist_ddp_bench_XXXXXX";
  const std::string dir = mkdtemp(templ);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      int code = 0;
      try {
        configure_worker_process(threads_per_worker(world, read_environment().omp_num_threads));
        auto store = c10::make_intrusive<c10d::FileStore>(dir + "/store", world);
        ProcessGroup group = make_process_group(store, rank, world, "gloo", torch::kCPU, std::chrono::seconds(120), shared_memory);
        fn(group);
        bulk_stream(group)->barrier();
      } catch (const std::exception& e) {
        std::cerr << "rank " << rank << ": " << e.what() << std::endl;
        code = 1;
      }
      std::cout.flush();
      _exit(code);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  files::remove_tree(dir);
  return ok;
}

// Keeps each rank's own gradients: DDP's machinery without communication.
class LocalHook : public hooks::CommHook {
 public:
  std::string name() const override { return "local"; }
  FuturePtr run(const hooks::GradBucket& bucket, hooks::Wire&) override { return completed_future(bucket.buffer()); }
};

// Milliseconds per training step of Net under DDP, batch 32. With `trace`,
// the timed steps run under LibTorch's profiler, which writes a Chrome trace
// there (LibTorch 1.x).
double ms_per_step(ProcessGroup& group, bool sync_bn, int steps, bool communicate = true, const std::string& trace = "") {
  torch::manual_seed(0);
  Net net;
  if (sync_bn) convert_sync_batchnorm(net, group);
  DistributedDataParallel ddp(net, group, DdpOptions().broadcast_buffers(false));
  if (!communicate) ddp.register_comm_hook(std::make_shared<LocalHook>());
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  const auto x = torch::randn({32, 1, 28, 28});
  const auto y = torch::randint(0, 10, {32}, torch::kInt64);
  auto step = [&] {
    opt.zero_grad();
    torch::nll_loss(ddp.forward(x), y).backward();
    opt.step();
  };
  for (int i = 0; i < 5; ++i) step();
  bulk_stream(group)->barrier();
  const auto start = Clock::now();
  {
    std::optional<port::RecordProfile> profiled;
    if (!trace.empty()) profiled.emplace(trace);
    for (int i = 0; i < steps; ++i) step();
  }
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count() / steps;
}

// Rank 0's steps of a 2-process run (Net with SyncBatchNorm, DDP averaging)
// under the profiler, its trace written to `trace`.
int profile(int steps, const std::string& trace) {
  const bool ok = run_processes(2, [&](ProcessGroup& group) {
    const double ms = ms_per_step(group, true, steps, true, group.rank() == 0 ? trace : "");
    if (group.rank() == 0) std::printf("%.2f\n", ms);
  });
  return ok ? 0 : 1;
}

int sync_bn(int steps) {
  const bool ok = run_processes(2, [&](ProcessGroup& group) {
    // Alternate the two variants so that machine noise hits both alike.
    double plain = 0, sync = 0;
    for (int round = 0; round < 3; ++round) {
      plain += ms_per_step(group, false, steps);
      sync += ms_per_step(group, true, steps);
    }
    plain /= 3;
    sync /= 3;
    if (group.rank() == 0) {
      std::printf("| Net training step, 2 CPU processes, batch 32 | ms/step |\n|---|---|\n");
      std::printf("| BatchNorm2d (per-rank statistics) | %.2f |\n", plain);
      std::printf("| SyncBatchNorm | %.2f |\n", sync);
      std::printf("| SyncBatchNorm cost | %.2f ms/step, %.1f%% of the step |\n", sync - plain,
                  100.0 * (sync - plain) / sync);
    }
  });
  return ok ? 0 : 1;
}

int breakdown(int steps) {
  const bool ok = run_processes(2, [&](ProcessGroup& group) {
    double t[4] = {0, 0, 0, 0};
    for (int round = 0; round < 3; ++round)
      for (int v = 0; v < 4; ++v) t[v] += ms_per_step(group, v / 2 == 1, steps, v % 2 == 1) / 3;
    if (group.rank() == 0)
      std::printf("BN local %.2f | BN none %.2f | SyncBN local %.2f | SyncBN none %.2f ms/step\n", t[0], t[1], t[2], t[3]);
  });
  return ok ? 0 : 1;
}

// Microseconds per allreduce of `numel` floats between 2 processes, through
// Gloo and through shared memory, with the ranks otherwise idle.
int allreduce(int64_t numel, int rounds) {
  bool ok = true;
  for (bool shared : {false, true}) {
    ok = ok && run_processes(
                   2,
                   [&](ProcessGroup& group) {
                     auto t = torch::ones({numel});
                     for (int i = 0; i < 10; ++i) bulk_stream(group)->allreduce_sum(t);
                     const auto start = Clock::now();
                     for (int i = 0; i < rounds; ++i) bulk_stream(group)->allreduce_sum(t);
                     const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / rounds;
                     if (group.rank() == 0)
                       std::printf("%s: %lld floats, %.1f us per allreduce\n", shared ? "shared memory" : "gloo",
                                   static_cast<long long>(numel), us);
                   },
                   shared);
  }
  return ok ? 0 : 1;
}

// examples/resnet's model on this rank, trained alone (`ddp` false; where
// `communicate`, the ranks meet at a barrier after each step) or under our
// DDP, with SyncBatchNorm where `sync_bn`, communicating nothing where not
// `communicate` (each rank's own gradients, no buffer broadcast).
struct ResNetTrainer {
  ResNetTrainer(ProcessGroup& group, bool ddp, bool sync_bn, bool communicate)
      : stream(bulk_stream(group)), meet(!ddp && communicate) {
    torch::manual_seed(0);
    if (sync_bn) convert_sync_batchnorm(model, group);
    if (ddp)
      wrapped = std::make_unique<DistributedDataParallel<ResNet>>(model, group,
                                                                  DdpOptions().broadcast_buffers(communicate));
    if (ddp && !communicate) wrapped->register_comm_hook(std::make_shared<LocalHook>());
    opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::manual_seed(1 + group.rank());
    x = torch::randn({32, 1, 28, 28});
    y = torch::randint(0, 10, {32}, torch::kInt64);
  }
  void step() {
    opt->zero_grad();
    const torch::Tensor out = wrapped ? wrapped->forward(x) : model->forward(x);
    torch::nn::functional::cross_entropy(out, y).backward();
    opt->step();
    if (meet) stream->barrier();
  }
  std::shared_ptr<CollectiveStream> stream;
  bool meet;
  ResNet model;
  std::unique_ptr<DistributedDataParallel<ResNet>> wrapped;
  std::unique_ptr<torch::optim::SGD> opt;
  torch::Tensor x, y;
};

// The five ways take turns step by step in the same two processes, each
// step timed on its own, so that the machine's speed, which drifts by tens
// of percent from second to second on a shared host, moves them alike.
int library(int steps) {
  struct Way {
    const char* name;
    bool ddp, sync_bn, communicate;
  };
  const std::vector<Way> ways = {{"floor", false, false, false},     {"floor_met", false, false, true},
                                 {"ddp", true, false, true},         {"ddp_syncbn", true, true, true},
                                 {"ddp_local", true, false, false}};
  const int n = static_cast<int>(ways.size());
  const bool ok = run_processes(2, [&](ProcessGroup& group) {
    std::vector<std::unique_ptr<ResNetTrainer>> trainers;
    for (const Way& w : ways)
      trainers.push_back(std::make_unique<ResNetTrainer>(group, w.ddp, w.sync_bn, w.communicate));
    for (int i = 0; i < 5; ++i)
      for (auto& trainer : trainers) trainer->step();
    auto ms = torch::zeros({2, n}, torch::kFloat64);  // [rank][way], this rank's row
    for (int i = 0; i < steps; ++i) {
      for (int k = 0; k < n; ++k) {
        const int v = (i + k) % n;  // the order rotates: each way takes each place in a round alike
        bulk_stream(group)->barrier();  // the two processes start the step together
        const auto start = Clock::now();
        trainers[v]->step();
        ms[group.rank()][v] += std::chrono::duration<double, std::milli>(Clock::now() - start).count() / steps;
      }
    }
    bulk_stream(group)->allreduce_sum(ms);
    if (group.rank() != 0) return;
    for (int v = 0; v < n; ++v)
      std::printf("%s%s %.2f", v ? " " : "", ways[v].name, ms.select(1, v).mean().item<double>());
    std::printf("\n");
    std::fflush(stdout);
  });
  return ok ? 0 : 1;
}

// The check's own cost between hosts: this process is rank `rank` of 2
// (rank 0 hosts the store at `addr`:`port`; Gloo listens at `mine`). Net
// with SyncBatchNorm under our DDP and `hook`, as mnist_ddp trains it
// (PowerSGD from step 10), twice over: on a group that checks every
// collective and on one that does not, taking turns step by step so that
// the machine's and the link's drift move both alike. Rank 0 prints
// "checked C unchecked U" in ms/step.
int check_cost(int rank, const std::string& addr, int port, const std::string& mine, const std::string& hook,
               int steps) {
  configure_worker_process(1);
  const auto timeout = std::chrono::milliseconds(120'000);
  auto store = open_store(addr, port, rank == 0, timeout);
  struct Trainer {
    Trainer(ProcessGroup g, const std::string& hook) : group(std::move(g)) {
      torch::manual_seed(0);
      convert_sync_batchnorm(net, group);
      ddp = std::make_unique<DistributedDataParallel<Net>>(net, group, DdpOptions().broadcast_buffers(false));
      ddp->register_comm_hook(make_comm_hook(hook, hooks::PowerSgdOptions().start_powersgd_iter(10)));
      opt = std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    }
    ProcessGroup group;
    Net net;
    std::unique_ptr<DistributedDataParallel<Net>> ddp;
    std::unique_ptr<torch::optim::SGD> opt;
  };
  std::vector<std::unique_ptr<Trainer>> ways;
  for (const bool check : {true, false}) {
    StorePtr prefixed = c10::make_intrusive<c10d::PrefixStore>(check ? "checked" : "unchecked", store);
    ways.push_back(std::make_unique<Trainer>(
        make_process_group(prefixed, rank, 2, "gloo", torch::kCPU, timeout, false, mine,
                           check ? std::nullopt : std::optional<Check>(Check::off)),
        hook));
  }
  torch::manual_seed(1 + rank);
  const auto x = torch::randn({32, 1, 28, 28});
  const auto y = torch::randint(0, 10, {32}, torch::kInt64);
  double ms[2] = {0, 0};
  for (int i = 0; i < steps + 20; ++i)
    for (int k = 0; k < 2; ++k) {
      Trainer& t = *ways[(i + k) % 2];
      const auto start = Clock::now();
      t.opt->zero_grad();
      torch::nll_loss(t.ddp->forward(x), y).backward();
      t.opt->step();
      if (i >= 20) ms[(i + k) % 2] += std::chrono::duration<double, std::milli>(Clock::now() - start).count() / steps;
    }
  if (rank == 0) std::printf("checked %.2f unchecked %.2f\n", ms[0], ms[1]);
  bulk_stream(ways[0]->group)->barrier();
  return 0;
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

int compute_limit(int steps, const std::string& how) {
  const bool plain = how == "--plain";
  const torch::Device device = how == "--cuda" ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (plain) {
    at::set_num_threads(1);
  } else {
    configure_worker_process(threads_per_worker(usable_cores(),
                                                read_environment().omp_num_threads));
  }
  torch::manual_seed(0);
  Net net;
  net->to(device);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9).weight_decay(5e-4));
  const auto x = torch::randn({32, 1, 28, 28}).to(device);
  const auto y = torch::randint(0, 10, {32}, torch::kInt64).to(device);
  double forward = 0, backward = 0, optimizer = 0;
  auto step = [&](bool timed) {
    const auto t0 = Clock::now();
    opt.zero_grad();
    const auto loss = torch::nll_loss(net->forward(x), y);
    synchronize(device);
    const auto t1 = Clock::now();
    loss.backward();
    synchronize(device);
    const auto t2 = Clock::now();
    opt.step();
    synchronize(device);
    const auto t3 = Clock::now();
    if (!timed) return;
    forward += std::chrono::duration<double, std::milli>(t1 - t0).count();
    backward += std::chrono::duration<double, std::milli>(t2 - t1).count();
    optimizer += std::chrono::duration<double, std::milli>(t3 - t2).count();
  };
  for (int i = 0; i < 5; ++i) step(false);
  const auto start = Clock::now();
  for (int i = 0; i < steps; ++i) step(true);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count() / steps;
  std::printf("%.1f %.2f %.2f %.2f %.2f\n", 32 * 1000.0 / ms, ms, forward / steps, backward / steps, optimizer / steps);
  return 0;
}

// A store that counts what it is asked.
struct CountingStore : c10d::HashStore {
  std::atomic<int64_t> requests{0};
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    ++requests;
    HashStore::set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    ++requests;
    return HashStore::get(key);
  }
  int64_t add(const std::string& key, int64_t value) override {
    ++requests;
    return HashStore::add(key, value);
  }
  bool check(const std::vector<std::string>& keys) override {
    ++requests;
    return HashStore::check(keys);
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    ++requests;
    return HashStore::compareSet(key, expected, desired);
  }
};

int store_load(int world, int seconds) {
  auto store = c10::make_intrusive<CountingStore>();
  using Clock = std::chrono::steady_clock;
  std::atomic<int64_t> at_start{0}, at_training{0}, at_waiting{0};
  Clock::time_point started, trained, waited;
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r)
    ranks.emplace_back([&, r] {
      at::set_num_threads(1);
      ProcessGroup group = make_process_group(store, r, world, "gloo", torch::kCPU, std::chrono::seconds(300), true);
      auto stream = quick_stream(group);
      auto t = torch::zeros({65}, torch::kFloat64);
      stream->barrier();
      if (r == 0) {
        started = Clock::now();
        at_start = store->requests.load();
      }
      stream->broadcast(t, 0);
      const auto until = Clock::now() + std::chrono::seconds(seconds);
      for (;;) {  // until any rank's time is up: every rank reads the same vote
        stream->allreduce_sum(t, "a training step's sum");
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        auto more = torch::tensor({Clock::now() < until ? 1.0 : 0.0}, torch::kFloat64);
        stream->allreduce_sum(more, "whether to go on");
        if (more.item<double>() < world) break;
      }
      if (r == 0) {
        trained = Clock::now();
        at_training = store->requests.load();
        std::this_thread::sleep_for(std::chrono::seconds(seconds));  // the others wait in the barrier
        waited = Clock::now();
        at_waiting = store->requests.load();
      }
      stream->barrier("rank 0's long pause");
    });
  for (auto& t : ranks) t.join();
  auto per_second = [](int64_t n, Clock::duration d) { return n / std::chrono::duration<double>(d).count(); };
  std::printf("world %d training %.1f waiting %.1f\n", world, per_second(at_training - at_start, trained - started),
              per_second(at_waiting - at_training, waited - trained));
  return 0;
}

}  // namespace
}  // namespace mnist_ddp

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  if (what == "sync-bn") return mnist_ddp::sync_bn(argc > 2 ? std::stoi(argv[2]) : 40);
  if (what == "allreduce" && argc > 3) return mnist_ddp::allreduce(std::stoll(argv[2]), std::stoi(argv[3]));
  if (what == "breakdown") return mnist_ddp::breakdown(argc > 2 ? std::stoi(argv[2]) : 40);
  if (what == "profile" && argc > 3) return mnist_ddp::profile(std::stoi(argv[2]), argv[3]);
  if (what == "library") return mnist_ddp::library(argc > 2 ? std::stoi(argv[2]) : 100);
  if (what == "compute-limit")
    return mnist_ddp::compute_limit(argc > 2 ? std::stoi(argv[2]) : 100, argc > 3 ? argv[3] : "");
  if (what == "check-cost" && argc > 7)
    return mnist_ddp::check_cost(std::stoi(argv[2]), argv[3], std::stoi(argv[4]), argv[5], argv[6], std::stoi(argv[7]));
  if (what == "store" && argc > 2) return mnist_ddp::store_load(std::stoi(argv[2]), argc > 3 ? std::stoi(argv[3]) : 10);
  std::cerr << "usage: mnist_ddp_bench sync-bn [STEPS] | breakdown [STEPS] | allreduce NUMEL ROUNDS | "
               "library [STEPS] | compute-limit [STEPS] [--plain | --cuda] | store WORLD [SECONDS] | "
               "check-cost RANK ADDR PORT MINE HOOK STEPS\n";
  return 2;
}
