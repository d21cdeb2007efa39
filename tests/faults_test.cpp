// Faults and bad input as users meet them: real processes, each asserting
// the exit code, the one line a user reads, and that nothing is left running.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <regex>
#include <thread>

#include "app/train/checkpoint.hpp"
#include "app/base/files.hpp"
#include "mnist_ddp/parallel/amp.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::eventually;
using test::idx_bytes;
using test::Process;
using test::read_text;
using test::TempDir;

// Orphans are reparented to the test process, so a worker left behind is
// found as our child.
class Faults : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0); }
  void TearDown() override {
    EXPECT_TRUE(test::no_children_left(15s)) << "a process was left running";
  }
};

struct Outcome {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
};

Outcome run(const std::vector<std::string>& args, const TempDir& dir, std::chrono::seconds limit = 120s,
            const std::vector<std::string>& env = {}) {
  const auto start = std::chrono::steady_clock::now();
  Process p(args, dir / "output.txt", env);
  const int status = p.wait(limit);
  Outcome o;
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  o.exit_code = status == -1 ? -1 : WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  o.output = read_text(dir / "output.txt");
  return o;
}

// The user reads one error line. Unless training had begun (its log lines
// come first), nothing else but the launcher saying it created --path.
void expect_one_error_line(const Outcome& o, int code, const std::string& piece, bool training_began = false) {
  EXPECT_EQ(o.exit_code, code) << o.output;
  std::istringstream lines(o.output);
  std::string line;
  int errors = 0, others = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("mnist_ddp: error: ", 0) == 0) {
      ++errors;
      EXPECT_NE(line.find(piece), std::string::npos) << "'" << line << "' lacks '" << piece << "'";
    } else if (line.rfind("The folder '", 0) != 0) {
      ++others;
    }
  }
  EXPECT_EQ(errors, 1) << o.output;
  if (!training_began) {
    EXPECT_EQ(others, 0) << o.output;
  }
  EXPECT_EQ(o.output.find("Exception raised from"), std::string::npos) << o.output;
  EXPECT_EQ(o.output.find("terminate called"), std::string::npos) << o.output;
}

std::vector<std::string> base(const TempDir& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--backend", "gloo", "--nproc", "2", "--data-dir", dir / "data",
                                   "--path", dir / "out", "--timeout", "20", "--log-interval", "1000"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& extra) {
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST_F(Faults, UsageErrorsExitWith2) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 64, 32);
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--compression", "zip"}, "--compression: must be one of none, fp16"},
      {{"--batch-size", "0"}, "--batch-size: must be a positive integer, got '0'"},
      {{"--batch-size", "many"}, "--batch-size: must be a positive integer, got 'many'"},
      {{"--test-batch-size", "-1"}, "--test-batch-size"},
      {{"--epochs", "0"}, "--epochs: must be a positive integer"},
      {{"--lr", "-0.1"}, "--lr: must be a positive number"},
      {{"--lr", "fast"}, "--lr: must be a positive number, got 'fast'"},
      {{"--gpus", "9"}, "--gpus: device 9 does not exist"},
      {{"--backend", "nccl", "--gpus", "0,0"}, "--backend nccl"},  // CPU-only build, no GPU, or a GPU twice
      {{"--amp", "fp32"}, "--amp: must be one of none, bf16, fp16"},
      {{"--accumulate", "0"}, "--accumulate: must be an integer from 1 up to 1024, got '0'"},
      // Refused, not clamped to 2^64-1 (Options.EveryIntegerFlagRefusesWhatItCannotHold has every integer flag
      // in the parser; one here is the program's exit).
      {{"--seed", "99999999999999999999"}, "--seed: must be an integer in 0..18446744073709551615, got '99999999999999999999'"},
  };
  auto all = cases;
  // float16 autocast on the CPU, refused where this LibTorch has none (1.13's), naming what would work.
  if (!torch::cuda::is_available() && !autocast_unsupported(torch::Device(torch::kCPU), torch::kHalf).empty())
    all.push_back({{"--amp", "fp16"},
                   "--amp fp16: this LibTorch's CPU autocast has no float16; use --amp bf16, or a GPU, or --amp none"});
  for (const auto& [args, message] : all) {
    SCOPED_TRACE(args.front() + " " + args.back());
    expect_one_error_line(run(with(base(dir), args), dir), 2, message);
    EXPECT_FALSE(files::exists(dir / "out")) << "nothing is created for a usage error";
  }
  // Under torchrun each rank prints its own line: each says whose it is.
  expect_one_error_line(run(with(base(dir), {"--epochs", "0"}), dir, 60s,
                            {"RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=1", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29733"}),
                        2, "mnist_ddp: error: rank 1: --epochs: must be a positive integer");
}

TEST_F(Faults, MissingAndMalformedDataAreNamed) {
  TempDir dir;
  expect_one_error_line(run(base(dir), dir), 1, "scripts/fetch_data.sh mnist");

  struct Broken {
    std::string what, file, bytes, message;
  };
  std::vector<uint8_t> labels(64);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<uint8_t>(i % 10);
  std::vector<uint8_t> bad_labels = labels;
  bad_labels[17] = 12;
  const std::vector<Broken> cases = {
      {"wrong magic", "train-images-idx3-ubyte.gz", idx_bytes({64, 28, 28}, std::vector<uint8_t>(64 * 784), 0x0803abcd),
       "bad magic number"},
      {"truncated", "train-images-idx3-ubyte.gz", idx_bytes({64, 28, 28}, std::vector<uint8_t>(60 * 784)), "truncated"},
      {"count mismatch", "train-labels-idx1-ubyte.gz", idx_bytes({63}, std::vector<uint8_t>(63)),
       "64 images but 63 labels"},
      {"label out of range", "train-labels-idx1-ubyte.gz", idx_bytes({64}, bad_labels), "label 12 is outside 0..9"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    test::write_synthetic_mnist(dir / "data", 64, 32);
    test::write_file(dir / ("data/MNIST/raw/" + c.file), c.bytes, true);
    const Outcome o = run(base(dir), dir);
    expect_one_error_line(o, 1, c.message);
    EXPECT_NE(o.output.find(c.file), std::string::npos) << o.output;
  }
}

TEST_F(Faults, PortInUseAndUnwritablePath) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 64, 32);
  const int busy = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(busy, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(busy, 1), 0);
  socklen_t len = sizeof addr;
  getsockname(busy, reinterpret_cast<sockaddr*>(&addr), &len);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  expect_one_error_line(run(with(base(dir), {"--master-port", port}), dir), 1,
                        "--master-port " + port + " is already in use");
  close(busy);

  test::write_file(dir / "a_file", "x", false);
  auto args = base(dir);
  args.push_back("--path");
  args.push_back(dir / "a_file/out");
  expect_one_error_line(run(args, dir), 1, "cannot create the directory");
}

