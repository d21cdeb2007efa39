// A hostile round: a process that reaches the store tries to steer the job,
// and cases that used to end wrong (a restart that succeeded, a preemption
// that reached only the workers, a finished run resumed, another thread
// count, a node count that differs, a partition). Each ends in the one
// line it should, with nothing left running.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <sstream>
#include <thread>

#include "app/base/files.hpp"
#include "comm/store.hpp"
#include "run_util.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::eventually;
using test::exit_code;
using test::Process;
using test::read_text;

class Hostile : public test::JobsOnThisMachine {
 protected:
  std::vector<std::string> job(const std::string& path, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--backend", "gloo", "--nproc", "2", "--data-dir", dir_ / "data", "--path", path,
                                     "--compression", "none", "--log-interval", "1000", "--timeout", "15"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }
  // Node `rank` of a job of two nodes with a worker each, in dir_/node<rank>.
  std::vector<std::string> node_of_two(int rank, std::vector<std::string> extra) {
    std::vector<std::string> args = {"--nnodes", "2", "--node-rank", std::to_string(rank), "--nproc", "1",
                                     "--master-port", port_};
    args.insert(args.end(), extra.begin(), extra.end());
    return job(dir_ / ("node" + std::to_string(rank)), args);
  }
};

// A client of the store at `port` that writes what it likes: a neighbour.
// Opened as the job opens its own (a LibTorch without libuv refuses a
// client that asks for it).
c10::intrusive_ptr<c10d::TCPStore> neighbour(int port) {
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::string why;
  EXPECT_TRUE(eventually(
      [&] {
        try {
          store = open_store("127.0.0.1", port, false, 2s);
          return true;
        } catch (const std::exception& e) {
          why = e.what();
          return false;
        }
      },
      60s))
      << why;
  return store;
}

// Every file under `dir` (one level of folders) by its path there, with its bytes.
std::map<std::string, std::string> every_file(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const std::string& name : files::list_directory(dir)) {
    const std::string path = dir + "/" + name;
    if (files::is_directory(path)) {
      for (const std::string& inner : files::list_directory(path)) out[name + "/" + inner] = read_text(path + "/" + inner);
    } else {
      out[name] = read_text(path);
    }
  }
  return out;
}

int error_lines(const std::string& output) {
  int n = 0;
  for (size_t at = output.find("mnist_ddp: error"); at != std::string::npos; at = output.find("mnist_ddp: error", at + 1))
    ++n;
  return n;
}

// The first line of `output` that holds "mnist_ddp: error", from there on; "" when none does.
std::string error_line_of(const std::string& output) {
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);)
    if (const size_t at = line.find("mnist_ddp: error"); at != std::string::npos) return line.substr(at);
  return "";
}

// One node: the keys a neighbour knows from our source (a node's claim,
// its worker count, the shared-memory segment, a restart's cause) are not
// the job's, whose keys live under a prefix the launcher drew. The launcher
// holds everything until the neighbour has written (faults.hpp), so every
// read comes after. A worker killed at step 12 restarts as ever, and the
// job ends 0 without an error line, saying it took one restart.
TEST_F(Hostile, ANeighbourOnTheStoreCannotSteerAJobOnOneNode) {
  const std::string out = dir_ / "out", written = dir_ / "neighbour-wrote";
  Process p(job(out, {"--master-port", port_, "--epochs", "1", "--max-steps", "30", "--checkpoint-steps", "5",
                      "--max-restarts", "1"}),
            dir_ / "out.txt", {"MNIST_DDP_KILL_AFTER_STEP=0:1:12", "MNIST_DDP_HOLD_WORKERS_UNTIL=" + written});
  auto store = neighbour(std::stoi(port_));
  ASSERT_TRUE(store);
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"round/1/nodes/0/claim", "mnist_ddp launcher pid 1 on vm"},
           {"round/0/nodes/0/size", "1"},
           {"round/1/nodes/0/size", "1"},
           {"round/0/main/shared_memory", "/mnist_ddp.evil"},
           {"round/1/main/shared_memory", "/mnist_ddp.evil"},
           {"restart/1/cause", "node 0: a neighbour wrote this"}})
    store->set(key, bytes_of(value));
  EXPECT_FALSE(files::exists(out + "/mnist_train.log")) << "a worker started before the neighbour wrote";
  test::write_file(written, "", false);
  const int code = exit_code(p.wait(180s));
  const std::string output = read_text(dir_ / "out.txt");
  EXPECT_EQ(code, 0) << output;
  EXPECT_EQ(error_lines(output), 0) << output;
  EXPECT_NE(output.find("mnist_ddp: the job finished after 1 restart(s)"), std::string::npos) << output;
  // The restart names its own cause (the worker killed at step 12), never the neighbour's.
  EXPECT_EQ(output.find("a neighbour wrote this"), std::string::npos) << output;
  EXPECT_NE(output.find("was killed by signal 9"), std::string::npos) << output;
  const std::string log = read_text(out + "/mnist_train.log");
  EXPECT_NE(log.find("Replicas: all 2 ranks hold identical parameters"), std::string::npos) << log;
  EXPECT_EQ(log.find("over 1 rank(s)"), std::string::npos) << log;
}

