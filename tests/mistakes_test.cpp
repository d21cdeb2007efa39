// The mistakes DDP users make, each as a small program of two ranks under
// our launcher (Gloo, --timeout 10), written against the library's API
// alone: each must end within seconds (or its timeout plus 5 s where a
// rank never arrives), name its cause on every rank in the library's words
// (never a backend's text alone, never a signal), and leave no process
// behind. The program is this test binary itself, run as
// `mnist_ddp_tests --gtest_filter=MistakeProgram.Run` with the case in
// MNIST_DDP_TEST_MISTAKE.
#include <gtest/gtest.h>

#include <unistd.h>

#include <torch/torch.h>

#include <cstdlib>
#include <iostream>
#include <sstream>

#include "mnist_ddp/ddp.hpp"
#include "comm/group.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::step;

// ---- the program ----

// A SyncBatchNorm between two layers; `fail` makes the forward throw after
// the norm layer's statistics were exchanged.
struct SmallImpl : torch::nn::Module {
  explicit SmallImpl(int64_t hidden = 8) {
    a = register_module("a", torch::nn::Linear(4, hidden));
    norm = register_module("norm", torch::nn::Sequential(torch::nn::BatchNorm1d(hidden)));
    b = register_module("b", torch::nn::Linear(hidden, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = norm->forward(a(x));
    if (fail) throw std::runtime_error("a forward that fails on this rank");
    return b(torch::relu(h));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::nn::Sequential norm{nullptr};
  bool fail = false;
};
TORCH_MODULE(Small);

// One line on stderr in one write: the two ranks share the file.
void say(const ProcessGroup& group, const std::string& line) {
  test::write_line("mistake: rank " + std::to_string(group.rank()) + ": " + line);
}

// The model every case but three trains, its BatchNorm made synchronous.
Small small_model(int64_t hidden = 8) {
  Small model(hidden);
  convert_sync_batchnorm(model);
  return model;
}

// A generator and a discriminator, each with a SyncBatchNorm, each its own
// DistributedDataParallel: the generator the group's first (its lanes),
// the discriminator the second (a stream of its own).
torch::nn::Sequential gan_half(int64_t in, int64_t out) {
  torch::nn::Sequential half(torch::nn::Linear(in, 8), torch::nn::BatchNorm1d(8), torch::nn::ReLU(), torch::nn::Linear(8, out));
  convert_sync_batchnorm(half);
  return half;
}

struct Gan {
  explicit Gan(const ProcessGroup& group)
      : g(gan_half(4, 4)), d(gan_half(4, 1)), g_ddp(g, group), d_ddp(d, group), g_opt(g->parameters(), 0.1),
        d_opt(d->parameters(), 0.1) {}
  // The discriminator's step on real data, then the generator's through it.
  void step(int rank, int k) {
    torch::manual_seed(10 * rank + k);
    const auto z = torch::randn({8, 4}), real = torch::randn({8, 4});
    d_opt.zero_grad();
    d_ddp.forward(real).pow(2).mean().backward();
    d_opt.step();
    g_opt.zero_grad();
    d_ddp.forward(g_ddp.forward(z)).mean().backward();
    g_opt.step();
  }
  // A look at what the generator makes, left in train mode.
  void sample() {
    torch::NoGradGuard no_grad;
    g->forward(torch::randn({4, 4}));
  }
  torch::nn::Sequential g, d;
  DistributedDataParallel<torch::nn::Sequential> g_ddp, d_ddp;
  torch::optim::SGD g_opt, d_opt;
};

void run_case(const std::string& name) {
  auto group = init_process_group();
  const int rank = group.rank();
  torch::manual_seed(0);
  if (name == "models") {  // a hidden layer 512 wide on rank 1, 16 on rank 0
    Small model = small_model(rank == 1 ? 512 : 16);
    DistributedDataParallel<Small> ddp(model, group);
  } else if (name == "hooks") {  // fp16 on rank 0, the default on rank 1
    Small model = small_model();
    DistributedDataParallel<Small> ddp(model, group);
    if (rank == 0) ddp.register_comm_hook(hooks::fp16_compress());
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int k = 0; k < 3; ++k) step(ddp, opt, rank, k);
  } else if (name == "powersgd-one-rank") {
    Small model = small_model();
    DistributedDataParallel<Small> ddp(model, group);
    if (rank == 1) ddp.register_comm_hook(hooks::powersgd(hooks::PowerSgdOptions().start_powersgd_iter(2)));
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int k = 0; k < 3; ++k) step(ddp, opt, rank, k);
  } else if (name == "syncbn-one-rank") {  // rank 0 samples in train mode, as if for a checkpoint
    Small model = small_model();
    DistributedDataParallel<Small> ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int k = 0; k < 4; ++k) {
      step(ddp, opt, rank, k);
      if (k == 1 && rank == 0) {
        torch::NoGradGuard no_grad;
        model->forward(torch::randn({4, 4}));
      }
    }
  } else if (name == "uneven") {  // rank 1 runs one step fewer, then checks the replicas
    Small model = small_model();
    DistributedDataParallel<Small> ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int k = 0; k < (rank == 1 ? 2 : 3); ++k) step(ddp, opt, rank, k);
    ddp.check_replicas("after training");
  } else if (name == "returns-early") {  // rank 1 runs one step fewer and returns: its program ends well
    Small model = small_model();
    DistributedDataParallel<Small> ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int k = 0; k < (rank == 1 ? 2 : 3); ++k) step(ddp, opt, rank, k);
  } else if (name == "forward-at-end") {  // rank 0 samples in train mode at the end; rank 1 has returned
    Small model = small_model();
    DistributedDataParallel<Small> ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int k = 0; k < 2; ++k) step(ddp, opt, rank, k);
    if (rank == 0) {
      torch::NoGradGuard no_grad;
      model->forward(torch::randn({4, 4}));
    }
  } else if (name == "ddp-forward-one-rank") {  // rank 0 samples through the DDP in train mode, then a barrier
    Small model = small_model();
    DistributedDataParallel<Small> ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    step(ddp, opt, rank, 0);
    if (rank == 0) {
      torch::NoGradGuard no_grad;
      ddp.forward(torch::randn({4, 4}));
    }
    group.barrier();
  } else if (name == "uneven-joined") {  // the same, inside ddp.join(): it works
    Small model = small_model();
    DistributedDataParallel<Small> ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    ddp.join([&] {
      for (int k = 0; k < (rank == 1 ? 2 : 3); ++k) step(ddp, opt, rank, k);
    });
    ddp.check_replicas("after training");
    say(group, "trained and joined, replicas identical");
  } else if (name == "joined-one-rank") {  // the same, with join() on the short rank only
    Small model = small_model();
    DistributedDataParallel<Small> ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    auto loop = [&] {
      for (int k = 0; k < (rank == 1 ? 2 : 3); ++k) step(ddp, opt, rank, k);
    };
    if (rank == 1) ddp.join(loop);
    else loop();
    ddp.check_replicas("after training");
  } else if (name == "hook-after-backward") {  // rank 0 registers a hook after the first backward
    Small model = small_model();
    DistributedDataParallel<Small> ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    step(ddp, opt, rank, 0);
    if (rank == 0) ddp.register_comm_hook(hooks::fp16_compress());
    for (int k = 1; k < 3; ++k) step(ddp, opt, rank, k);
  } else if (name == "caught-forward") {  // rank 1's forward fails at step 1; it catches that and goes on
    Small model = small_model();
    DistributedDataParallel<Small> ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int k = 0; k < 4; ++k) {
      model->fail = rank == 1 && k == 1;
      try {
        step(ddp, opt, rank, k);
      } catch (const std::runtime_error& e) {
        if (std::string(e.what()).find("a forward that fails") == std::string::npos) throw;
      }
    }
  } else if (name == "bypass") {  // rank 0 calls model->forward in place of ddp.forward
    auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
    DistributedDataParallel ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int k = 0; k < 2; ++k) {
      opt.zero_grad();
      const auto x = torch::randn({8, 4});
      torch::mse_loss(rank == 0 && k == 1 ? model->forward(x) : ddp.forward(x), torch::zeros({8, 2})).backward();
      opt.step();
    }
    ddp.check_replicas("after the steps");
  } else if (name == "init-twice") {
    auto again = init_process_group();
    if (GroupAccess::share(again) != GroupAccess::share(group)) throw Error("a second init_process_group() gave another group");
    say(group, "the second call returned the first group");
    init_process_group(ProcessGroupOptions().backend("nccl"));
  } else if (name == "bfloat16") {  // each rank its own data: only averaging keeps the replicas equal
    auto model = std::make_shared<torch::nn::LinearImpl>(4, 3);
    model->to(torch::kBFloat16);
    DistributedDataParallel ddp(model, group);
    const torch::Tensor before = model->weight.detach().clone();
    torch::optim::SGD opt(model->parameters(), 0.1);
    torch::manual_seed(100 + rank);
    for (int k = 0; k < 3; ++k) {
      opt.zero_grad();
      ddp.forward(torch::randn({8, 4}).to(torch::kBFloat16)).pow(2).mean().backward();
      opt.step();
    }
    if (torch::equal(before, model->weight.detach())) throw Error("the bfloat16 parameters did not move");
    ddp.check_replicas("after training");
    say(group, "bfloat16 parameters trained, replicas identical");
  } else if (name == "gan") {  // rank 0 samples from the generator in train mode mid-training
    Gan gan(group);
    for (int k = 0; k < 4; ++k) {
      gan.step(rank, k);
      if (k == 1 && rank == 0) gan.sample();
    }
  } else if (name == "gan-sample-at-end") {  // rank 0 samples after its last step, then both check the replicas
    Gan gan(group);
    for (int k = 0; k < 2; ++k) gan.step(rank, k);
    if (rank == 0) gan.sample();
    gan.d_ddp.check_replicas("after training");
  } else if (name == "gan-joined-generator") {  // join() around the generator's DDP only; rank 1 one step short
    Gan gan(group);
    gan.g_ddp.join([&] {
      for (int k = 0; k < (rank == 1 ? 1 : 2); ++k) gan.step(rank, k);
    });
  } else if (name == "uneven-two-lanes") {  // no buffers, no SyncBatchNorm: rank 1 one step short, then a replica check
    auto model = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
    DistributedDataParallel ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int k = 0; k < (rank == 1 ? 2 : 3); ++k) step(ddp, opt, rank, k);
    ddp.check_replicas("after training");
  } else if (name == "unwaited-works") {  // each rank a different collective as a Work nobody waits on
    auto t = torch::ones({4});
    if (rank == 0) group.allreduce_sum_async(t);
    else group.broadcast_async(t, 0);
    say(group, "returned without waiting");
  } else if (name == "silent-end") {  // 3 ranks: rank 1 ends without a word at step 2, rank 0 comes to it last
    Small model;
    DistributedDataParallel<Small> ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int k = 0; k < 3; ++k) {
      if (k == 2 && rank == 1) _exit(0);  // as a killed rank: no word in the store, its connections closed
      if (k == 2 && rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(600));
      test::step(ddp, opt, rank, k);
    }
  } else if (name == "timeout") {  // the launcher's --timeout, unless the options name one
    say(group, "timeout " + std::to_string(group.timeout().count()) + " ms");
  } else {
    throw UsageError("no mistake called " + name);
  }
}

