// The smoke run: the binary trains on the MNIST that scripts/fetch_data.sh provides.
#include <gtest/gtest.h>

#include <poll.h>
#include <pty.h>

#include <map>
#include <regex>

#include <spdlog/fmt/fmt.h>

#include "app/base/files.hpp"
#include "app/base/options.hpp"
#include "app/train/model.hpp"
#include "app/train/checkpoint.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::Process;
using test::read_text;
using test::TempDir;

const std::string kData = std::string(MNIST_DDP_SOURCE_DIR) + "/data";

// The last epoch's test top-1 in a run's summary.json.
double final_test_top1(const std::string& path) {
  const Json epochs = test::read_summary(path).at("epochs");
  return epochs.at(epochs.size() - 1).at("test").at("top1").get<double>();
}

TEST(EndToEnd, TwoGlooWorkersLearnMnistInOneEpoch) {
  ASSERT_TRUE(files::exists(kData + "/MNIST/raw")) << "run: bash scripts/fetch_data.sh mnist";
  TempDir dir;
  const std::string out = dir / "output.txt";
  Process run({"--backend", "gloo", "--nproc", "2", "--epochs", "1", "--compression", "none", "--data-dir", kData,
               "--path", dir / "out"},
              out);
  const int status = run.wait(600s);
  const std::string console = read_text(out);
  ASSERT_NE(status, -1) << "the run took more than 10 minutes";
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << console;

  const std::string log = read_text(dir / "out/mnist_train.log");
  // The reference's lines, in the reference's format.
  EXPECT_TRUE(std::regex_search(log, std::regex(R"(\d\d/\d\d \d\d:\d\d:\d\d [AP]M \| Arguments:)")));
  EXPECT_NE(log.find("| compression: none\n"), std::string::npos);
  EXPECT_TRUE(std::regex_search(
      log, std::regex(R"(\| Train Epoch: 0 \[0/\d+\t\(0%\)\]\tLoss: \d+\.\d{6}\tTop 1 Acc: \d+\.\d\d%\tTop 5 Acc: \d+\.\d\d%)")));
  EXPECT_NE(log.find("Save model with best accuracy: "), std::string::npos);
  EXPECT_NE(log.find("Current best test accuracy: "), std::string::npos);
  // summary.json holds the logged figures at full precision.
  const Json summary = test::read_summary(dir / "out");
  EXPECT_TRUE(summary.at("finished").get<bool>());
  EXPECT_EQ(summary.at("arguments").at("compression").get<std::string>(), "none");
  EXPECT_EQ(summary.at("world").at("ranks").get<double>(), 2);
  // Workers on one host sum through shared memory (multinode_test: not across nodes).
  EXPECT_EQ(summary.at("world").at("sums").get<std::string>(), "shared memory");
  EXPECT_NE(log.find("Process group: gloo over 2 rank(s), sums through shared memory, device cpu"), std::string::npos);
  ASSERT_EQ(summary.at("epochs").size(), 1u);
  const Json& epoch = summary.at("epochs").at(0);
  const double accuracy = epoch.at("test").at("top1").get<double>();
  std::cout << "test top-1 after one epoch: " << accuracy << "%" << std::endl;
  EXPECT_GE(accuracy, 85.0) << log;
  EXPECT_NE(log.find(fmt::format("Test Epoch: 0: Average loss: {:.4f}, Top 1 Acc: {:.2f}%, Top 5 Acc: {:.2f}%",
                                 epoch.at("test").at("loss").get<double>(), accuracy, epoch.at("test").at("top5").get<double>())),
            std::string::npos)
      << log;
  EXPECT_EQ(summary.at("best_test_top1").get<double>(), accuracy);
  const Json& training = summary.at("training");
  EXPECT_EQ(training.at("steps").get<double>(), epoch.at("steps").get<double>());
  EXPECT_NE(log.find(fmt::format("Training: {} steps in {:.1f} s, {:.0f} images/s, {:.1f} ms/step",
                                 training.at("steps").get<double>(), training.at("seconds").get<double>(),
                                 training.at("images_per_s").get<double>(), training.at("ms_per_step").get<double>())),
            std::string::npos)
      << log;
  EXPECT_EQ(summary.at("compression").at("bytes_per_step").get<double>(), 4800296);
  EXPECT_EQ(summary.at("compression").at("ratio_to_none").get<double>(), 1);
  EXPECT_EQ(summary.at("compression").at("started_at_step").get<double>(), 0);
  EXPECT_EQ(summary.at("replicas").at("checks").get<double>(), 1);
  EXPECT_GT(summary.at("startup_s").get<double>(), 0);
  EXPECT_TRUE(summary.at("resumed_from").is_null());
  EXPECT_TRUE(files::exists(dir / "out/mnist_model.pt"));
  EXPECT_NE(console.find("The folder '" + dir / "out" + "' was created."), std::string::npos) << console;
  EXPECT_TRUE(std::regex_search(log, std::regex(R"(\| Startup: first step \d+\.\d\d s after launch)"))) << log;
  // Not a terminal: no progress line.
  EXPECT_EQ(console.find('\r'), std::string::npos);
  EXPECT_EQ(console.find("ETA"), std::string::npos);

  // metrics.csv: a row per logged training step, one per test, matching the log.
  std::istringstream metrics(read_text(dir / "out/metrics.csv"));
  std::string line;
  std::getline(metrics, line);
  EXPECT_EQ(line, "epoch,step,split,loss,top1,top5,lr,images_per_s,wire_bytes_per_step");
  std::vector<std::string> train_losses, tests;
  while (std::getline(metrics, line)) {
    std::vector<std::string> cell;
    std::istringstream cells(line);
    for (std::string c; std::getline(cells, c, ',');) cell.push_back(c);
    if (line.find(",test,") != std::string::npos) {
      EXPECT_EQ(line.substr(line.size() - 2), ",,") << "a test row has no speed or bytes: " << line;
      cell.resize(9);
    }
    ASSERT_EQ(cell.size(), 9u) << line;
    EXPECT_EQ(cell[0], "0");
    EXPECT_EQ(cell[6], "0.01");
    if (cell[2] == "train") {
      train_losses.push_back(cell[3]);
      EXPECT_GT(std::stod(cell[7]), 0) << line;
      EXPECT_EQ(cell[8], "4800296") << line;  // none sends every gradient in float32
    } else {
      tests.push_back(cell[4]);
    }
  }
  static const std::regex logged_loss(R"(Train Epoch: 0 \[\d+/\d+\t\(\d+%\)\]\tLoss: (\d+\.\d{6}))");
  std::vector<std::string> logged;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), logged_loss); it != std::sregex_iterator(); ++it)
    logged.push_back((*it)[1]);
  EXPECT_EQ(train_losses, logged);
  ASSERT_EQ(tests.size(), 1u);
  EXPECT_NEAR(std::stod(tests[0]), accuracy, 0.005);
}