// Two nodes that share a secret: a neighbour's restart cause is not a
// node's word. Then node 1's launcher is preempted: every rank stops after
// one step, and node 0 names node 1, without an error line on either.
TEST_F(Hostile, NodesSharingASecretTakeNoNeighboursWordAndAPreemptedNodeIsNamed) {
  auto node = [&](int rank) { return node_of_two(rank, {"--epochs", "30", "--checkpoint-steps", "3"}); };
  const std::vector<std::string> env = {"MNIST_DDP_SECRET=our job's own"};
  Process node1(node(1), dir_ / "node1.txt", env);
  Process node0(node(0), dir_ / "node0.txt", env);
  ASSERT_TRUE(eventually([&] { return read_text(dir_ / "node0/mnist_train.log").find("Train Epoch") != std::string::npos; }, 60s))
      << read_text(dir_ / "node0.txt");
  auto store = neighbour(std::stoi(port_));
  ASSERT_TRUE(store);
  store->set("restart/1/cause", bytes_of("node 1: a neighbour wrote this"));
  store->set("preempted/0", bytes_of("node 0: SIGUSR1"));
  store->set("secret/0/differs", bytes_of("a neighbour says the secrets differ"));  // at the root: no node's line
  // The launchers look for a cause every 250 ms: the job goes on through
  // two more checkpoints, which takes longer, and no node moves.
  const auto at = [&] {
    const auto c = read_manifest(dir_ / "node0/checkpoint");
    return c ? c->step : 0;
  };
  const int64_t written_at = at();
  ASSERT_TRUE(eventually([&] { return at() >= written_at + 6; }, 60s)) << read_text(dir_ / "node0.txt");
  EXPECT_EQ(waitpid(node0.pid(), nullptr, WNOHANG), 0) << read_text(dir_ / "node0.txt");
  EXPECT_EQ(waitpid(node1.pid(), nullptr, WNOHANG), 0) << read_text(dir_ / "node1.txt");
  test::send_signal(node1.pid(), SIGTERM);
  const int code0 = exit_code(node0.wait(60s)), code1 = exit_code(node1.wait(60s));
  const std::string out0 = read_text(dir_ / "node0.txt"), out1 = read_text(dir_ / "node1.txt");
  EXPECT_EQ(code0, 143) << out0;
  EXPECT_EQ(code1, 143) << out1;
  EXPECT_NE(out0.find("mnist_ddp: node 1 was preempted (SIGTERM to its launcher)"), std::string::npos) << out0;
  EXPECT_EQ(error_lines(out0) + error_lines(out1), 0) << out0 << out1;
  EXPECT_EQ(out0.find("neighbour"), std::string::npos) << out0;
  for (const std::string& out : {out0, out1}) EXPECT_EQ(out.find("SIGUSR1"), std::string::npos) << out;
  EXPECT_EQ(test::read_summary(dir_ / "node0").at("preempted").get<std::string>(), "SIGTERM");
  EXPECT_EQ(out0.find("MNIST_DDP_SECRET"), std::string::npos) << "a warning though the nodes share a secret:\n" << out0;
}

