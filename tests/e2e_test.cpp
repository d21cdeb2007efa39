// The smoke run: the binary trains on the MNIST that scripts/fetch_data.sh provides.
#include <gtest/gtest.h>

#include <map>
#include <regex>

#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::Process;
using test::read_text;
using test::TempDir;

const std::string kData = std::string(MNIST_DDP_SOURCE_DIR) + "/data";

double last_test_accuracy(const std::string& log) {
  static const std::regex re(R"(Test Epoch: \d+: Average loss: [0-9.]+, Top 1 Acc: ([0-9.]+)%, Top 5 Acc: [0-9.]+%)");
  double accuracy = -1;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), re); it != std::sregex_iterator(); ++it)
    accuracy = std::stod((*it)[1]);
  return accuracy;
}

TEST(EndToEnd, TwoGlooWorkersLearnMnistInOneEpoch) {
  ASSERT_TRUE(test::fs::exists(kData + "/MNIST/raw")) << "run: bash scripts/fetch_data.sh mnist";
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
  const double accuracy = last_test_accuracy(log);
  std::cout << "test top-1 after one epoch: " << accuracy << "%" << std::endl;
  EXPECT_GE(accuracy, 85.0) << log;
  EXPECT_TRUE(test::fs::exists(dir / "out/mnist_model.pt"));
  EXPECT_NE(console.find("The folder '" + dir / "out" + "' was created."), std::string::npos) << console;
}

// Every hook trains Net as well as plain allreduce does: within 1.5 points
// of test top-1 after the same 756 steps (6 epochs of the MNIST set on 2
// workers), PowerSGD compressing from step 10.
//
// batched_powersgd_fp16 runs at rank 4. At the default rank 2 it trails
// none by 1.2 to 2.0 points here (seeds 0-2, after 6 and after 10 epochs):
// one rank-2 approximation of the whole bucket as a square matrix loses
// more than per-layer PowerSGD, as PyTorch documents for this variant.
TEST(EndToEnd, EveryCompressionLearnsAsWellAsNone) {
  ASSERT_TRUE(test::fs::exists(kData + "/MNIST/raw")) << "run: bash scripts/fetch_data.sh mnist";
  const std::vector<std::pair<std::string, std::vector<std::string>>> runs = {
      {"none", {}}, {"fp16", {}}, {"powersgd", {}}, {"powersgd_fp16", {}},
      {"batched_powersgd_fp16", {"--powersgd-rank", "4"}}};
  std::map<std::string, double> accuracy;
  for (const auto& [compression, extra] : runs) {
    TempDir dir;
    std::vector<std::string> args = {"--backend", "gloo", "--nproc", "2", "--epochs", "6", "--compression",
                                      compression, "--start-powersgd-iter", "10", "--log-interval", "100",
                                      "--data-dir", kData, "--path", dir / "out"};
    args.insert(args.end(), extra.begin(), extra.end());
    Process run(args, dir / "output.txt");
    const int status = run.wait(600s);
    ASSERT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_text(dir / "output.txt");
    const std::string log = read_text(dir / "out/mnist_train.log");
    accuracy[compression] = last_test_accuracy(log);
    std::cout << compression << ": test top-1 " << accuracy[compression] << "%" << std::endl;
    EXPECT_NE(log.find("Compression: " + compression + " "), std::string::npos) << log;
  }
  for (const auto& [compression, top1] : accuracy)
    EXPECT_GE(top1, accuracy["none"] - 1.5) << compression << " trails none (" << accuracy["none"] << "%)";
}

}  // namespace
}  // namespace mnist_ddp
