// mnist_ddp_bench: measurements that need no dataset, each printed as a table.
//
//   mnist_ddp_bench sync-bn [STEPS]   cost of SyncBatchNorm per training step,
//                                     2 CPU processes over Gloo
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>

#include "mnist_ddp/comm_hooks.hpp"
#include "mnist_ddp/ddp.hpp"
#include "mnist_ddp/dist.hpp"
#include "mnist_ddp/model.hpp"
#include "mnist_ddp/sync_batch_norm.hpp"
#include "mnist_ddp/trainer.hpp"

namespace mnist_ddp {
namespace {

using Clock = std::chrono::steady_clock;

// Runs fn(dist) in `world` forked processes (forked before LibTorch starts
// any thread), set up as training workers are, over a FileStore. Returns false if
// any process failed.
bool run_processes(int world, const std::function<void(Dist&)>& fn) {
  char templ[] = "/tmp/mnist_ddp_bench_XXXXXX";
  const std::string dir = mkdtemp(templ);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      int code = 0;
      try {
        configure_worker_process(world);
        auto store = c10::make_intrusive<c10d::FileStore>(dir + "/store", world);
        Dist dist = make_dist(store, rank, world, "gloo", torch::kCPU, std::chrono::seconds(120));
        fn(dist);
        dist.group->barrier()->wait();
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
  std::filesystem::remove_all(dir);
  return ok;
}

// Milliseconds per training step of Net under DDP (no compression), batch 32.
double ms_per_step(Dist& dist, bool sync_bn, int steps) {
  torch::manual_seed(0);
  Net net;
  if (sync_bn) convert_sync_batchnorm(*net, dist.group);
  DistributedDataParallel ddp(torch::nn::AnyModule(net), dist, std::make_unique<AllreduceHook>(), 25);
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  const auto x = torch::randn({32, 1, 28, 28});
  const auto y = torch::randint(0, 10, {32}, torch::kInt64);
  auto step = [&] {
    opt.zero_grad();
    torch::nll_loss(ddp->forward(x), y).backward();
    opt.step();
  };
  for (int i = 0; i < 5; ++i) step();
  dist.group->barrier()->wait();
  const auto start = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count() / steps;
}

int sync_bn(int steps) {
  const bool ok = run_processes(2, [&](Dist& dist) {
    // Alternate the two variants so that machine noise hits both alike.
    double plain = 0, sync = 0;
    for (int round = 0; round < 3; ++round) {
      plain += ms_per_step(dist, false, steps);
      sync += ms_per_step(dist, true, steps);
    }
    plain /= 3;
    sync /= 3;
    if (dist.rank == 0) {
      std::printf("| Net training step, 2 CPU processes, batch 32 | ms/step |\n|---|---|\n");
      std::printf("| BatchNorm2d (per-rank statistics) | %.2f |\n", plain);
      std::printf("| SyncBatchNorm | %.2f |\n", sync);
      std::printf("| SyncBatchNorm cost | %.2f ms/step, %.1f%% of the step |\n", sync - plain,
                  100.0 * (sync - plain) / sync);
    }
  });
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace mnist_ddp

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  if (what == "sync-bn") return mnist_ddp::sync_bn(argc > 2 ? std::stoi(argv[2]) : 40);
  std::cerr << "usage: mnist_ddp_bench sync-bn [STEPS]\n";
  return 2;
}