// SIGTERM to the workers alone, as a scheduler sends it: a preemption,
// never restarted as a failure, exit 143 with the preemption line.
TEST_F(Hostile, SigtermToTheWorkersAloneIsAPreemptionNotAFailure) {
  const std::string out = dir_ / "out";
  Process p(job(out, {"--epochs", "1", "--max-restarts", "1", "--checkpoint-steps", "3"}), dir_ / "out.txt",
            {"MNIST_DDP_PAUSE_AFTER_STEP=0:0:6,0:1:6"});
  ASSERT_TRUE(eventually([&] { return read_text(out + "/mnist_train.log").find("Paused after step 6") != std::string::npos; }, 60s))
      << read_text(dir_ / "out.txt");
  std::vector<pid_t> workers;
  ASSERT_TRUE(eventually([&] { return (workers = test::children_of(p.pid())).size() == 2; }, 10s));
  for (pid_t w : workers) test::send_signal(w, SIGTERM);
  const int code = exit_code(p.wait(90s));
  const std::string output = read_text(dir_ / "out.txt");
  EXPECT_EQ(code, 143) << output;
  EXPECT_NE(output.find("mnist_ddp: the workers were preempted (SIGTERM): every rank stopped after the step they "
                        "agreed on, checkpointed in"),
            std::string::npos)
      << output;
  EXPECT_EQ(error_lines(output), 0) << output;
  EXPECT_EQ(output.find("restart 1 of"), std::string::npos) << output;
}

// A run to its end, resumed: nothing to train, every file as it was. Then
// resumed with another thread count: said in one line, as the run cannot
// end bit-identical to one never stopped.
TEST_F(Hostile, AFinishedRunResumedChangesNoFileAndAnotherThreadCountIsNamed) {
  const std::string out = dir_ / "out";
  const auto args = job(out, {"--epochs", "1", "--max-steps", "8", "--checkpoint-steps", "4"});
  ASSERT_EQ(exit_code(Process(args, dir_ / "a.txt", {"OMP_NUM_THREADS=2"}).wait(120s)), 0) << read_text(dir_ / "a.txt");
  const std::map<std::string, std::string> before = every_file(out);
  ASSERT_NE(before.at("summary.json").find("best_test_top1"), std::string::npos);
  ASSERT_GE(before.size(), 8u);  // the log, metrics, summary, model; a checkpoint's manifests and files

  auto resumed = args;
  resumed.insert(resumed.end(), {"--resume", "auto"});
  ASSERT_EQ(exit_code(Process(resumed, dir_ / "b.txt", {"OMP_NUM_THREADS=2"}).wait(120s)), 0) << read_text(dir_ / "b.txt");
  const std::string b = read_text(dir_ / "b.txt");
  EXPECT_NE(b.find("Nothing to train: the checkpoint in " + out + "/checkpoint has finished its --max-steps 8 steps"),
            std::string::npos)
      << b;
  EXPECT_EQ(b.find("bit-identical"), std::string::npos) << b;
  // Every file as it was: the log only gains this run's lines at its end,
  // and the folder's lock names its holder.
  const std::map<std::string, std::string> after = every_file(out);
  EXPECT_EQ(after.size(), before.size()) << "files came or went";
  for (const auto& [name, bytes] : before) {
    const auto it = after.find(name);
    if (name == ".lock") continue;
    if (name == "mnist_train.log")
      EXPECT_TRUE(it != after.end() && it->second.size() > bytes.size() && it->second.compare(0, bytes.size(), bytes) == 0)
          << "the log was not appended to";
    else
      EXPECT_TRUE(it != after.end() && it->second == bytes) << name << " changed";
  }

  resumed.insert(resumed.end(), {"--max-steps", "12"});
  ASSERT_EQ(exit_code(Process(resumed, dir_ / "c.txt", {"OMP_NUM_THREADS=1"}).wait(120s)), 0) << read_text(dir_ / "c.txt");
  const std::string c = read_text(dir_ / "c.txt");
  EXPECT_NE(c.find("The checkpoint was written with 2 intra-op thread(s) on rank 0 and this run has 1 (2 rank(s) differ)"),
            std::string::npos)
      << c;
  EXPECT_NE(c.find("will not end bit-identical"), std::string::npos) << c;
}