// Runs the binary on a new pseudo-terminal; returns what the terminal
// showed, or nullopt (with `why`) where no pseudo-terminal can be had.
std::optional<std::string> run_on_terminal(const std::vector<std::string>& args, int* status, std::string* why) {
  int master = -1;
  const pid_t pid = forkpty(&master, nullptr, nullptr, nullptr);
  if (pid < 0) {
    *why = std::string("forkpty: ") + std::strerror(errno);
    return std::nullopt;
  }
  if (pid == 0) {
    setenv("TERM", "xterm", 1);
    std::vector<std::string> argv = {MNIST_DDP_BINARY};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    execv(cargv[0], cargv.data());
    _exit(127);
  }
  std::string shown;
  const auto deadline = std::chrono::steady_clock::now() + 300s;
  char buf[4096];
  for (;;) {
    pollfd fd = {master, POLLIN, 0};
    if (std::chrono::steady_clock::now() > deadline || poll(&fd, 1, 1000) < 0) break;
    if (fd.revents == 0) continue;
    const ssize_t got = read(master, buf, sizeof buf);
    if (got <= 0) break;  // EIO: every process on the terminal has closed it
    shown.append(buf, static_cast<size_t>(got));
  }
  close(master);
  test::send_signal(pid, SIGKILL);
  waitpid(pid, status, 0);
  return shown;
}

