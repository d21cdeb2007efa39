#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <thread>

#include "mnist_ddp/parallel/comm_hooks.hpp"
#include "mnist_ddp/parallel/distributed.hpp"
#include "app/train/model.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "parallel/iteration.hpp"
#include "parallel/layout.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using test::max_abs_diff;

using test::run_ranks;

// No BatchNorm and no dropout: per-rank batches give the same gradients as
// one batch, so one process on the concatenated batch is the oracle.
struct SmallNetImpl : torch::nn::Module {
  SmallNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    fc = register_module("fc", torch::nn::Linear(144, 10));
  }
  torch::Tensor forward(torch::Tensor x) { return torch::log_softmax(fc(torch::relu(conv(x)).flatten(1)), 1); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SmallNet);

TEST(BucketAssignment, ClosesABucketOnceItReachesItsCap) {
  using Buckets = std::vector<std::vector<size_t>>;
  EXPECT_EQ(compute_bucket_assignment({10, 10, 10}, 15, 100), (Buckets{{0, 1}, {2}}));
  EXPECT_EQ(compute_bucket_assignment({10, 10, 10}, 5, 10), (Buckets{{0}, {1}, {2}}));
  EXPECT_EQ(compute_bucket_assignment({1, 2, 3}, 100, 100), (Buckets{{0, 1, 2}}));
  EXPECT_EQ(compute_bucket_assignment({}, 1, 1), Buckets{});
}

TEST(BucketAssignment, NetLaysOutAsPyTorchDoes) {
  Net net;
  std::vector<int64_t> sizes;
  const auto params = net->parameters();
  for (auto it = params.rbegin(); it != params.rend(); ++it) sizes.push_back(it->numel() * 4);
  const auto buckets = compute_bucket_assignment(sizes, 1024 * 1024, 25 * 1024 * 1024);
  // fc2.bias, fc2.weight, fc1.bias, fc1.weight fill the 1 MB first bucket; the rest share the second.
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{0, 1, 2, 3}));
  EXPECT_EQ(buckets[1].size(), 8u);
}

struct Batches {
  torch::Tensor x, y;
};

Batches make_batches(int64_t n, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({n, 1, 8, 8}), torch::randint(0, 10, {n}, torch::kInt64)};
}

// Models built serially: threads share LibTorch's default generator.
std::vector<SmallNet> models_with_seeds(int count, uint64_t first_seed) {
  std::vector<SmallNet> models;
  for (int r = 0; r < count; ++r) {
    torch::manual_seed(first_seed + r);
    models.emplace_back();
  }
  return models;
}

TEST(Ddp, AveragedGradientsEqualOneProcessOnTheConcatenatedBatch) {
  const int64_t per_rank = 4;
  for (test::Sums sums : {test::Sums::gloo, test::Sums::shared_memory}) {
    for (int world : {2, 3}) {
      for (double cap_mb : {25.0, 0.001}) {  // two buckets, then one bucket per parameter
        const Batches data = make_batches(world * per_rank, 1);
        auto oracle = models_with_seeds(1, 100).front();  // the same init as rank 0
        torch::nll_loss(oracle->forward(data.x), data.y).backward();

        auto models = models_with_seeds(world, 100);  // every rank starts elsewhere
        std::vector<std::vector<torch::Tensor>> grads(world), params(world);
        run_ranks(world, [&](ProcessGroup& group) {
          DistributedDataParallel ddp(models[group.rank()], group, DdpOptions().bucket_cap_mb(cap_mb));
          const int64_t begin = group.rank() * per_rank;
          auto out = ddp.forward(data.x.slice(0, begin, begin + per_rank));
          torch::nll_loss(out, data.y.slice(0, begin, begin + per_rank)).backward();
          for (const auto& p : ddp->parameters()) {
            grads[group.rank()].push_back(p.grad().clone());
            params[group.rank()].push_back(p.detach().clone());
          }
        }, torch::kCPU, sums);
        const auto expected = oracle->parameters();
        for (int r = 0; r < world; ++r) {
          ASSERT_EQ(grads[r].size(), expected.size());
          for (size_t i = 0; i < expected.size(); ++i) {
            EXPECT_TRUE(torch::equal(params[r][i], expected[i])) << "rank " << r << " did not start from rank 0's state";
            EXPECT_LE(max_abs_diff(grads[r][i], expected[i].grad()), 1e-5)
                << (sums == test::Sums::gloo ? "gloo" : "shared memory") << ", world " << world << " cap " << cap_mb
                << " rank " << r << " parameter " << i;
          }
        }
      }
    }
  }
}

