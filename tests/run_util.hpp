// Helpers for the tests that run the mnist_ddp binary whole: a small job of
// two workers, its exit code, and what an exact resume reproduces.
#pragma once

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "app/train/checkpoint.hpp"
#include "test_util.hpp"

namespace mnist_ddp::test {

// The exit code a wait status stands for (128 + the signal); -1 for none.
inline int exit_code(int status) {
  return status == -1 ? -1 : WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Runs the binary with `args` (and `env` besides this process's) to its
// end (at most `limit`), its output into `output`.
inline int run(const std::vector<std::string>& args, const std::string& output,
               std::chrono::seconds limit = std::chrono::seconds(300), const std::vector<std::string>& env = {}) {
  Process p(args, output, env);
  return exit_code(p.wait(limit));
}

// 1024 training images on 2 workers: 16 steps an epoch.
inline std::vector<std::string> job(const std::string& data, const std::string& path, const std::string& compression,
                                    std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--backend", "gloo", "--nproc", "2", "--data-dir", data, "--path", path,
                                   "--compression", compression, "--start-powersgd-iter", "10", "--log-interval", "5"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// The message of the last log line holding `piece`, "" when none does.
inline std::string last_line_with(const std::string& text, const std::string& piece) {
  std::string found;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);)
    if (line.find(piece) != std::string::npos) found = line.substr(line.find("| ") + 2);
  return found;
}

// What an exact resume reproduces: the checkpoint's model, optimizer, RNG
// and hook state, bit for bit, and the last test pass.
inline void expect_same_end(const std::string& run, const std::string& straight) {
  const Checkpoint got = load_checkpoint(run + "/checkpoint"), expected = load_checkpoint(straight + "/checkpoint");
  EXPECT_EQ(got.step, expected.step);
  EXPECT_EQ(max_abs_diff(got.model, expected.model), 0);
  EXPECT_EQ(max_abs_diff(got.training, expected.training), 0);
  const std::string last_test = last_line_with(read_text(straight + "/mnist_train.log"), "Test Epoch: ");
  ASSERT_FALSE(last_test.empty());
  EXPECT_EQ(last_line_with(read_text(run + "/mnist_train.log"), "Test Epoch: "), last_test);
}

// torchrun gives each of several workers on a node one thread, and one
// worker all the cores; our launcher gives each its share. A run compared
// bit for bit with a torchrun job gets the same count as its workers: a
// rank's sums are split, and rounded, by its thread count.
inline const std::string kOneThread = "OMP_NUM_THREADS=1";

// A Python with torch: Debian's python3-torch runs under /usr/bin/python3.
inline std::string python_with_torch() {
  for (const std::string python : {"/usr/bin/python3", "python3"})
    if (std::system((python + " -c 'import torch' >/dev/null 2>&1").c_str()) == 0) return python;
  return "";
}

// Tests that run whole jobs on this machine: a small data set, a port for
// the store, and every process they start reaped by the end (the test is
// their subreaper, so none escapes by losing its parent).
class JobsOnThisMachine : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
    write_synthetic_mnist(dir_ / "data", 1024, 128);
    port_ = std::to_string(free_port());
  }
  void TearDown() override {
    EXPECT_TRUE(no_children_left(std::chrono::seconds(15))) << "a process was left running";
  }
  TempDir dir_;
  std::string port_;
};

// A Python whose torch has torchrun (torch.distributed.run), "" when none has.
inline std::string python_with_torchrun() {
  const std::string python = python_with_torch();
  if (python.empty() || std::system((python + " -c 'import torch.distributed.run' >/dev/null 2>&1").c_str()) != 0)
    return "";
  return python;
}

// For a job() run of 1 epoch checkpointing every 4 steps: a step of the 16
// after the first checkpoint, before or after PowerSGD's start at 10, not
// one a checkpoint is written at; drawn from the test's seed.
inline int draw_kill_step() {
  std::mt19937 random(test_seed());
  int step;
  do step = 5 + static_cast<int>(random() % 11);
  while (step % 4 == 0);
  return step;
}

// Two hosts for real, on this machine: two network namespaces joined by a
// veth pair, host 0 at 10.231.7.1 and host 1 at 10.231.7.2, removed at
// the end. Needs root and iproute2; why_not() says what was missing.
class TwoHosts {
 public:
  TwoHosts() {
    static int made_here = 0;
    const std::string id = std::to_string(getpid() % 100000) + "x" + std::to_string(made_here++);
    names_ = {"mnddp_a" + id, "mnddp_b" + id};
    if (geteuid() != 0) {
      why_not_ = "network namespaces need root";
      return;
    }
    if (!sh("command -v ip")) {
      why_not_ = "no 'ip' command (iproute2)";
      return;
    }
    const std::string a = names_[0], b = names_[1], va = "va" + id, vb = "vb" + id;
    devices_ = {va, vb};
    created_ = sh("ip netns add " + a) && sh("ip netns add " + b);
    if (!(created_ && sh("ip link add " + va + " netns " + a + " type veth peer name " + vb + " netns " + b) &&
          sh("ip -n " + a + " addr add " + address(0) + "/24 dev " + va) &&
          sh("ip -n " + b + " addr add " + address(1) + "/24 dev " + vb) && sh("ip -n " + a + " link set " + va + " up") &&
          sh("ip -n " + b + " link set " + vb + " up") && sh("ip -n " + a + " link set lo up") &&
          sh("ip -n " + b + " link set lo up")))
      why_not_ = "this machine does not allow creating network namespaces and a veth pair";
  }
  ~TwoHosts() {
    if (created_)
      for (const auto& name : names_) sh("ip netns del " + name);
  }
  // "" when the hosts are up.
  const std::string& why_not() const { return why_not_; }
  std::string address(int host) const { return host == 0 ? "10.231.7.1" : "10.231.7.2"; }
  // Shapes both ends of the link to `rate` ("200mbit") with a token bucket,
  // as scripts/bench_network.sh does; false where tc cannot.
  bool shape(const std::string& rate) const {
    for (int host : {0, 1})
      if (!sh("tc -n " + names_[host] + " qdisc add dev " + devices_[host] + " root tbf rate " + rate +
              " burst 256kb latency 200ms"))
        return false;
    return true;
  }
  // Takes the link between the hosts down (a partition), or up again.
  bool set_link(bool up) const {
    return sh("ip -n " + names_[0] + " link set " + devices_[0] + (up ? " up" : " down"));
  }
  // `command` run inside host `host`.
  std::vector<std::string> in(int host, std::vector<std::string> command) const {
    command.insert(command.begin(), {"ip", "netns", "exec", names_[host]});
    return command;
  }

 private:
  static bool sh(const std::string& command) { return std::system((command + " >/dev/null 2>&1").c_str()) == 0; }
  std::vector<std::string> names_, devices_;
  bool created_ = false;
  std::string why_not_;
};

}  // namespace mnist_ddp::test