TEST(EndToEnd, ATerminalShowsAProgressLineAndMetricsPlot) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 2048, 256);
  int status = 0;
  std::string why;
  const auto terminal = run_on_terminal({"--backend", "gloo", "--nproc", "2", "--epochs", "1", "--compression",
                                             "none", "--data-dir", dir / "data", "--path", dir / "out"},
                                            &status, &why);
  if (!terminal) GTEST_SKIP() << "no pseudo-terminal to run on (" << why << "): mount /dev/pts";
  const std::string& shown = *terminal;
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << shown;
  // Redrawn in place under the log lines: "Epoch 0 [====>   ] 12/32  850 images/s  loss 1.2345  ETA 0:03".
  EXPECT_TRUE(std::regex_search(
      shown, std::regex(R"(\r\x1b\[KEpoch 0 \[=*>? *\] \d+/32  \d+ images/s  loss \d+\.\d{4}  ETA \d+:\d\d)")))
      << shown;
  EXPECT_NE(shown.find("Epoch 0 [====================] 32/32"), std::string::npos) << shown;
  // Gone before the next log line, and never in the log file.
  EXPECT_TRUE(std::regex_search(shown, std::regex(R"(ETA \d+:\d\d\r\x1b\[K\d\d/\d\d )"))) << shown;
  EXPECT_EQ(read_text(dir / "out/mnist_train.log").find("ETA"), std::string::npos);

  // Two runs' curves side by side in one PNG. scripts/install_deps.sh
  // installs gnuplot, and the script would from Debian's archive.
  if (std::system("command -v gnuplot >/dev/null || command -v apt-get >/dev/null && apt-cache show gnuplot-nox "
                  ">/dev/null 2>&1") != 0)
    GTEST_SKIP() << "the plot: no gnuplot here, and no package archive to install it from";
  test::copy_tree(dir / "out", dir / "copy");
  const std::string plot = dir / "curves.png";
  const std::string command = "bash " + std::string(MNIST_DDP_SOURCE_DIR) + "/scripts/plot_metrics.sh '" + plot +
                              "' '" + dir / "out" + "' '" + dir / "copy/metrics.csv" + "' >'" + dir / "plot.txt" +
                              "' 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << read_text(dir / "plot.txt");
  EXPECT_EQ(read_text(plot).substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  const std::string refused = "bash " + std::string(MNIST_DDP_SOURCE_DIR) + "/scripts/plot_metrics.sh '" + plot +
                              "' '" + dir / "out/mnist_train.log" + "' >'" + dir / "plot.txt" + "' 2>&1";
  EXPECT_NE(std::system(refused.c_str()), 0);
  EXPECT_NE(read_text(dir / "plot.txt").find("not a metrics.csv written by mnist_ddp"), std::string::npos);
}

