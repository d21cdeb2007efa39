// Checkpoints end to end: exact resume, interruptions at any moment, the
// files a run leaves (loadable by Python, never world-writable) and the
// store that only loopback can reach.
#include <gtest/gtest.h>

#include <sys/prctl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <regex>
#include <random>
#include <set>

#include <spdlog/fmt/fmt.h>

#include "app/train/checkpoint.hpp"
#include "app/base/files.hpp"
#include "run_util.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::eventually;
using test::expect_same_end;
using test::job;
using test::last_line_with;
using test::max_abs_diff;
using test::Process;
using test::python_with_torch;
using test::read_text;
using test::run;
using test::TempDir;

// metrics.csv's rows of one split without the images/s column: what an
// exact resume reproduces.
std::vector<std::string> metrics_rows(const std::string& file, const std::string& split) {
  std::vector<std::string> rows;
  std::istringstream lines(read_text(file));
  for (std::string line; std::getline(lines, line);) {
    if (line.find("," + split + ",") == std::string::npos) continue;
    size_t comma = 0;
    for (int i = 0; i < 7; ++i) comma = line.find(',', comma) + 1;
    rows.push_back(line.substr(0, comma) + line.substr(line.find(',', comma)));
  }
  return rows;
}

// Runs that stop and go on end where the straight run ends, bit for bit:
// stopped by --max-steps at an epoch's end and mid-epoch (none); preempted
// by SIGTERM mid-epoch (powersgd_fp16: its hook state too); and, under
// powersgd_fp16, a worker killed after a random step in each of three
// starts of a run that restarts itself from its step checkpoints (the
// restart path is the same under every hook; this one has state to lose).
TEST(Resume, StoppedPreemptedAndKilledRunsEndAsTheStraightRun) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 1024, 256);
  std::mt19937 random(test::test_seed());
  for (const std::string compression : {"none", "powersgd_fp16"}) {
    SCOPED_TRACE(compression);
    const std::string straight = dir / (compression + "_straight");
    ASSERT_EQ(run(job(dir / "data", straight, compression, {"--epochs", "2"}), dir / "out.txt"), 0) << read_text(dir / "out.txt");

    if (compression == "none") {
      // One run stopped three times over: at the end of epoch 0 (step 16),
      // then in the middle of epoch 1 (step 23 of 32), then run to the end.
      const std::string split = dir / (compression + "_split");
      for (const std::string stop : {"16", "23", ""}) {
        std::vector<std::string> extra = {"--epochs", "2", "--resume", "auto"};
        if (!stop.empty()) extra.insert(extra.end(), {"--max-steps", stop});
        ASSERT_EQ(run(job(dir / "data", split, compression, extra), dir / "out.txt"), 0) << read_text(dir / "out.txt");
      }
      const std::string log = read_text(split + "/mnist_train.log");
      EXPECT_NE(log.find("Resuming from " + split + "/checkpoint: epoch 1, batch 0, step 16"), std::string::npos) << log;
      EXPECT_NE(log.find("Resuming from " + split + "/checkpoint: epoch 1, batch 7, step 23"), std::string::npos) << log;
      expect_same_end(split, straight);
      // The metrics go on from each checkpoint: no row lost or repeated. The
      // run stopped mid-epoch tested where it stopped; that row stays.
      EXPECT_EQ(metrics_rows(split + "/metrics.csv", "train"), metrics_rows(straight + "/metrics.csv", "train"));
      auto tests = metrics_rows(split + "/metrics.csv", "test");
      const auto at_stop = std::find_if(tests.begin(), tests.end(), [](const std::string& row) { return row.rfind("1,23,", 0) == 0; });
      ASSERT_NE(at_stop, tests.end());
      tests.erase(at_stop);
      EXPECT_EQ(tests, metrics_rows(straight + "/metrics.csv", "test"));
      // summary.json keeps the epochs of the runs before each checkpoint.
      const Json summary = test::read_summary(split), straight_summary = test::read_summary(straight);
      ASSERT_EQ(summary.at("epochs").size(), 2u);
      for (size_t e = 0; e < 2; ++e)
        EXPECT_EQ(summary.at("epochs").at(e).at("test").at("top1").get<double>(),
                  straight_summary.at("epochs").at(e).at("test").at("top1").get<double>());
      EXPECT_EQ(summary.at("resumed_from").at("step").get<double>(), 23);
    } else {
      // SIGTERM to the launcher in epoch 1: every worker finishes the step it
      // is on, that step is checkpointed, the job exits 143, and --resume auto
      // goes on from it.
      const std::string preempted = dir / (compression + "_preempted");
      {
        Process p(job(dir / "data", preempted, compression, {"--epochs", "2"}), dir / "out.txt");
        ASSERT_TRUE(eventually([&] { return read_text(preempted + "/mnist_train.log").find("Train Epoch: 1 [5/") != std::string::npos; }, 120s));
        test::send_signal(p.pid(), SIGTERM);
        const int status = p.wait(60s);
        ASSERT_NE(status, -1) << "still running 60 s after SIGTERM";
        EXPECT_EQ(WEXITSTATUS(status), 143) << read_text(dir / "out.txt");
      }
      const std::string stopped = last_line_with(read_text(preempted + "/mnist_train.log"), "Preempted by SIGTERM");
      ASSERT_FALSE(stopped.empty()) << read_text(preempted + "/mnist_train.log");
      const Checkpoint at = load_checkpoint(preempted + "/checkpoint");
      EXPECT_NE(stopped.find("stopped after step " + std::to_string(at.step) + " (epoch 1, batch " + std::to_string(at.batch) + ")"),
                std::string::npos) << stopped;
      EXPECT_GT(at.batch, 5);  // mid-epoch, not the checkpoint of epoch 0
      EXPECT_EQ(test::read_summary(preempted).at("preempted").get<std::string>(), "SIGTERM");
      ASSERT_EQ(run(job(dir / "data", preempted, compression, {"--epochs", "2", "--resume", "auto"}), dir / "out.txt"), 0);
      expect_same_end(preempted, straight);
    }
    if (compression == "none") continue;

    // A random rank SIGKILLed after a random step, in each of three starts
    // of the workers (through the trainer's fault-injection seam, so that
    // the step is reached however slow the machine); the job restarts
    // itself from its newest step checkpoint. The steps are no multiple of
    // 4, so that checkpoint is the one before the kill, whichever rank dies.
    const std::string killed = dir / (compression + "_killed");
    std::vector<int> kill_steps;
    std::string kills;
    for (int start = 0; start < 3; ++start) {
      int step;
      do step = (start == 0 ? 1 : kill_steps.back() + 1) + static_cast<int>(random() % 9);
      while (step % 4 == 0);
      kill_steps.push_back(step);
      kills += (start ? "," : "") + std::to_string(start) + ":" + std::to_string(random() % 2) + ":" + std::to_string(step);
    }
    SCOPED_TRACE("MNIST_DDP_KILL_AFTER_STEP=" + kills);
    {
      Process p(job(dir / "data", killed, compression, {"--epochs", "2", "--checkpoint-steps", "4", "--max-restarts", "5"}),
                dir / "killed.txt", {"MNIST_DDP_KILL_AFTER_STEP=" + kills});
      const int status = p.wait(300s);
      ASSERT_NE(status, -1) << "still running after 300 s";
      EXPECT_EQ(WEXITSTATUS(status), 0) << read_text(dir / "killed.txt");
    }
    const std::string console = read_text(dir / "killed.txt");
    for (int r = 1; r <= 3; ++r) {
      const int newest = kill_steps[r - 1] / 4 * 4;
      EXPECT_NE(console.find("was killed by signal 9 (Killed); stopping the other workers; restart " + std::to_string(r) +
                             " of 5 from the " +
                             (newest ? "checkpoint of step " + std::to_string(newest) : std::string("start"))),
                std::string::npos) << console;
    }
    EXPECT_EQ(console.find("restart 4 of 5"), std::string::npos) << console;
    EXPECT_TRUE(test::processes_mentioning(killed).empty()) << "a worker of the killed run outlived it";
    expect_same_end(killed, straight);
  }
}