TEST_F(Faults, ResumeFromMissingTruncatedOrForeignCheckpoints) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 256, 64);
  expect_one_error_line(run(with(base(dir), {"--resume", dir / "nowhere"}), dir), 1, "nowhere is not a directory");

  ASSERT_EQ(run(with(base(dir), {"--epochs", "1", "--compression", "none"}), dir).exit_code, 0);
  const std::string ckpt = dir / "out/checkpoint";
  ASSERT_TRUE(has_checkpoint(ckpt));
  std::string training;
  for (const auto& name : files::list_directory(ckpt))
    if (name.rfind("training-", 0) == 0) training = files::join(ckpt, name);
  test::copy_tree(ckpt, dir / "intact");
  test::resize_file(training, test::file_size(training) / 2);
  expect_one_error_line(run(with(base(dir), {"--resume", ckpt}), dir), 1, "is truncated");
  expect_one_error_line(run(with(base(dir), {"--resume", "auto"}), dir), 1, "is truncated");

  files::remove_tree(ckpt);
  files::make_directories(ckpt);
  test::write_file(ckpt + "/manifest", "PK\x03\x04 not ours", false);
  expect_one_error_line(run(with(base(dir), {"--resume", ckpt}), dir), 1, "is not a mnist_ddp checkpoint");

  // A checkpoint of another model: the right format, the wrong tensors.
  Checkpoint other = load_checkpoint(dir / "intact");
  other.model = TensorDict();
  other.model.insert("module.fc.weight", torch::zeros({2, 2}));
  files::remove_tree(ckpt);
  save_checkpoint(ckpt, other);
  expect_one_error_line(run(with(base(dir), {"--resume", ckpt}), dir), 1, "holds a different model");
}

// A --path another user made, with links where the run writes: refused
// in one line before anything is written, and nothing it links to touched.
TEST_F(Faults, AnotherUsersPathIsRefusedAndNoLinkInItFollowed) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 64, 32);
  const std::string victim = dir / "victim.log", victim_dir = dir / "victim_dir";
  test::write_file(victim, "precious\n", false);
  files::make_directories(victim_dir);
  test::write_file(victim_dir + "/keep", "keep", false);
  files::make_directories(dir / "out");
  ASSERT_EQ(symlink(victim.c_str(), (dir / "out/mnist_train.log").c_str()), 0);
  ASSERT_EQ(symlink(victim_dir.c_str(), (dir / "out/checkpoint").c_str()), 0);
  expect_one_error_line(run(base(dir), dir), 1, "mnist_train.log is a symbolic link");
  if (geteuid() == 0) {
    ASSERT_EQ(chown((dir / "out").c_str(), 65534, 65534), 0);
    expect_one_error_line(run(base(dir), dir), 1, "--path " + (dir / "out") + ": it belongs to user");
  }
  EXPECT_EQ(read_text(victim), "precious\n");
  EXPECT_EQ(files::list_directory(victim_dir), std::vector<std::string>{"keep"});
}