TEST(Ddp, ReplicasStayIdenticalAndTrackTheOracleOverSteps) {
  const int world = 3, per_rank = 4, steps = 6;
  auto oracle = models_with_seeds(1, 7).front();
  torch::optim::SGD oracle_opt(oracle->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(5e-4));
  std::vector<Batches> data;
  for (int s = 0; s < steps; ++s) data.push_back(make_batches(world * per_rank, 50 + s));
  for (const auto& d : data) {
    oracle_opt.zero_grad();
    torch::nll_loss(oracle->forward(d.x), d.y).backward();
    oracle_opt.step();
  }

  auto models = models_with_seeds(world, 7);
  std::vector<std::vector<torch::Tensor>> final_params(world);
  run_ranks(world, [&](ProcessGroup& group) {
    DistributedDataParallel ddp(models[group.rank()], group, DdpOptions().bucket_cap_mb(0.001));
    torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(5e-4));
    for (const auto& d : data) {
      opt.zero_grad();
      const int64_t begin = group.rank() * per_rank;
      torch::nll_loss(ddp.forward(d.x.slice(0, begin, begin + per_rank)), d.y.slice(0, begin, begin + per_rank))
          .backward();
      opt.step();
    }
    for (const auto& p : ddp->parameters()) final_params[group.rank()].push_back(p.detach().clone());
  });
  const auto expected = oracle->parameters();
  for (size_t i = 0; i < expected.size(); ++i) {
    for (int r = 1; r < world; ++r) EXPECT_TRUE(torch::equal(final_params[r][i], final_params[0][i]));
    EXPECT_LE(max_abs_diff(final_params[0][i], expected[i]), 1e-5);
  }
}

TEST(Ddp, GradientsStayBucketViewsWhenTheOptimiserResetsThem) {
  // PyTorch 2's zero_grad sets .grad to undefined; DDP must relink it.
  auto models = models_with_seeds(2, 3);
  run_ranks(2, [&](ProcessGroup& group) {
    DistributedDataParallel ddp(models[group.rank()], group);
    const Batches d = [&] {
      static std::mutex m;
      std::lock_guard<std::mutex> lock(m);
      return make_batches(4, 9);
    }();
    for (int step = 0; step < 2; ++step) {
      for (auto& p : ddp->parameters()) p.mutable_grad() = torch::Tensor();
      torch::nll_loss(ddp.forward(d.x), d.y).backward();
      for (const auto& p : ddp->parameters()) {
        ASSERT_TRUE(p.grad().defined());
        const auto* begin = static_cast<const char*>(reducer_of(ddp).buckets()[0].buffer().data_ptr());
        const auto* end = begin + 4 * reducer_of(ddp).buckets()[0].buffer().numel();
        const auto* g = static_cast<const char*>(p.grad().data_ptr());
        EXPECT_TRUE(g >= begin && g < end) << "a gradient is no longer a view into its bucket";
      }
    }
  });
}