// Steps of two micro-batches each under bfloat16 autocast and the bf16
// PowerSGD wrapper: stopped mid-epoch (step 11 of 16, PowerSGD compressing from 10) and resumed, the run
// ends as the straight one, bit for bit. A checkpoint falls between
// optimizer steps only (a step's micro-batches run within it), so the
// resume goes on at the next step's first micro-batch.
TEST(Resume, AccumulatedMixedPrecisionStepsStopAndGoOnExactly) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 512, 128);
  const std::vector<std::string> precision = {"--epochs", "2", "--amp", "bf16", "--accumulate", "2",
                                              "--batch-size", "16"};
  const std::string straight = dir / "straight", split = dir / "split";
  ASSERT_EQ(run(job(dir / "data", straight, "powersgd_bf16", precision), dir / "out.txt"), 0) << read_text(dir / "out.txt");
  const std::string log = read_text(straight + "/mnist_train.log");
  EXPECT_NE(log.find("Mixed precision: forward and loss under autocast to bf16"), std::string::npos) << log;
  EXPECT_NE(log.find("Gradient accumulation: 2 micro-batches of 16 per optimizer step"), std::string::npos) << log;
  EXPECT_NE(log.find("Train Epoch: 1 [5/8"), std::string::npos) << "8 steps of 2 x 16 images a rank an epoch:\n" << log;
  EXPECT_NE(log.find("Replicas: all 2 ranks hold identical parameters"), std::string::npos) << log;
  for (const std::string stop : {"11", ""}) {
    auto extra = precision;
    extra.insert(extra.end(), {"--resume", "auto"});
    if (!stop.empty()) extra.insert(extra.end(), {"--max-steps", stop});
    ASSERT_EQ(run(job(dir / "data", split, "powersgd_bf16", extra), dir / "out.txt"), 0) << read_text(dir / "out.txt");
  }
  EXPECT_NE(read_text(split + "/mnist_train.log").find("Resuming from " + split + "/checkpoint: epoch 1, batch 3, step 11"),
            std::string::npos) << read_text(split + "/mnist_train.log");
  expect_same_end(split, straight);
}