TEST(MistakeProgram, Run) {
  const char* name = std::getenv("MNIST_DDP_TEST_MISTAKE");
  if (!name) GTEST_SKIP() << "the program of Mistakes.*, run by them";
  int code = 0;
  try {
    run_case(name);
  } catch (const Error& e) {
    test::write_line(std::string("mistake: caught: ") + e.what());
    code = 1;
  }
  _exit(code);  // after a failed collective the group's threads may still wait on a peer
}

// ---- the tests ----

using test::Ran;

// The case under `mnist_ddp run --nproc N --timeout T`.
Ran run_mistake(const std::string& name, int timeout_s = 10, int nproc = 2) {
  return test::run_program("MistakeProgram.Run", {"MNIST_DDP_TEST_MISTAKE=" + name}, timeout_s, 60s, nullptr, nproc);
}

// The line each rank's program caught, "" where it caught none.
std::vector<std::string> caught(const std::string& output) {
  std::vector<std::string> lines;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("mistake: caught: ", 0) == 0) lines.push_back(line.substr(17));
  return lines;
}

// Both ranks end, within `within` seconds, with the same line holding every
// piece of `pieces`, in the library's words only.
void expect_named_on_every_rank(const Ran& ran, const std::vector<std::string>& pieces, const std::string& name,
                                double within = 10) {
  EXPECT_EQ(ran.code, 1) << name << "\n" << ran.output;
  EXPECT_LT(ran.seconds, within * test::kSlower) << name << "\n" << ran.output;
  const auto lines = caught(ran.output);
  ASSERT_EQ(lines.size(), 2u) << name << ": not on both ranks\n" << ran.output;
  EXPECT_EQ(lines[0], lines[1]) << name << ": the ranks say different things\n" << ran.output;
  for (const auto& piece : pieces) EXPECT_NE(lines[0].find(piece), std::string::npos) << name << ": " << piece << "\n" << ran.output;
  for (const char* backend : {"gloo/", "pair.cc", "terminate called", "Aborted", "signal 6", "Connection reset"})
    EXPECT_EQ(ran.output.find(backend), std::string::npos) << name << ": " << backend << "\n" << ran.output;
  for (const char* internal : {"the authority", "model 1", "model 2"})  // the library's own words, not a user's
    EXPECT_EQ(lines[0].find(internal), std::string::npos) << name << ": " << internal << "\n" << ran.output;
}