// Issue 43: a checkpoint folder whose manifests are gone. The newest pair
// of files that verifies is resumed from, a line says so, and no file is
// deleted; the resume names the settings it changes (--amp, --epochs). A
// run that then starts afresh keeps the earlier best model beside its own.
TEST_F(Hostile, AFolderThatLostItsManifestsIsResumedAndNoFileIsLost) {
  const std::string out = dir_ / "out", ckpt = out + "/checkpoint";
  const auto args = job(out, {"--epochs", "1", "--checkpoint-steps", "4"});
  ASSERT_EQ(exit_code(Process(args, dir_ / "a.txt").wait(120s)), 0) << read_text(dir_ / "a.txt");
  files::remove_file(ckpt + "/manifest");
  files::remove_file(ckpt + "/manifest.previous");
  const std::vector<std::string> left = files::list_directory(ckpt);
  ASSERT_EQ(left.size(), 4u);

  auto resumed = job(out, {"--epochs", "2", "--max-steps", "18", "--checkpoint-steps", "4", "--amp", "bf16",
                           "--resume", "auto"});
  ASSERT_EQ(exit_code(Process(resumed, dir_ / "b.txt").wait(120s)), 0) << read_text(dir_ / "b.txt");
  const std::string b = read_text(dir_ / "b.txt");
  EXPECT_NE(b.find(ckpt + " has no manifest: resuming from model-"), std::string::npos) << b;
  EXPECT_NE(b.find("the newest pair of its files whose contents verify (step 16)"), std::string::npos) << b;
  EXPECT_NE(b.find("Resuming from " + ckpt + ": epoch 1, batch 0, step 16"), std::string::npos) << b;
  EXPECT_NE(b.find("The checkpoint was written with --amp none (this run: bf16), --epochs 1 (this run: 2): it goes on "
                   "from the checkpoint, but will not end bit-identical to a run never stopped"),
            std::string::npos)
      << b;
  EXPECT_EQ(error_lines(b), 0) << b;
  for (const std::string& name : left) EXPECT_TRUE(files::exists(ckpt + "/" + name)) << name << " was deleted";
  EXPECT_EQ(load_checkpoint(ckpt).step, 18);

  const std::string best = read_text(out + "/mnist_model.pt");
  ASSERT_FALSE(best.empty());
  ASSERT_EQ(exit_code(Process(job(out, {"--epochs", "1", "--max-steps", "2"}), dir_ / "c.txt").wait(120s)), 0)
      << read_text(dir_ / "c.txt");
  EXPECT_EQ(read_text(out + "/mnist_model.kept-1.pt"), best);
  EXPECT_NE(read_text(dir_ / "c.txt").find(out + "/mnist_model.pt holds an earlier run's best model, and this run "
                                           "starts afresh: it is kept as " + out + "/mnist_model.kept-1.pt"),
            std::string::npos)
      << read_text(dir_ / "c.txt");
}