TEST(Resume, AKillAtEachPointOfCheckpointingLeavesAResumableOne) {
  // 256 images: 4 steps an epoch and a checkpoint after each. A save is 4
  // file operations (model, training state, manifest, removing stale files);
  // run k kills rank 0 right after the k-th operation of its checkpointing,
  // through the trainer's fault-injection seam, and resumes from what the
  // kill left behind: runs 1-4 hit each point of a first save, runs 5 and 6
  // the model and training files of a second save, beside the first's.
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 256, 64);
  const auto args = job(dir / "data", dir / "out", "powersgd_fp16", {"--epochs", "1000", "--resume", "auto"});
  for (int point = 1; point <= 6; ++point) {
    Process p(args, dir / "out.txt", {"MNIST_DDP_KILL_AT_WRITE=" + std::to_string(point)});
    const int status = p.wait(120s);
    ASSERT_NE(status, -1) << "still running after the kill point " << point;
    EXPECT_NE(read_text(dir / "out.txt").find("was killed by signal 9"), std::string::npos)
        << "kill point " << point << " was never reached:\n" << read_text(dir / "out.txt");
    // The first save's manifest lands with its 3rd operation.
    EXPECT_EQ(has_checkpoint(dir / "out/checkpoint"), point >= 3) << "after kill point " << point;
    if (has_checkpoint(dir / "out/checkpoint")) {
      EXPECT_NO_THROW(load_checkpoint(dir / "out/checkpoint")) << "after kill point " << point;
    }
  }
  const Checkpoint c = load_checkpoint(dir / "out/checkpoint");
  EXPECT_EQ(c.step, 4 * 4) << "runs 3 to 6 each add the checkpoint of one epoch";
  auto more = args;
  more.insert(more.end(), {"--max-steps", std::to_string(c.step + 2)});
  EXPECT_EQ(run(more, dir / "out.txt"), 0) << read_text(dir / "out.txt");
  EXPECT_EQ(load_checkpoint(dir / "out/checkpoint").step, c.step + 2);
}

// PyTorch's own torchrun (Debian's python3-torch, installed by
// scripts/install_deps.sh: 1.13 on Debian 12, 2.6 on 13) starts two workers
// of the binary. Its agent
// hosts the store and says so (TORCHELASTIC_USE_AGENT_STORE): the workers
// join it as clients under torchrun's prefix, and train as one job. Rank 1
// dies after a random step; torchrun's --max_restarts 1 starts both again,
// they go on from the newest checkpoint (--resume auto), summary.json says
// so, and the job ends as the straight run does, bit for bit.
TEST(Torchrun, TwoWorkersTrainAsOneJobAndARestartEndsAsTheStraightRun) {
  const std::string python = test::python_with_torchrun();
  if (python.empty()) GTEST_SKIP() << "no torchrun: install python3-torch (scripts/install_deps.sh does)";
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 1024, 256);
  const std::string straight = dir / "straight", restarted = dir / "torchrun";
  ASSERT_EQ(run(job(dir / "data", straight, "powersgd_fp16", {"--epochs", "1"}), dir / "out.txt", 300s, {test::kOneThread}), 0)
      << read_text(dir / "out.txt");

  const int kill_step = test::draw_kill_step();
  const std::string kills = "MNIST_DDP_KILL_AFTER_STEP=0:1:" + std::to_string(kill_step);
  SCOPED_TRACE(kills);
  // tests/torchrun.py is torchrun, its stores classic where PyTorch lacks
  // libuv (Debian 13's 2.6); Python 3.11 needs --redirects and --tee to
  // start torchrun 1.13 at all.
  std::vector<std::string> args = {python, std::string(MNIST_DDP_SOURCE_DIR) + "/tests/torchrun.py",
                                   "--nproc_per_node", "2", "--max_restarts", "1",
                                   "--redirects", "1", "--tee", "1", "--master_port", std::to_string(test::free_port()),
                                   "--no_python", MNIST_DDP_BINARY};
  auto worker_args =
      job(dir / "data", restarted, "powersgd_fp16", {"--epochs", "1", "--checkpoint-steps", "4", "--resume", "auto"});
  const auto nproc = std::find(worker_args.begin(), worker_args.end(), "--nproc");
  worker_args.erase(nproc, nproc + 2);  // torchrun starts the workers
  args.insert(args.end(), worker_args.begin(), worker_args.end());
  Process torchrun(args, dir / "torchrun.txt", {kills, test::kOneThread}, /*command=*/true);
  const int status = torchrun.wait(300s);
  ASSERT_NE(status, -1) << "torchrun still running after 300 s:\n" << read_text(dir / "torchrun.txt");
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_text(dir / "torchrun.txt");
  const Json summary = test::read_summary(restarted);
  EXPECT_EQ(summary.at("world").at("ranks").get<double>(), 2);
  EXPECT_EQ(summary.at("world").at("restart").get<double>(), 1);
  EXPECT_EQ(summary.at("resumed_from").at("step").get<double>(), kill_step / 4 * 4);
  expect_same_end(restarted, straight);
}