// Every hook trains Net as well as plain allreduce does: within `margin`
// points of test top-1 after the same number of epochs on 2 workers,
// PowerSGD compressing from step 10, and each above `floor`. `train` and
// `test` > 0: the first images of the fetched MNIST, as a dataset the test
// writes; 0: all of it.
//
// batched_powersgd_fp16 runs at rank 4. At the default rank 2 it trails
// none by 1.2 to 2.0 points here (seeds 0-2, after 6 and after 10 epochs):
// one rank-2 approximation of the whole bucket as a square matrix loses
// more than per-layer PowerSGD, as PyTorch documents for this variant.
void expect_every_compression_learns_as_well_as_none(int epochs, double margin, double floor, int train = 0,
                                                     int test = 0) {
  ASSERT_TRUE(files::exists(kData + "/MNIST/raw")) << "run: bash scripts/fetch_data.sh mnist";
  TempDir data;
  if (train > 0) test::write_mnist_subset(kData, data.path(), train, test);
  const std::string data_dir = train > 0 ? data.path() : kData;
  const std::vector<std::pair<std::string, std::vector<std::string>>> runs = {
      {"none", {}}, {"fp16", {}}, {"powersgd", {}}, {"powersgd_fp16", {}},
      {"batched_powersgd_fp16", {"--powersgd-rank", "4"}}};
  std::map<std::string, double> accuracy;
  for (const auto& [compression, extra] : runs) {
    TempDir dir;
    std::vector<std::string> args = {"--backend", "gloo", "--nproc", "2", "--epochs", std::to_string(epochs),
                                      "--compression", compression, "--start-powersgd-iter", "10",
                                      "--log-interval", "100", "--checkpoint-every", "0",
                                      "--data-dir", data_dir, "--path", dir / "out"};
    args.insert(args.end(), extra.begin(), extra.end());
    Process run(args, dir / "output.txt");
    const int status = run.wait(600s);
    ASSERT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_text(dir / "output.txt");
    const Json summary = test::read_summary(dir / "out");
    ASSERT_EQ(summary.at("epochs").size(), static_cast<size_t>(epochs));
    accuracy[compression] = final_test_top1(dir / "out");
    std::cout << compression << ": test top-1 " << accuracy[compression] << "% after " << epochs << " epochs"
              << std::endl;
    const Json& c = summary.at("compression");
    EXPECT_EQ(c.at("hook").get<std::string>(), compression);
    EXPECT_EQ(c.at("started_at_step").get<double>(), compression.find("powersgd") != std::string::npos ? 10 : 0);
    // None sends 4,800,296 bytes a step; fp16 half; PowerSGD far less.
    EXPECT_LE(c.at("bytes_per_step").get<double>(), compression == "none" ? 4800296 : 2400148) << compression;
    EXPECT_GE(accuracy[compression], floor) << compression;
  }
  for (const auto& [compression, top1] : accuracy)
    EXPECT_GE(top1, accuracy["none"] - margin) << compression << " trails none (" << accuracy["none"] << "%)";
}

// 3,200 training and 1,000 test images, 2 epochs: 100 steps. Calibrated
// with --seed 1 and 2: none reaches 80.4% and 81.0%, every hook within 0.6
// points of it.
TEST(EndToEnd, EveryCompressionLearnsAsWellAsNone) {
  expect_every_compression_learns_as_well_as_none(2, 1.5, 78, 3200, 1000);
}

TEST(SlowEndToEnd, EveryCompressionLearnsAsWellAsNoneOverSixEpochs) {
  expect_every_compression_learns_as_well_as_none(6, 1.5, 96);
}