TEST(Mistakes, DifferentModelsAreNamedWhenTheDdpIsBuilt) {
  expect_named_on_every_rank(run_mistake("models"),
                             {"DistributedDataParallel: rank 1's a.weight is [512, 4] float32, rank 0's is [16, 4] "
                              "float32: every rank must build the same model, with the same DdpOptions"},
                             "models");
}

TEST(Mistakes, DifferentHooksAreNamedAtTheFirstBackward) {
  expect_named_on_every_rank(run_mistake("hooks"),
                             {"register_comm_hook: rank 1's hook is none, rank 0's is float16 on the wire, over none: "
                              "every rank must register the same communication hook, with the same options"},
                             "hooks");
  expect_named_on_every_rank(run_mistake("powersgd-one-rank"),
                             {"register_comm_hook: rank 1's hook is powersgd (matrix_approximation_rank 1, "
                              "start_powersgd_iter 2,", "rank 0's is none"},
                             "powersgd-one-rank");
}

TEST(Mistakes, ATrainModeSyncBatchNormForwardOnOneRankIsNamed) {
  expect_named_on_every_rank(run_mistake("syncbn-one-rank"),
                             {"rank 0 is in SyncBatchNorm norm.0's forward without autograd (allreduce, 17 float64); "
                              "rank 1 is in ",
                              ": a train-mode forward through SyncBatchNorm must run on every rank"},
                             "syncbn-one-rank");
}