TEST(Interop, PythonLoadsTheModelsAndReproducesTheLoggedAccuracy) {
  const std::string python = python_with_torch();
  ASSERT_FALSE(python.empty()) << "no Python with torch: install python3-torch (scripts/install_deps.sh does)";
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 1024, 256);
  ASSERT_EQ(run(job(dir / "data", dir / "out", "none", {"--epochs", "2"}), dir / "out.txt"), 0);
  const std::string log = read_text(dir / "out/mnist_train.log");
  const std::string best = last_line_with(log, "Save model with best accuracy: ");
  ASSERT_FALSE(best.empty()) << log;
  const std::string expected = best.substr(best.find(": ") + 2);  // e.g. "96.4930%"

  std::string checkpoint_model;
  for (const auto& name : files::list_directory(dir / "out/checkpoint"))
    if (name.rfind("model-", 0) == 0) checkpoint_model = dir / ("out/checkpoint/" + name);
  for (const std::string& model : {dir / "out/mnist_model.pt", checkpoint_model}) {
    const std::string command = python + " " + MNIST_DDP_SOURCE_DIR + "/scripts/evaluate_model.py " + model + " " +
                                dir / "data/MNIST/raw" + " > " + dir / "python.txt" + " 2>&1";
    ASSERT_EQ(std::system(command.c_str()), 0) << read_text(dir / "python.txt");
    // The best model is the best test pass's; the checkpoint's, the last's.
    const std::string printed = read_text(dir / "python.txt");
    const Json epochs = test::read_summary(dir / "out").at("epochs");
    const std::string last = fmt::format("{:.4f}%", epochs.at(epochs.size() - 1).at("test").at("top1").get<double>());
    EXPECT_NE(printed.find("test top-1 " + (model == dir / "out/mnist_model.pt" ? expected : last)), std::string::npos)
        << model << ": " << printed << " vs " << expected << " (best), " << last << " (last)";
  }
}

TEST(Security, FilesAreNeverWorldWritableAndTheStoreListensOnLoopbackOnly) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 4000, 64);
  const mode_t saved = umask(0);  // the worst a caller could do
  Process p(job(dir / "data", dir / "out", "none", {"--epochs", "1"}), dir / "out.txt");
  umask(saved);
  ASSERT_TRUE(eventually([&] { return read_text(dir / "out/mnist_train.log").find("Train Epoch: 0 [5/") != std::string::npos; }, 60s));

  // Every listening socket of the launcher (the store's) and the workers
  // (Gloo's), from /proc/net/tcp{,6}.
  std::set<std::string> inodes;
  std::vector<pid_t> processes = test::children_of(p.pid());
  processes.push_back(p.pid());
  for (pid_t w : processes)
    for (const auto& fd : files::list_directory("/proc/" + std::to_string(w) + "/fd")) {
      const std::string target = test::read_symlink("/proc/" + std::to_string(w) + "/fd/" + fd);
      if (target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
    }
  int listening = 0;
  for (const std::string table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::istringstream lines(read_text(table));
    std::string line;
    std::getline(lines, line);
    while (std::getline(lines, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      f >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      if (state != "0A" || !inodes.count(inode)) continue;
      ++listening;
      EXPECT_EQ(table, "/proc/net/tcp") << "an IPv6 listener: " << line;
      EXPECT_EQ(local.substr(0, 8), "0100007F") << "listening beyond loopback: " << line;
    }
  }
  EXPECT_GE(listening, 1) << "the store's listening socket was not found";
  ASSERT_EQ(WEXITSTATUS(p.wait(120s)), 0);

  for (const auto& path : test::walk(dir / "out")) {
    struct stat st{};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & S_IWOTH, 0u) << path << " is world-writable";
  }
  struct stat st{};
  stat((dir / "out").c_str(), &st);
  EXPECT_EQ(st.st_mode & S_IWOTH, 0u);
}

}  // namespace
}  // namespace mnist_ddp