TEST(Ddp, TheReplicaCheckNamesEachDifferingRankAndItsLargestDifference) {
  auto models = models_with_seeds(3, 5);
  std::vector<std::string> outcome(3);
  run_ranks(3, [&](ProcessGroup& group) {
    DistributedDataParallel ddp(models[group.rank()], group);
    ddp.check_replicas("at the start");  // rank 0's state was broadcast: nothing to say
    if (group.rank() == 2) {
      torch::NoGradGuard no_grad;
      ddp->named_parameters()["conv.bias"][1].add_(0.25);
      ddp->named_parameters()["fc.weight"][3][7].add_(0.5);
    }
    try {
      ddp.check_replicas("after epoch 3");
      outcome[group.rank()] = "(passed)";
    } catch (const PeerLost& e) {
      outcome[group.rank()] = std::string("echo: ") + e.what();
    } catch (const std::exception& e) {
      outcome[group.rank()] = e.what();
    }
  });
  EXPECT_EQ(outcome[0],
            "the replicas diverged after epoch 3: rank 2 differs from rank 0 by up to 0.5 (largest in module.fc.weight) "
            "- something changed some ranks' parameters and not the others' (an optimizer step, a load or an edit on "
            "some ranks only); if nothing did, it is a bug in mnist_ddp: please report it");
  for (int r : {1, 2}) EXPECT_EQ(outcome[r], "echo: rank 0 found the replicas diverged after epoch 3");
}

struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    used = register_module("used", torch::nn::Linear(4, 2));
    unused = register_module("unused", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(torch::Tensor x) { return used(x); }
  torch::nn::Linear used{nullptr}, unused{nullptr};
};
TORCH_MODULE(TwoHeads);

// As PyTorch's DDP: the backward leaves the averaging incomplete (another
// backward call could still bring the gradient), and the next forward names
// what got none.
TEST(Ddp, AParameterWithoutGradientIsNamedAtTheNextForward) {
  std::vector<TwoHeads> models{TwoHeads(), TwoHeads()};
  std::vector<std::string> errors(2);
  run_ranks(2, [&](ProcessGroup& group) {
    DistributedDataParallel ddp(models[group.rank()], group);
    ddp.forward(torch::ones({3, 4})).sum().backward();
    try {
      ddp.forward(torch::ones({3, 4}));
    } catch (const std::exception& e) {
      errors[group.rank()] = e.what();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("unused.weight"), std::string::npos) << e;
    EXPECT_EQ(e.find(" used.weight"), std::string::npos) << e;
  }
}

// Every tensor as float64, flat.
std::vector<torch::Tensor> flatten(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.reshape(-1).to(torch::kFloat64));
  return out;
}