// Mixed precision, accumulation and bf16 compression as PyTorch users
// train, 3 epochs of MNIST on 2 workers, each against the float32 run it
// stands for: --amp bf16 and --compression bf16 against none in float32,
// --accumulate 2 --batch-size 16 against --batch-size 32 (the same images
// a step). Each within 0.5 points of test top-1, replicas identical, and
// each setting seen to take effect. Then the first step alone: --accumulate
// 2 --batch-size 16 moves the parameters as --batch-size 32 does (up to
// BatchNorm's statistics over 16 images instead of 32, and dropout's draws:
// within a quarter of the step), where a doubled learning rate would be a
// whole step off; --amp bf16 moves them otherwise than float32, which
// repeats its step bit for bit, but the same way.
TEST(SlowEndToEnd, MixedPrecisionAccumulationAndBf16LearnAsFloat32Does) {
  ASSERT_TRUE(files::exists(kData + "/MNIST/raw")) << "run: bash scripts/fetch_data.sh mnist";
  const std::vector<std::pair<std::string, std::vector<std::string>>> runs = {
      {"float32", {}},
      {"--amp bf16", {"--amp", "bf16"}},
      {"--accumulate 2 --batch-size 16", {"--accumulate", "2", "--batch-size", "16"}},
      {"--compression bf16", {}}};
  std::map<std::string, double> accuracy;
  for (const auto& [name, extra] : runs) {
    TempDir dir;
    const std::string compression = name == "--compression bf16" ? "bf16" : "none";
    std::vector<std::string> args = {"--backend", "gloo", "--nproc", "2", "--epochs", "3", "--compression", compression,
                                      "--log-interval", "100", "--checkpoint-every", "0", "--data-dir", kData,
                                      "--path", dir / "out"};
    args.insert(args.end(), extra.begin(), extra.end());
    Process run(args, dir / "output.txt");
    const int status = run.wait(1200s);
    ASSERT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_text(dir / "output.txt");
    const std::string log = read_text(dir / "out/mnist_train.log");
    EXPECT_NE(log.find("Replicas: all 2 ranks hold identical parameters"), std::string::npos) << name << "\n" << log;
    if (name.rfind("--accumulate", 0) == 0) {
      EXPECT_NE(log.find("Gradient accumulation: 2 micro-batches of 16 per optimizer step"), std::string::npos) << log;
    } else {
      EXPECT_EQ(log.find("Gradient accumulation"), std::string::npos) << name;
    }
    accuracy[name] = final_test_top1(dir / "out");
    std::cout << name << ": test top-1 " << accuracy[name] << "% after 3 epochs" << std::endl;
    if (compression == "bf16") {  // half of none's 4,800,296, as fp16
      EXPECT_EQ(test::read_summary(dir / "out").at("compression").at("bytes_per_step").get<double>(), 2400148);
    }
  }
  for (const auto& [name, top1] : accuracy)
    EXPECT_NEAR(top1, accuracy["float32"], 0.5) << name << " against float32 (" << accuracy["float32"] << "%)";

  // The first step. Its parameters cannot match --batch-size 32's to a
  // tight tolerance: Net's dropout draws other masks for two micro-batches
  // of 16 than for one batch of 32, and BatchNorm normalises each
  // micro-batch over its own statistics (README). What --accumulate must
  // give is a step as long as one batch of 32 makes, in much the same
  // direction: a missing 1/2 share of each micro-batch's loss, or a step
  // per micro-batch, doubles it (as a doubled --lr does, which the check
  // tells apart). The start is the trainer's own: a step at --lr 1e-30.
  std::map<std::string, TensorDict> after;
  for (const auto& [name, extra] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"start", {"--batch-size", "32", "--lr", "1e-30"}}, {"32", {"--batch-size", "32"}},
           {"2x16", {"--accumulate", "2", "--batch-size", "16"}},
           {"32, lr doubled", {"--batch-size", "32", "--lr", "0.02"}},
           {"32, --amp bf16", {"--batch-size", "32", "--amp", "bf16"}}, {"32 again", {"--batch-size", "32"}}}) {
    TempDir dir;
    std::vector<std::string> args = {"--backend", "gloo", "--nproc", "2", "--epochs", "1", "--max-steps", "1",
                                     "--compression", "none", "--checkpoint-every", "1", "--data-dir", kData,
                                     "--path", dir / "out"};
    args.insert(args.end(), extra.begin(), extra.end());
    ASSERT_EQ(Process(args, dir / "output.txt").wait(300s), 0) << read_text(dir / "output.txt");
    after[name] = load_checkpoint(dir / "out/checkpoint").model;
  }
  // The step from the start to `name`'s parameters, every weight in one vector.
  auto step_of = [&](const std::string& name) {
    std::vector<torch::Tensor> parts;
    for (const auto& item : after[name])
      if (item.key().find("weight") != std::string::npos)
        parts.push_back((item.value().to(torch::kFloat64) - after["start"].at(item.key()).to(torch::kFloat64)).reshape(-1));
    return torch::cat(parts);
  };
  const torch::Tensor one = step_of("32"), accumulated = step_of("2x16"), doubled = step_of("32, lr doubled");
  const double length = one.norm().item<double>();
  ASSERT_GT(length, 0);
  const double ratio = accumulated.norm().item<double>() / length;
  EXPECT_GT(ratio, 0.8);
  EXPECT_LT(ratio, 1.25) << "--accumulate 2 stepped further than one batch of 32";
  EXPECT_GT((accumulated * one).sum().item<double>() / (accumulated.norm() * one.norm()).item<double>(), 0.5)
      << "--accumulate 2 stepped in another direction than one batch of 32";
  EXPECT_GT(doubled.norm().item<double>() / length, 1.6) << "the check tells a doubled step apart";

  // --amp bf16 took effect, seen in what the step computed rather than in
  // a line the option prints: the same first step from the same start,
  // which a float32 run repeats bit for bit, comes out otherwise with the
  // forward under bfloat16 autocast, and still goes much the same way
  // (dropout's draws on bfloat16 activations may differ too: the bound is
  // the one --accumulate's step has, less a margin).
  ASSERT_EQ(test::max_abs_diff(after["32"], after["32 again"]), 0) << "a float32 step is not repeatable";
  const torch::Tensor bf16 = step_of("32, --amp bf16");
  const double apart = (bf16 - one).norm().item<double>() / length;
  std::cout << "--amp bf16's first step is " << apart << " of its length away from float32's" << std::endl;
  EXPECT_GT(apart, 1e-3) << "--amp bf16 stepped exactly as float32 does: nothing ran under autocast";
  EXPECT_GT((bf16 * one).sum().item<double>() / (bf16.norm() * one.norm()).item<double>(), 0.3)
      << "--amp bf16 stepped in another direction than float32";
}