TEST(Mistakes, UnevenInputsAreNamedWithJoinAsTheAdviceAndJoinEndsThemWell) {
  expect_named_on_every_rank(run_mistake("uneven"),
                             {"rank 1 is in the replica check (broadcast, 2 float64, from rank 0): the ranks ran "
                              "different numbers of steps (uneven inputs): give every rank as many batches, or wrap "
                              "each rank's training loop in ddp.join()"},
                             "uneven");
  expect_named_on_every_rank(run_mistake("joined-one-rank"),
                             {"rank 1 is in ddp.join(): the count of the ranks with data (allreduce, 2 float64): "
                              "every rank must call ddp.join() around its training loop, on the same "
                              "DistributedDataParallel"},
                             "joined-one-rank");
  const Ran joined = run_mistake("uneven-joined");
  EXPECT_EQ(joined.code, 0) << joined.output;
  EXPECT_EQ(test::count_of(joined.output, "trained and joined, replicas identical"), 2u) << joined.output;
}

// The case ended with exit 1 within 10 s, a rank having caught `line`.
void expect_caught(const Ran& ran, const std::string& line) {
  EXPECT_EQ(ran.code, 1) << ran.output;
  EXPECT_LT(ran.seconds, 10 * test::kSlower) << ran.output;
  EXPECT_NE(ran.output.find("mistake: caught: " + line), std::string::npos) << ran.output;
}