// Conv, BatchNorm (made synchronous), linear: the shape of Net without its
// dropout, whose masks come from each device's own generator.
struct ConvBnNetImpl : torch::nn::Module {
  ConvBnNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    register_module("bn", torch::nn::BatchNorm2d(4));
    fc = register_module("fc", torch::nn::Linear(144, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = batch_norm_relu(*named_children()["bn"], conv(x));
    return torch::log_softmax(fc(x.flatten(1)), 1);
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ConvBnNet);

constexpr int kPerRank = 4;

ConvBnNet conv_bn_net() {
  torch::manual_seed(21);
  return ConvBnNet();
}

std::vector<Batches> conv_bn_batches(int world, int steps) {
  std::vector<Batches> data;
  for (int s = 0; s < steps; ++s) data.push_back(make_batches(world * kPerRank, 60 + s));
  return data;
}

// Models built serially: ranks as threads share LibTorch's default generator.
std::vector<ConvBnNet> conv_bn_nets(int count) {
  std::vector<ConvBnNet> models;
  for (int r = 0; r < count; ++r) models.push_back(conv_bn_net());
  return models;
}

// This rank trains `model`, its BatchNorm made synchronous, under `hook`
// (PowerSGD from step 2); returns its parameters and buffers, on the CPU.
std::vector<torch::Tensor> train_conv_bn_net(ProcessGroup& group, ConvBnNet model, const std::string& hook,
                                             const std::vector<Batches>& data,
                                             std::vector<torch::Tensor>* first_grads = nullptr) {
  convert_sync_batchnorm(model, group);
  model->to(group.device());
  DistributedDataParallel ddp(model, group);
  ddp.register_comm_hook(make_comm_hook(hook, hooks::PowerSgdOptions().matrix_approximation_rank(2).start_powersgd_iter(2)));
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(5e-4));
  const int64_t begin = group.rank() * kPerRank;
  for (const auto& d : data) {
    opt.zero_grad();
    torch::nll_loss(ddp.forward(d.x.slice(0, begin, begin + kPerRank).to(group.device())),
                    d.y.slice(0, begin, begin + kPerRank).to(group.device()))
        .backward();
    if (first_grads && first_grads->empty())
      for (const auto& p : ddp->parameters()) first_grads->push_back(p.grad().cpu().clone());
    opt.step();
  }
  std::vector<torch::Tensor> state;
  for (const auto& t : ddp->parameters()) state.push_back(t.detach().cpu().clone());
  for (const auto& t : ddp->buffers()) state.push_back(t.detach().cpu().clone());
  return state;
}

// One process, BatchNorm2d on the concatenated batch, on the CPU.
std::vector<torch::Tensor> train_oracle(const std::vector<Batches>& data, std::vector<torch::Tensor>* first_grads) {
  ConvBnNet model = conv_bn_net();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(5e-4));
  for (const auto& d : data) {
    opt.zero_grad();
    torch::nll_loss(model->forward(d.x), d.y).backward();
    if (first_grads->empty())
      for (const auto& p : model->parameters()) first_grads->push_back(p.grad().clone());
    opt.step();
  }
  std::vector<torch::Tensor> state;
  for (const auto& t : model->parameters()) state.push_back(t.detach().clone());
  for (const auto& t : model->buffers()) state.push_back(t.detach().clone());
  return state;
}

const torch::Device kGpu(torch::kCUDA, 0);

// ---- the bucket layout and the iteration, without communication ----

std::vector<AveragedParam> three_params() {
  return {{torch::zeros({3}), "a"}, {torch::zeros({2, 2}), "b"}, {torch::zeros({5}, torch::kFloat64), "c"}};
}