// Two workers sharing one GPU over Gloo: the whole multi-rank CUDA path
// (buckets in device memory, SyncBatchNorm across ranks, every hook, the
// replica check after each epoch) against the same run on 2 CPU workers.
// Dropout draws differ between the devices, so the accuracies differ by
// chance (on one H200 at 1e2b896, batched_powersgd_fp16 at rank 4 reached
// 96.09% on the GPU and 94.94% on the CPU): a broken GPU path learns less,
// so the GPU must come within a point of the CPU or above it.
TEST(CudaEndToEnd, TwoWorkersSharingOneGpuTrainEveryHookAsTheCpuDoes) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device is visible to this LibTorch";
  ASSERT_TRUE(files::exists(kData + "/MNIST/raw")) << "run: bash scripts/fetch_data.sh mnist";
  for (const std::string& compression : kCompressions) {
    std::map<std::string, double> accuracy;
    for (const std::string device : {"gpu", "cpu"}) {
      TempDir dir;
      std::vector<std::string> args = {"--backend", "gloo", "--epochs", "2", "--compression", compression,
                                        "--start-powersgd-iter", "10", "--log-interval", "100",
                                        "--checkpoint-every", "0", "--data-dir", kData, "--path", dir / "out"};
      for (const auto& a : device == "gpu" ? std::vector<std::string>{"--gpus", "0,0"}
                                           : std::vector<std::string>{"--nproc", "2"})
        args.push_back(a);
      if (compression == "batched_powersgd_fp16") {  // see EveryCompressionLearnsAsWellAsNone
        args.push_back("--powersgd-rank");
        args.push_back("4");
      }
      Process run(args, dir / "output.txt");
      const int status = run.wait(600s);
      ASSERT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_text(dir / "output.txt");
      const std::string log = read_text(dir / "out/mnist_train.log");
      EXPECT_NE(log.find("Replicas: all 2 ranks hold identical parameters"), std::string::npos) << log;
      if (device == "gpu") {
        EXPECT_NE(log.find("device cuda:0"), std::string::npos) << log;
      }
      accuracy[device] = final_test_top1(dir / "out");
      EXPECT_GE(accuracy[device], 90.0) << log;
    }
    std::cout << compression << ": test top-1 after 2 epochs, 2 workers on one GPU " << accuracy["gpu"]
              << "%, on the CPU " << accuracy["cpu"] << "%" << std::endl;
    EXPECT_GE(accuracy["gpu"], accuracy["cpu"] - 1.0) << compression;
  }
}

}  // namespace
}  // namespace mnist_ddp