// Ranks that wait for each other on different streams, each with one
// thread that posts collectives, are deadlocked: named within seconds at
// the default timeout (300 s), with the likely cause, never the timeout.
TEST(Mistakes, RanksDeadlockedOnTwoStreamsAreNamedWithTheCauseWithinSeconds) {
  const std::string syncbn = "a train-mode forward through SyncBatchNorm must run on every rank";
  const Ran gan = run_mistake("gan", 300);
  expect_named_on_every_rank(gan,
                             {"rank 0 waits in SyncBatchNorm 1's forward without autograd (allreduce, 17 float64); "
                              "rank 1 waits in the second DistributedDataParallel's buffers before a forward",
                              "each on another stream, so none can go on: " + syncbn},
                             "gan", 20);
  // join() serves its own DDP's streams only: the discriminator's wait is named, the join named once.
  expect_named_on_every_rank(run_mistake("gan-joined-generator", 300),
                             {"rank 0 waits in the second DistributedDataParallel's buffers before a forward",
                              "rank 1 waits in the first DistributedDataParallel's ddp.join(): its data ran out, each "
                              "on another stream, so none can go on",
                              "a rank whose data ran out serves only the DistributedDataParallel it joined"},
                             "gan-joined-generator", 20);
  const Ran at_end = run_mistake("gan-sample-at-end", 300);
  expect_named_on_every_rank(at_end,
                             {"rank 0 waits in SyncBatchNorm 1's forward without autograd", 
                              "rank 1 waits in the second DistributedDataParallel's replica check", syncbn},
                             "gan-sample-at-end", 20);
  EXPECT_EQ(at_end.output.find("ddp.join()"), std::string::npos) << "join cannot help a sampling forward\n" << at_end.output;
  expect_named_on_every_rank(run_mistake("uneven-two-lanes", 300),
                             {"rank 0 waits in DDP bucket 0's backward", "rank 1 waits in the replica check",
                              "none can go on: the ranks ran different numbers of steps (uneven inputs): give every "
                              "rank as many batches, or wrap each rank's training loop in ddp.join()"},
                             "uneven-two-lanes", 20);
}

// Works nobody waits on still say what failed: each rank names the
// mismatch in one line as its program ends, and exits 1.
TEST(Mistakes, AMismatchAmongWorksNobodyWaitsOnIsNamed) {
  const Ran ran = run_mistake("unwaited-works");
  EXPECT_EQ(ran.code, 1) << ran.output;
  EXPECT_LT(ran.seconds, 10 * test::kSlower) << ran.output;
  EXPECT_EQ(test::count_of(ran.output, "a collective nobody waited for"), 2u) << ran.output;
  EXPECT_EQ(test::count_of(ran.output, "rank 0 is in the program's own allreduce_sum (allreduce, 4 float32); rank 1 is in the "
                              "program's own broadcast (broadcast, 4 float32, from rank 0)"),
            2u)
      << ran.output;
}

TEST(Mistakes, AHookAfterTheFirstBackwardIsRefused) {
  expect_caught(run_mistake("hook-after-backward"), "register_comm_hook: called after the first backward");
}

TEST(Mistakes, ARankThatCatchesItsOwnForwardFailureIsNamed) {
  expect_named_on_every_rank(run_mistake("caught-forward"),
                             {"rank 0 is in SyncBatchNorm norm.0's backward (allreduce, 16 float64); rank 1 is in "
                              "DistributedDataParallel's buffers before a forward (broadcast, 72 uint8, from rank 0): "},
                             "caught-forward");
}

// A rank whose program ends while another waits: the waiting rank names
// it at once, as uneven inputs (or, where it waits in a sampling forward,
// SyncBatchNorm), and the rank that ended well exits 0.
void expect_ended_rank_named(const Ran& ran, const std::string& line, const std::string& name) {
  EXPECT_EQ(ran.code, 1) << name << "\n" << ran.output;
  EXPECT_LT(ran.seconds, 10 * test::kSlower) << name << "\n" << ran.output;
  const auto lines = caught(ran.output);
  ASSERT_EQ(lines.size(), 1u) << name << ": only the waiting rank fails\n" << ran.output;
  EXPECT_EQ(lines[0], line) << name << "\n" << ran.output;
}