// Issue 43: the secret file is read only where several nodes need it, and
// what is wrong with it is one line and exit 2; one that others can read
// is a warning; nodes whose secrets differ are told so within --timeout,
// on both nodes, by a salted digest that tells a neighbour nothing.
TEST_F(Hostile, ASecretThatCannotBeReadOrDiffersIsOneLine) {
  const std::string missing = "MNIST_DDP_SECRET_FILE=" + (dir_ / "no-such-file");
  EXPECT_EQ(exit_code(Process({"--help"}, dir_ / "help.txt", {missing}).wait(20s)), 0) << read_text(dir_ / "help.txt");
  files::make_directories(dir_ / "a-dir");
  test::write_file(dir_ / "empty", "", false);
  test::write_file(dir_ / "shared", "ours\n", false);
  chmod((dir_ / "shared").c_str(), 0644);
  auto node = [&](int rank, const std::string& timeout = "10") {
    return node_of_two(rank, {"--epochs", "1", "--timeout", timeout});
  };
  for (const auto& [file, why] : std::vector<std::pair<std::string, std::string>>{
           {dir_ / "no-such-file", ": No such file or directory"}, {dir_ / "a-dir", " is a directory, not a file"},
           {dir_ / "empty", " is empty"}}) {
    // Node 0 alone: its store tells nobody for --timeout 1, then it ends.
    const int code = exit_code(Process(node(0, "1"), dir_ / "bad.txt", {"MNIST_DDP_SECRET_FILE=" + file}).wait(30s));
    const std::string text = read_text(dir_ / "bad.txt");
    EXPECT_EQ(code, 2) << text;
    EXPECT_EQ(error_lines(text), 1) << text;
    EXPECT_NE(text.find("mnist_ddp: error: MNIST_DDP_SECRET_FILE=" + file + why), std::string::npos) << text;
    EXPECT_EQ(text.find("terminate called"), std::string::npos) << text;
  }
  // Readable by others: one warning, then the run goes on (here to a store that is not there).
  Process alone(node(1, "1"), dir_ / "alone.txt", {"MNIST_DDP_SECRET_FILE=" + (dir_ / "shared")});
  EXPECT_NE(exit_code(alone.wait(30s)), 0);
  EXPECT_NE(read_text(dir_ / "alone.txt").find("mnist_ddp: warning: MNIST_DDP_SECRET_FILE=" + (dir_ / "shared") +
                                               " can be read by other users (mode 0644)"),
            std::string::npos)
      << read_text(dir_ / "alone.txt");
  // The store refused: our lines alone, none of LibTorch's log lines.
  std::istringstream lines(read_text(dir_ / "alone.txt"));
  for (std::string line; std::getline(lines, line);)
    EXPECT_TRUE(line.rfind("mnist_ddp: ", 0) == 0 || line.rfind("The folder ", 0) == 0) << line;

  const auto start = std::chrono::steady_clock::now();
  Process node0(node(0), dir_ / "node0.txt", {"MNIST_DDP_SECRET=the job's"});
  Process node1(node(1), dir_ / "node1.txt", {"MNIST_DDP_SECRET=another job's"});
  const int code0 = exit_code(node0.wait(60s)), code1 = exit_code(node1.wait(60s));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "not named within --timeout";
  for (const auto& [code, out] : {std::pair{code0, read_text(dir_ / "node0.txt")}, std::pair{code1, read_text(dir_ / "node1.txt")}}) {
    EXPECT_EQ(code, 2) << out;
    EXPECT_NE(out.find("mnist_ddp: error: node 1's secret differs from node 0's"), std::string::npos) << out;
    EXPECT_EQ(error_lines(out), 1) << out;
    EXPECT_EQ(out.find("the job's"), std::string::npos) << out;
  }
}