TEST_F(Faults, DivergedTrainingStopsNamingEpochAndStep) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 512, 64);
  const Outcome o = run(with(base(dir), {"--lr", "1e6", "--compression", "none"}), dir);
  expect_one_error_line(o, 1, "at epoch 0, step ", /*training_began=*/true);
  EXPECT_TRUE(std::regex_search(o.output, std::regex("the loss is -?(nan|inf)"))) << o.output;
}

// A connection to 127.0.0.1:`port`, retried for up to `limit` while the
// store is not up yet; -1 if it never is.
int connect_when_up(int port, std::chrono::milliseconds limit = 30s) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  do {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in at{};
    at.sin_family = AF_INET;
    at.sin_port = htons(static_cast<uint16_t>(port));
    at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<const sockaddr*>(&at), sizeof at) == 0) return fd;
    close(fd);
    std::this_thread::sleep_for(5ms);
  } while (std::chrono::steady_clock::now() < deadline);
  return -1;
}

// A neighbour on the store's port, as any local process can be. Mid-run,
// a partial request stalls LibTorch's store for good: the job, which
// trains without it, ends as it would have, and so does its launcher,
// which used to wait for the store's loop. Many connections beyond a low
// hard limit of descriptors end the job in one line, not an abort.
TEST_F(Faults, ANeighbourOnTheStoreNeitherHangsNorAbortsTheJob) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 2048, 64);
  {
    const int port = test::free_port();
    Process p(base(dir, {"--master-port", std::to_string(port), "--epochs", "1", "--log-interval", "1",
                         "--compression", "none", "--timeout", "10"}),
              dir / "output.txt");
    ASSERT_TRUE(eventually([&] { return read_text(dir / "out/mnist_train.log").find("Train Epoch: 0 [2/") != std::string::npos; }, 60s))
        << read_text(dir / "output.txt");
    const int neighbour = connect_when_up(port);
    ASSERT_GE(neighbour, 0);
    const char partial[] = {0x00, 0x05, 0x00};  // a SET, and part of its key's length
    ASSERT_EQ(write(neighbour, partial, sizeof partial), static_cast<ssize_t>(sizeof partial));
    const int status = p.wait(60s);
    close(neighbour);
    ASSERT_NE(status, -1) << "still running 60 s after its store stalled:\n" << read_text(dir / "output.txt");
    EXPECT_EQ(WEXITSTATUS(status), 0) << read_text(dir / "output.txt");
  }
  {
    const int port = test::free_port();
    Process p({"bash", "-c", "ulimit -Sn 128 && ulimit -Hn 128 && exec \"$0\" \"$@\"", MNIST_DDP_BINARY, "--backend",
               "gloo", "--nproc", "2", "--data-dir", dir / "data", "--path", dir / "out2", "--timeout", "20",
               "--master-port", std::to_string(port), "--epochs", "1000"},
              dir / "output.txt", {}, /*command=*/true);
    std::vector<int> idle;
    for (int fd = connect_when_up(port); fd >= 0 && idle.size() < 200; fd = connect_when_up(port, 0ms)) idle.push_back(fd);
    const int status = p.wait(60s);
    for (int fd : idle) close(fd);
    ASSERT_NE(status, -1) << read_text(dir / "output.txt");
    Outcome o;
    o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    o.output = read_text(dir / "output.txt");
    expect_one_error_line(o, 1, "ran out of file descriptors (128, ulimit -n)", /*training_began=*/true);
  }
}

TEST_F(Faults, APeerThatNeverArrivesTimesOut) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 64, 32);
  const std::vector<std::string> args = {"--backend", "gloo", "--data-dir", dir / "data", "--path", dir / "out",
                                         "--timeout", "3"};
  // Started as torchrun would start rank 0 of 2; rank 1 never comes.
  const Outcome o =
      run(args, dir, 60s, {"RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=0", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29731"});
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("rank 0: rank 1 of 2 never arrived within 3 s"), std::string::npos)
      << o.output;
  EXPECT_LT(o.seconds, 3 + 10);
  // And rank 1 of 2, whose rank 0 never comes.
  const Outcome client =
      run(args, dir, 60s, {"RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=1", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29732"});
  EXPECT_EQ(client.exit_code, 1) << client.output;
  EXPECT_NE(client.output.find("could not reach the rendezvous store at 127.0.0.1:29732 within 3 s"),
            std::string::npos)
      << client.output;
  EXPECT_LT(client.seconds, 3 + 10);
}

}  // namespace
}  // namespace mnist_ddp