TEST(Mistakes, ARankWhoseProgramReturnsEarlyIsNamedAsUnevenInputs) {
  expect_ended_rank_named(
      run_mistake("returns-early"),
      "rank 0 is in DistributedDataParallel's buffers before a forward (broadcast, 72 uint8, from rank 0); rank 1 "
      "ended its program (the last collective it passed there: SyncBatchNorm norm.0's backward (allreduce, 16 "
      "float64)): the ranks ran "
      "different numbers of steps (uneven inputs): give every rank as many batches, or wrap each rank's training "
      "loop in ddp.join()",
      "returns-early");
  expect_ended_rank_named(
      run_mistake("forward-at-end"),
      "rank 0 is in SyncBatchNorm norm.0's forward without autograd (allreduce, 17 float64); rank 1 ended its "
      "program (the last collective it passed there: SyncBatchNorm norm.0's backward (allreduce, 16 float64)): a "
      "train-mode forward through SyncBatchNorm must run on every rank (evaluate or sample under eval(), or on every "
      "rank)",
      "forward-at-end");
}

TEST(Mistakes, ATrainModeForwardThroughTheDdpOnOneRankNamesSyncBatchNorm) {
  expect_named_on_every_rank(run_mistake("ddp-forward-one-rank"),
                             {"rank 0 is in SyncBatchNorm norm.0's forward without autograd (allreduce, 17 float64); "
                              "rank 1 is in the program's own barrier (barrier): a train-mode forward through "
                              "SyncBatchNorm must run on every rank"},
                             "ddp-forward-one-rank");
}

TEST(Mistakes, ABackwardThroughTheModelsOwnForwardIsNamed) {
  const Ran ran = run_mistake("bypass");
  expect_caught(ran, "backward through model->forward: gradients were not averaged; call ddp.forward");
  EXPECT_EQ(ran.output.find("a bug in mnist_ddp"), std::string::npos) << ran.output;
}

// A rank that ends without a word (killed, its machine lost): a rank that
// lost it too is no cause, and the last rank to come names the silent one.
TEST(Mistakes, ARankThatLostAPeerTooIsNotNamedAsTheCause) {
  const Ran ran = run_mistake("silent-end", 10, 3);
  const auto lines = caught(ran.output);
  ASSERT_EQ(lines.size(), 2u) << ran.output;
  const auto last = std::find_if(lines.begin(), lines.end(), [](const std::string& line) {
    return line.rfind("rank 0 lost a peer in ", 0) == 0;
  });
  ASSERT_NE(last, lines.end()) << ran.output;
  EXPECT_NE(last->find("; rank 2 lost one too; rank 1 said nothing (killed, or its machine lost)"), std::string::npos)
      << ran.output;
  EXPECT_EQ(ran.output.find("rank 2 ended with an error"), std::string::npos) << ran.output;
}

TEST(Mistakes, InitProcessGroupTwiceReturnsTheGroupOrRefusesOtherOptions) {
  const Ran ran = run_mistake("init-twice");
  EXPECT_EQ(test::count_of(ran.output, "the second call returned the first group"), 2u) << ran.output;
  expect_named_on_every_rank(ran,
                             {"init_process_group: called a second time, asking for backend nccl (the group's is "
                              "gloo); a process joins its job once: call it once and pass the group on"},
                             "init-twice");
}

TEST(Mistakes, Bfloat16ParametersTrain) {
  const Ran ran = run_mistake("bfloat16");
  EXPECT_EQ(ran.code, 0) << ran.output;
  EXPECT_EQ(test::count_of(ran.output, "bfloat16 parameters trained, replicas identical"), 2u) << ran.output;
}

TEST(Mistakes, TheProgramsGroupTakesTheLaunchersTimeout) {
  const Ran ran = run_mistake("timeout");
  EXPECT_EQ(ran.code, 0) << ran.output;
  EXPECT_EQ(test::count_of(ran.output, "timeout 10000 ms"), 2u) << ran.output;
}

}  // namespace
}  // namespace mnist_ddp