// One dtype a bucket, buckets by their first parameter's place in the
// order, each gradient a view at its place in its bucket's buffer; a new
// layout takes over gradients that were views of the old one's.
TEST(BucketLayout, ViewsLieInTheirBucketsInOrderAndANewLayoutTakesTheOldGradients) {
  auto params = three_params();
  const BucketLayout layout(params, {2, 1, 0}, 1 << 20, 1 << 20);
  ASSERT_EQ(layout.size(), 2u);
  EXPECT_EQ(layout.bucket(0).parameter_names(), (std::vector<std::string>{"c"}));
  EXPECT_EQ(layout.bucket(1).parameter_names(), (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ(layout.bucket_of(0), 1u);
  EXPECT_EQ(layout.params_in(1), 2u);
  const auto* base = static_cast<const float*>(layout.bucket(1).buffer().data_ptr());
  EXPECT_EQ(layout.view(1).data_ptr(), base);
  EXPECT_EQ(layout.view(0).data_ptr(), base + 4);
  EXPECT_TRUE(layout.bucket(1).is_last());
  params[1].tensor.mutable_grad() = layout.view(1);
  layout.view(1).fill_(7);
  const BucketLayout rebuilt(params, {0, 1, 2}, 1 << 20, 1 << 20);
  rebuilt.adopt_gradients(params, layout);
  EXPECT_TRUE(params[1].tensor.grad().is_same(rebuilt.view(1)));
  EXPECT_TRUE(torch::equal(params[1].tensor.grad(), torch::full({2, 2}, 7.0f)));
  EXPECT_EQ(rebuilt.bucket(0).parameter_names(), (std::vector<std::string>{"a", "b"}));
}

// What the machine told its DDP to do, in order.
struct Told : Iteration::Effects {
  std::vector<std::string> said;
  void took_gradient(size_t p) override { said.push_back("took " + std::to_string(p)); }
  void counted_unused(size_t p) override { said.push_back("unused " + std::to_string(p)); }
  void bucket_ready(size_t b) override { said.push_back("post " + std::to_string(b)); }
  void round_began() override { said.push_back("began"); }
  int began() const { return static_cast<int>(std::count(said.begin(), said.end(), "began")); }
  std::vector<std::string> posts() const {
    std::vector<std::string> out;
    for (const auto& s : said)
      if (s.rfind("post", 0) == 0) out.push_back(s);
    return out;
  }
};

// Two parameters, each in a bucket of its own: p0 in bucket 1, p1 in bucket 0.
BucketLayout two_buckets() {
  static const std::vector<AveragedParam> params{{torch::zeros({2}), "p0"}, {torch::zeros({2}), "p1"}};
  return BucketLayout(params, {1, 0}, 1, 1);
}

TEST(Iteration, BucketsGoInIndexOrderAndSeveralBackwardsCompleteOneIteration) {
  Told told;
  Iteration it(2, false, false, told);
  it.use_layout(two_buckets());
  it.open(false);
  EXPECT_TRUE(it.gradient(0, "p0"));  // starts a backward call
  EXPECT_EQ(told.began(), 1) << "the round's buckets may be announced before any goes";
  EXPECT_TRUE(told.posts().empty()) << "bucket 1 waits for bucket 0";
  EXPECT_EQ(it.end_backward(), Iteration::End::open) << "p1 comes in another backward call";
  EXPECT_TRUE(it.gradient(1, "p1"));
  EXPECT_EQ(told.posts(), (std::vector<std::string>{"post 0", "post 1"}));
  EXPECT_EQ(told.began(), 1) << "once a round, however many backward calls bring it";
  EXPECT_EQ(it.end_backward(), Iteration::End::complete);
  EXPECT_EQ(it.close(), (std::vector<bool>{true, true}));
  EXPECT_EQ(it.phase(), Iteration::Phase::closed);
  it.gradient(0, "p0");
  EXPECT_EQ(it.end_backward(), Iteration::End::bypassed) << "a backward with no forward of the DDP's";
  EXPECT_EQ(told.began(), 1) << "a bypassed backward averages nothing";
  it.open(false);
  it.gradient(0, "p0");
  EXPECT_EQ(told.began(), 2);
  EXPECT_THROW(it.gradient(0, "p0"), UsageError) << "a second gradient before its bucket went";
}

TEST(Iteration, NoSyncAccumulatesAndAnUnreachedParameterIsUnusedAtOnce) {
  Told told;
  Iteration it(2, true, false, told);
  it.use_layout(two_buckets());
  it.open(true);
  it.gradient(0, "p0");
  EXPECT_EQ(it.end_backward(), Iteration::End::ignored);
  EXPECT_TRUE(told.posts().empty());
  it.open(false);
  ASSERT_TRUE(it.wants_walk());
  it.walked({true, false});
  EXPECT_EQ(told.posts(), (std::vector<std::string>{"post 0"})) << "p1 counted unused at the forward";
  it.gradient(0, "p0");
  EXPECT_EQ(told.posts(), (std::vector<std::string>{"post 0", "post 1"}));
  EXPECT_EQ(it.end_backward(), Iteration::End::complete);
  EXPECT_EQ(it.close(), (std::vector<bool>{true, false})) << "p0 used, in no_sync's micro-batch and after";
  EXPECT_EQ(told.began(), 0) << "under find_unused_parameters a bucket may go at the forward: never announced";
}

// find_unused_parameters: a backward call averages what it has (an output
// the loss left out: what got nothing is unused), and another backward of
// the same forward is a round of its own.
TEST(Iteration, UnderFindUnusedParametersEachBackwardIsARound) {
  Told told;
  Iteration it(2, true, false, told);
  it.use_layout(two_buckets());
  it.open(false);
  it.walked({true, true});
  it.gradient(0, "p0");
  EXPECT_EQ(it.end_backward(), Iteration::End::complete);
  it.close();
  EXPECT_EQ(it.phase(), Iteration::Phase::rounded);
  told.said.clear();
  it.gradient(1, "p1");
  EXPECT_EQ(it.phase(), Iteration::Phase::averaging) << "a second loss's backward";
  EXPECT_EQ(it.end_backward(), Iteration::End::complete);
  EXPECT_EQ(it.close(), (std::vector<bool>{false, true}));
  EXPECT_EQ(told.posts(), (std::vector<std::string>{"post 0", "post 1"}));
}

// static_graph: the first step learns how many gradients each parameter
// gets and in which order, the buckets are rebuilt once, then a parameter
// is ready once it has as many as then.
TEST(Iteration, StaticGraphLearnsItsFirstStepThenCountsEachParametersGradients) {
  Told told;
  Iteration it(2, false, true, told);
  it.use_layout(two_buckets());
  it.open(false);
  EXPECT_EQ(it.phase(), Iteration::Phase::learning);
  it.gradient(1, "p1");
  it.gradient(0, "p0");
  it.gradient(0, "p0");  // twice: a reentrant backward
  EXPECT_TRUE(told.posts().empty()) << "the first step posts at its end";
  EXPECT_EQ(it.end_backward(), Iteration::End::complete);
  EXPECT_TRUE(it.rebuild_due());
  EXPECT_EQ(it.ready_order(), (std::vector<size_t>{1, 0}));
  EXPECT_EQ(it.expected_fires(), (std::vector<int>{2, 1}));
  it.close();
  it.rebuilt();
  it.open(false);
  EXPECT_EQ(it.phase(), Iteration::Phase::averaging);
  told.said.clear();
  it.gradient(0, "p0");
  EXPECT_TRUE(told.posts().empty()) << "p0 has one of its two";
  it.gradient(1, "p1");
  it.gradient(0, "p0");
  EXPECT_EQ(told.posts(), (std::vector<std::string>{"post 0", "post 1"}));
  EXPECT_THROW(it.gradient(0, "p0"), UsageError) << "more than the first step gave";
  EXPECT_EQ(told.began(), 0) << "static_graph: a rank's unused parameters' bucket may go at the forward";
}

// A bucket's task may outlive the DDP that posted it: here the backward
// is ended by shutdown() while the task is inside PowerSGD's hook, the DDP
// is destroyed, and then the task reads its bucket and runs the hook. It
// owns what it touches (the sanitizer leg, scripts/sanitize.sh, finds any
// read of freed memory).
TEST(Ddp, ADdpDestroyedWhileItsBucketTaskRunsUnderPowerSgdLeavesTheTaskWhatItTouches) {
  struct Slow : hooks::CommHook {
    explicit Slow(std::atomic<bool>& gone) : ddp_gone(gone) {}
    std::string name() const override { return "slow powersgd"; }
    FuturePtr run(const hooks::GradBucket& bucket, hooks::Wire& wire) override {
      for (int i = 0; i < 500 && !ddp_gone; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      std::string names;
      for (const auto& n : bucket.parameter_names()) names += n + " ";
      saw = names + std::to_string(bucket.buffer().numel()) + " " + std::to_string(std::lround(bucket.buffer().sum().item<float>()));
      return inner->run(bucket, wire);
    }
    std::atomic<bool>& ddp_gone;
    std::shared_ptr<hooks::PowerSgdHook> inner = hooks::powersgd(
        hooks::PowerSgdOptions().start_powersgd_iter(0).use_error_feedback(false).warm_start(false));
    std::string saw;
  };
  std::vector<std::string> saw(2), caught(2);
  test::Ranks how;
  how.barrier_after = false;
  run_ranks(
      2,
      [&](ProcessGroup& group) {
        std::atomic<bool> gone{false};
        auto hook = std::make_shared<Slow>(gone);
        std::thread ender([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          group.shutdown();
        });
        try {
          auto model = std::make_shared<torch::nn::LinearImpl>(16, 16);
          DistributedDataParallel ddp(model, group);
          ddp.register_comm_hook(hook);
          ddp.forward(torch::ones({4, 16})).sum().backward();
        } catch (const std::exception& e) {
          caught[group.rank()] = error_line(e);
        }
        gone = true;  // the DDP and its model are gone: the task goes on in the hook
        ender.join();
        for (int i = 0; i < 500 && hook->saw.empty(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        saw[group.rank()] = hook->saw;
      },
      how);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(caught[r].find("the process group was shut down"), std::string::npos) << "rank " << r << ": " << caught[r];
    EXPECT_EQ(saw[r], "bias weight 272 1088") << "rank " << r << ": what the task read of its bucket";
  }
}

// A backward's buckets are checked as the backward begins, over Gloo
// (averager.cpp, "Note on checks of buckets"): their check's round trip
// overlaps the backward instead of delaying the first bucket. Here a
// function between the two layers of the one bucket holds the backward
// until the DDP's lane has made a check (5 s at most), so the bucket cannot
// go before it; and the replicas stay identical.
struct HoldUntilChecked : torch::autograd::Function<HoldUntilChecked> {
  struct Probe : StreamProbe {
    std::atomic<int> checks{0};
    void checked() override { ++checks; }
  };
  static std::array<std::shared_ptr<Probe>, 2> probes;
  static std::array<std::atomic<int>, 2> held;  // checks made while the backward held, per rank
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, int64_t rank, bool hold) {
    ctx->saved_data["rank"] = rank;
    ctx->saved_data["hold"] = hold;
    ctx->saved_data["checks"] = static_cast<int64_t>(probes[rank]->checks);
    return x.clone();
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list g) {
    const int64_t rank = ctx->saved_data["rank"].toInt(), before = ctx->saved_data["checks"].toInt();
    for (int i = 0; i < 500 && ctx->saved_data["hold"].toBool() && probes[rank]->checks == before; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    held[rank] = probes[rank]->checks - static_cast<int>(before);
    return {g[0], torch::Tensor(), torch::Tensor()};
  }
};
std::array<std::shared_ptr<HoldUntilChecked::Probe>, 2> HoldUntilChecked::probes;
std::array<std::atomic<int>, 2> HoldUntilChecked::held;

TEST(Ddp, ABackwardsBucketsAreCheckedWhileItComputesOverGloo) {
  struct Held : torch::nn::Module {
    Held() : a(register_module("a", torch::nn::Linear(4, 4))), b(register_module("b", torch::nn::Linear(4, 2))) {}
    torch::Tensor forward(torch::Tensor x, int64_t rank, bool hold) { return b(HoldUntilChecked::apply(a(x), rank, hold)); }
    torch::nn::Linear a, b;
  };
  for (const bool powersgd : {false, true}) {  // PowerSGD's collectives go unchecked too, after the one check
    const std::string hook = powersgd ? "powersgd_fp16" : "allreduce";
    std::vector<std::vector<torch::Tensor>> params(2);
    std::vector<std::vector<int>> held(2), made(2);
    run_ranks(2, [&](ProcessGroup& group) {
      const int r = group.rank();
      torch::manual_seed(1);
      auto model = std::make_shared<Held>();
      DistributedDataParallel ddp(model, group);
      if (powersgd)
        ddp.register_comm_hook(
            hooks::fp16_compress_wrapper(hooks::powersgd(hooks::PowerSgdOptions().start_powersgd_iter(2))));
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
      HoldUntilChecked::probes[r] = std::make_shared<HoldUntilChecked::Probe>();
      const auto probe = HoldUntilChecked::probes[r];
      bulk_stream(group)->watch(probe);
      for (int k = 0; k < 4; ++k) {  // the first backward compares the hooks, in its first bucket's task: not held
        torch::manual_seed(10 * r + k);
        opt.zero_grad();
        const auto x = torch::randn({8, 4}), y = torch::randn({8, 2});
        const int before = probe->checks;
        torch::mse_loss(ddp.forward(x, static_cast<int64_t>(r), k > 0), y).backward();
        opt.step();
        if (k == 0) continue;
        held[r].push_back(HoldUntilChecked::held[r]);
        made[r].push_back(probe->checks - before);
      }
      for (const auto& p : model->parameters()) params[r].push_back(p.detach().clone());
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(held[r], (std::vector<int>{1, 1, 1})) << hook << ", rank " << r << ": checks while it held";
      EXPECT_EQ(made[r], (std::vector<int>{1, 1, 1})) << hook << ", rank " << r << ": checks in each step";
    }
    for (size_t i = 0; i < params[0].size(); ++i) EXPECT_TRUE(torch::equal(params[0][i], params[1][i])) << i;
  }
}

TEST(Ddp, SyncBatchNormRanksTrackOneProcessOnTheConcatenatedBatch) {
  const auto data = conv_bn_batches(2, 3);
  std::vector<torch::Tensor> oracle_grads;
  const auto oracle = train_oracle(data, &oracle_grads);
  const auto models = conv_bn_nets(2);
  run_ranks(2, [&](ProcessGroup& group) {
    std::vector<torch::Tensor> grads;
    const auto state = train_conv_bn_net(group, models[group.rank()], "none", data, &grads);
    for (size_t i = 0; i < oracle_grads.size(); ++i) EXPECT_LE(max_abs_diff(grads[i], oracle_grads[i]), 1e-5) << i;
    for (size_t i = 0; i < oracle.size(); ++i) EXPECT_LE(max_abs_diff(state[i], oracle[i]), 1e-4) << i;
  });
}

// The GPU's gradients equal the CPU's (TF32 off: it rounds convolutions to 10 bits).
TEST(CudaDdp, OneStepOnTheGpuGivesTheCpusGradients) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device is visible to this LibTorch";
  at::globalContext().setAllowTF32CuDNN(false);
  const auto data = conv_bn_batches(2, 1);
  std::vector<torch::Tensor> oracle_grads;
  train_oracle(data, &oracle_grads);
  const auto models = conv_bn_nets(2);
  run_ranks(
      2,
      [&](ProcessGroup& group) {
        at::globalContext().setAllowTF32CuDNN(false);
        std::vector<torch::Tensor> grads;
        train_conv_bn_net(group, models[group.rank()], "none", data, &grads);
        for (size_t i = 0; i < oracle_grads.size(); ++i)
          EXPECT_LE(max_abs_diff(grads[i], oracle_grads[i]), 1e-5) << "rank " << group.rank() << " parameter " << i;
      },
      kGpu);
}

TEST(CudaDdp, RanksSharingAGpuStayBitIdenticalUnderEveryHook) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device is visible to this LibTorch";
  const auto data = conv_bn_batches(2, 5);
  run_ranks(
      2,
      [&](ProcessGroup& group) {
        for (const std::string& hook : kAllCompressions) {
          const auto state = torch::cat(flatten(train_conv_bn_net(group, conv_bn_net(), hook, data)));
          const auto all = bulk_stream(group)->gather_to_rank0(state);
          for (size_t r = 1; r < all.size(); ++r)
            EXPECT_TRUE(torch::equal(all[r], all[0])) << hook << ": rank " << r << " differs from rank 0";
          EXPECT_TRUE(torch::isfinite(state).all().item<bool>()) << hook;
        }
      },
      kGpu);
}

}  // namespace
}  // namespace mnist_ddp