// Issue 48: a secret file that cannot be used, in the environment every
// rank gets (torchrun passes one to all), or on one node only (a path that
// node 0's machine has and node 1's lacks): every rank and every node ends
// at once in one line, none waiting out --timeout for a store that is gone
// or a node that left. Issue 55: so do ranks of another launcher whose
// secrets differ, or whose rank 0 alone cannot use its file.
TEST_F(Hostile, ASecretFileThatCannotBeUsedEndsEveryRankAndNodeAtOnce) {
  const std::string missing = "MNIST_DDP_SECRET_FILE=" + (dir_ / "no-such-file");
  const std::string refusal = "MNIST_DDP_SECRET_FILE=" + (dir_ / "no-such-file") + ": No such file or directory";
  const std::string cannot = " cannot use its MNIST_DDP_SECRET_FILE (missing, empty, unreadable or a directory there)";
  const auto at_once = 10s;  // --timeout 30; about 1 s each here
  test::write_file(dir_ / "secret", "ours\n", false);
  chmod((dir_ / "secret").c_str(), 0600);
  const std::string good = "MNIST_DDP_SECRET_FILE=" + (dir_ / "secret");
  // A rank as torchrun, srun or a pod starts it: `r` of `world`.
  auto rank = [&](int r, int world, const std::string& secret) {
    return std::make_unique<Process>(
        std::vector<std::string>{"--backend", "gloo", "--data-dir", dir_ / "data", "--path", dir_ / "out", "--epochs",
                                 "1", "--timeout", "30"},
        dir_ / ("rank" + std::to_string(r) + ".txt"),
        std::vector<std::string>{secret, "RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r),
                                 "WORLD_SIZE=" + std::to_string(world), "LOCAL_WORLD_SIZE=" + std::to_string(world),
                                 "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port_});
  };
  auto store_up = [&] {
    return eventually(
        [&] {
          const int fd = test::connect_to_port(std::stoi(port_));
          if (fd >= 0) close(fd);
          return fd >= 0;
        },
        30s);
  };
  // `process` ended with exit 2 within at_once of `start`, its one error line `line`.
  auto ended_saying = [&](Process& process, const std::string& output, auto start, const std::string& line) {
    const int code = exit_code(process.wait(60s));
    const std::string out = read_text(output);
    EXPECT_LT(std::chrono::steady_clock::now() - start, at_once) << out;
    EXPECT_EQ(code, 2) << out;
    EXPECT_EQ(error_lines(out), 1) << out;
    EXPECT_NE(out.find("mnist_ddp: error: " + line), std::string::npos) << out;
    EXPECT_EQ(out.find("never"), std::string::npos) << out;  // "never joined", "never arrived"
    EXPECT_EQ(out.find("could not reach"), std::string::npos) << out;
  };

  // Both ranks' files missing, as torchrun passes one to all; rank 1 once
  // rank 0 has ended, so it finds no store at all.
  for (const int r : {0, 1}) {
    const auto start = std::chrono::steady_clock::now();
    auto alone = rank(r, 2, missing);
    ended_saying(*alone, dir_ / ("rank" + std::to_string(r) + ".txt"), start,
                 "rank " + std::to_string(r) + ": " + refusal);
  }
  // Three ranks, rank 1's file missing: it tells the store rank 0 hosts,
  // and ranks 0 and 2 end too, naming it.
  {
    const auto start = std::chrono::steady_clock::now();
    auto rank0 = rank(0, 3, good);
    ASSERT_TRUE(store_up());
    auto rank1 = rank(1, 3, missing), rank2 = rank(2, 3, good);
    ended_saying(*rank1, dir_ / "rank1.txt", start, "rank 1: " + refusal);
    for (const auto& [r, process] : {std::pair{0, rank0.get()}, std::pair{2, rank2.get()}})
      ended_saying(*process, dir_ / ("rank" + std::to_string(r) + ".txt"), start,
                   "rank " + std::to_string(r) + ": rank 1" + cannot + ": give every rank the same file");
  }
  // Rank 0's file alone missing: its store says so, and rank 1 ends too.
  {
    const auto start = std::chrono::steady_clock::now();
    auto rank0 = rank(0, 2, missing), rank1 = rank(1, 2, good);
    ended_saying(*rank1, dir_ / "rank1.txt", start, "rank 1: rank 0" + cannot + ": give every rank the same file");
    ended_saying(*rank0, dir_ / "rank0.txt", start, "rank 0: " + refusal);
  }
  // Secrets that differ, or rank 0's alone: both ranks name rank 1's.
  for (const auto& [theirs, how] : std::vector<std::pair<std::string, std::string>>{
           {"MNIST_DDP_SECRET=another job's", "rank 1's secret differs from rank 0's"},
           {"MNIST_DDP_SECRET=", "rank 1 has no secret and rank 0 has one"}}) {
    const auto start = std::chrono::steady_clock::now();
    auto rank0 = rank(0, 2, "MNIST_DDP_SECRET=the job's"), rank1 = rank(1, 2, theirs);
    for (const auto& [r, process] : {std::pair{0, rank0.get()}, std::pair{1, rank1.get()}}) {
      ended_saying(*process, dir_ / ("rank" + std::to_string(r) + ".txt"), start,
                   "rank " + std::to_string(r) + ": " + how + ": give every rank the same MNIST_DDP_SECRET or "
                   "MNIST_DDP_SECRET_FILE");
      EXPECT_EQ(read_text(dir_ / ("rank" + std::to_string(r) + ".txt")).find("the job's"), std::string::npos);
    }
  }
  // Two nodes, the file missing on node 1's machine: node 1 refuses, and
  // node 0, whose worker waits for node 1's, is told so and ends too.
  {
    const auto start = std::chrono::steady_clock::now();
    Process node0(node_of_two(0, {"--epochs", "1", "--timeout", "30"}), dir_ / "node0.txt", {good});
    ASSERT_TRUE(store_up()) << read_text(dir_ / "node0.txt");
    Process node1(node_of_two(1, {"--epochs", "1", "--timeout", "30"}), dir_ / "node1.txt", {missing});
    ended_saying(node1, dir_ / "node1.txt", start, refusal);
    ended_saying(node0, dir_ / "node0.txt", start,
                 "node 1" + cannot + ": give every node the same MNIST_DDP_SECRET or MNIST_DDP_SECRET_FILE");
  }
  // Missing on node 0's machine: node 0 refuses, and its store stays up to
  // tell node 1, which ends too, then node 0.
  {
    const auto start = std::chrono::steady_clock::now();
    Process node0(node_of_two(0, {"--epochs", "1", "--timeout", "30"}), dir_ / "node0.txt", {missing});
    Process node1(node_of_two(1, {"--epochs", "1", "--timeout", "30"}), dir_ / "node1.txt", {good});
    ended_saying(node1, dir_ / "node1.txt", start, "node 0" + cannot + ": give every node the same file");
    ended_saying(node0, dir_ / "node0.txt", start, refusal);
  }
}

// Issue 43: a neighbour opens the store's port and sends one byte while two
// nodes meet. The classic store stalls; each node ends in one line and a
// non-zero exit, never an abort. libuv's loop serves the nodes meanwhile,
// and the job trains to its end.
TEST_F(Hostile, AOneByteNeighbourDuringTheRendezvousOfTwoNodesEndsEachInOneLine) {
  auto node = [&](int rank) { return node_of_two(rank, {"--epochs", "1", "--timeout", "4"}); };
  const std::vector<std::string> env = {"MNIST_DDP_SECRET=our job's own"};
  Process node0(node(0), dir_ / "node0.txt", env);
  int neighbour = -1;
  ASSERT_TRUE(eventually([&] { return (neighbour = test::connect_to_port(std::stoi(port_))) >= 0; }, 30s));
  ASSERT_EQ(write(neighbour, "\x00", 1), 1);
  Process node1(node(1), dir_ / "node1.txt", env);
  const int code0 = exit_code(node0.wait(60s)), code1 = exit_code(node1.wait(60s));
  close(neighbour);
  if (store_kind() == "libuv") {
    for (const auto& [code, out] : {std::pair{code0, read_text(dir_ / "node0.txt")}, std::pair{code1, read_text(dir_ / "node1.txt")}}) {
      EXPECT_EQ(code, 0) << out;
      EXPECT_EQ(error_lines(out), 0) << out;
    }
    return;
  }
  for (const auto& [code, out] : {std::pair{code0, read_text(dir_ / "node0.txt")}, std::pair{code1, read_text(dir_ / "node1.txt")}}) {
    EXPECT_NE(code, 0) << out;
    EXPECT_NE(code, 134) << out;
    EXPECT_EQ(out.find("terminate called"), std::string::npos) << out;
    EXPECT_EQ(error_lines(out), 1) << out;
  }
  // What each line says: node 0, whose store stalls, that it did not answer
  // within --timeout; node 1 that, or that it lost node 0's store.
  const std::string line0 = error_line_of(read_text(dir_ / "node0.txt")), line1 = error_line_of(read_text(dir_ / "node1.txt"));
  EXPECT_NE(line0.find("store did not answer within 4 s (--timeout)"), std::string::npos) << line0;
  const std::string store = "store at 127.0.0.1:" + port_;
  EXPECT_TRUE(line1.find("store did not answer within 4 s (--timeout)") != std::string::npos ||
              line1.find("lost the rendezvous " + store + " (its host stopped, or dropped the connection)") !=
                  std::string::npos ||
              line1.find("could not reach node 0's " + store) != std::string::npos ||
              line1.find("lost node 0's " + store + " (its launcher stopped, or dropped the connection)") !=
                  std::string::npos)
      << line1;
}

// Two launchers that disagree on --nnodes: the disagreement, named at once,
// not a node that "never joined"; the other node (whose store went with
// node 0) ends too.
TEST_F(Hostile, NodesStartedWithOtherNodeCountsAreNamed) {
  auto node = [&](int rank, int nnodes) {
    return job(dir_ / ("node" + std::to_string(rank)),
               {"--nnodes", std::to_string(nnodes), "--node-rank", std::to_string(rank), "--nproc", "1",
                "--master-port", port_, "--epochs", "1"});
  };
  Process node1(node(1, 3), dir_ / "node1.txt");
  Process node0(node(0, 2), dir_ / "node0.txt");
  const int code0 = exit_code(node0.wait(60s)), code1 = exit_code(node1.wait(60s));
  const std::string out0 = read_text(dir_ / "node0.txt"), out1 = read_text(dir_ / "node1.txt");
  EXPECT_EQ(code0, 2) << out0;
  EXPECT_NE(code1, 0) << out1;
  EXPECT_NE(out0.find("the nodes disagree on the job's size: node 0 was started with --nnodes 2, node 1 with --nnodes 3"),
            std::string::npos)
      << out0;
  EXPECT_EQ(out1.find("never joined"), std::string::npos) << out1;
}

// The link between two nodes goes down for longer than --timeout: each
// names what it lost and the timeout that ran out.
TEST_F(Hostile, APartitionedNodeNamesWhatItLostAndTheTimeout) {
  const test::TwoHosts hosts;
  if (!hosts.why_not().empty()) GTEST_SKIP() << hosts.why_not();
  auto on = [&](int host) {
    auto args = job(dir_ / ("node" + std::to_string(host)),
                    {"--nnodes", "2", "--node-rank", std::to_string(host), "--nproc", "1", "--master-addr",
                     hosts.address(0), "--master-port", port_, "--epochs", "20", "--timeout", "4"});
    args.insert(args.begin(), MNIST_DDP_BINARY);
    return hosts.in(host, args);
  };
  Process node1(on(1), dir_ / "node1.txt", {}, /*command=*/true);
  Process node0(on(0), dir_ / "node0.txt", {}, /*command=*/true);
  ASSERT_TRUE(eventually([&] { return read_text(dir_ / "node0/mnist_train.log").find("Train Epoch: 0 [") != std::string::npos; }, 60s))
      << read_text(dir_ / "node0.txt");
  ASSERT_TRUE(hosts.set_link(false));
  const int code0 = exit_code(node0.wait(60s)), code1 = exit_code(node1.wait(60s));
  hosts.set_link(true);
  const std::string out0 = read_text(dir_ / "node0.txt"), out1 = read_text(dir_ / "node1.txt");
  EXPECT_EQ(code0, 1) << out0;
  EXPECT_EQ(code1, 1) << out1;
  EXPECT_NE(out0.find("lost rank 1 (node 1): no word within --timeout 4 s"), std::string::npos) << out0;
  EXPECT_NE(out1.find("lost node 0 (rank 0 and the store it hosts): no word within --timeout 4 s"), std::string::npos)
      << out1;
}

}  // namespace
}  // namespace mnist_ddp
