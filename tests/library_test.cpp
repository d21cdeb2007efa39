// The library as a LibTorch program uses it, on models that are not Net.
// The oracle is one process on the concatenated batch: every rank's
// averaged gradients must equal its gradients, and the replicas stay
// bit-identical across ranks.
#include <gtest/gtest.h>

#include <map>

#include <torch/torch.h>

#include <limits>
#include <mutex>
#include <sstream>

#include "mnist_ddp/ddp.hpp"
#include "examples/topk.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using test::max_abs_diff;
using test::run_ranks;

constexpr int kWorld = 2;

using test::expect_oracle;
using test::Snapshot;
using test::snapshot;

torch::Tensor shard(const torch::Tensor& t, int rank) { return test::shard(t, rank, kWorld); }

template <typename Model>
std::vector<std::shared_ptr<Model>> replicas(uint64_t seed) {
  return test::replicas<Model>(seed, kWorld);
}

// A layer over a weight another module owns too.
struct TiedImpl : torch::nn::Module {
  explicit TiedImpl(const torch::Tensor& w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, weight.t()); }
  torch::Tensor weight;
};
TORCH_MODULE(Tied);

// Two inputs and two outputs; a head called twice in one forward; a weight
// tied between two modules; a frozen parameter.
struct TwoWayImpl : torch::nn::Module {
  TwoWayImpl() {
    a = register_module("a", torch::nn::Linear(4, 3));
    b = register_module("b", torch::nn::Linear(5, 3));
    head = register_module("head", torch::nn::Linear(3, 2));
    tied = register_module("tied", Tied(head->weight));  // the same tensor, registered twice
    frozen = register_parameter("frozen", torch::randn({2}), /*requires_grad=*/false);
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& y) {
    const auto hx = torch::relu(a(x)), hy = torch::relu(b(y));
    return {head(hx) + frozen, head(hy) * tied(hx)};
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, head{nullptr};
  Tied tied{nullptr};
  torch::Tensor frozen;
};
TORCH_MODULE(TwoWay);

torch::Tensor two_way_loss(const std::tuple<torch::Tensor, torch::Tensor>& out) {
  return std::get<0>(out).pow(2).mean() + std::get<1>(out).mean();
}

TEST(Library, SeveralInputsAndOutputsTiedFrozenAndTwiceCalledParametersMatchTheOracle) {
  auto models = replicas<TwoWayImpl>(11);
  torch::manual_seed(12);
  const auto x = torch::randn({8, 4}), y = torch::randn({8, 5});
  std::vector<Snapshot> got(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    DistributedDataParallel ddp(model, group, DdpOptions().bucket_cap_mb(1e-6));  // a bucket a parameter
    EXPECT_EQ(reducer_of(ddp).buckets().size(), 6u) << "a, b and head, two each: the tied one once, the frozen one never";
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      two_way_loss(ddp.forward(shard(x, group.rank()), shard(y, group.rank()))).backward();
      if (step == 0) got[group.rank()] = snapshot(*model);  // the first step's gradients
      opt.step();
    }
    got[group.rank()].values = snapshot(*model).values;
  });
  auto oracle = models.back();
  torch::optim::SGD opt(oracle->parameters(), 0.1);
  Snapshot expected;
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    two_way_loss(oracle->forward(x, y)).backward();
    if (step == 0) expected = snapshot(*oracle);
    opt.step();
  }
  expected.values = snapshot(*oracle).values;
  expect_oracle(got, expected);
}

// A branch each rank takes or not: `extra` is used where `use` says.
struct BranchImpl : torch::nn::Module {
  BranchImpl() {
    main = register_module("main", torch::nn::Linear(4, 2));
    extra = register_module("extra", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use) { return use ? main(x) + extra(x) : main(x); }
  torch::nn::Linear main{nullptr}, extra{nullptr};
};
TORCH_MODULE(Branch);

TEST(Library, AParameterUnusedOnSomeRanksIsAveragedWithZerosAndOneUnusedEverywhereKeepsItsGradient) {
  auto models = replicas<BranchImpl>(21);
  torch::manual_seed(22);
  const auto x = torch::randn({6, 4});
  std::vector<Snapshot> first(kWorld), second(kWorld);
  std::vector<std::string> kept(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    DistributedDataParallel ddp(model, group, DdpOptions().find_unused_parameters(true));
    // Step 1: only rank 0 uses `extra`.
    ddp.forward(shard(x, group.rank()), group.rank() == 0).pow(2).mean().backward();
    first[group.rank()] = snapshot(*model);
    // Step 2: nobody uses it; its gradient stays what it was (here: a
    // marker), and an undefined one stays undefined.
    model->extra->weight.mutable_grad() = torch::full({2, 4}, 7.0f);
    model->extra->bias.mutable_grad() = torch::Tensor();
    model->main->weight.mutable_grad().zero_();
    model->main->bias.mutable_grad().zero_();
    ddp.forward(shard(x, group.rank()), false).pow(2).mean().backward();
    second[group.rank()] = snapshot(*model);
    std::ostringstream s;
    s << model->extra->weight.grad().mean().item<float>() << " " << model->extra->bias.grad().defined();
    kept[group.rank()] = s.str();
  });
  // The oracle: the mean of both ranks' losses, rank 1's without `extra`.
  auto oracle = models.back();
  ((oracle->forward(shard(x, 0), true).pow(2).mean() + oracle->forward(shard(x, 1), false).pow(2).mean()) / 2)
      .backward();
  expect_oracle(first, snapshot(*oracle));
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(kept[r], "7 0") << "rank " << r;
  oracle->zero_grad();
  ((oracle->forward(shard(x, 0), false).pow(2).mean() + oracle->forward(shard(x, 1), false).pow(2).mean()) / 2)
      .backward();
  const Snapshot expected = snapshot(*oracle);
  for (int r = 0; r < kWorld; ++r)
    for (size_t i : {0, 1}) EXPECT_LE(max_abs_diff(second[r].grads[i], expected.grads[i]), 1e-6) << r;  // main's
}

TEST(Library, WithoutFindUnusedParametersAnUnusedOneIsNamedAndNoRankHangs) {
  auto models = replicas<BranchImpl>(23);
  std::vector<std::string> errors(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& group) {
    DistributedDataParallel ddp(models[group.rank()], group);
    try {  // rank 1 leaves `extra` out, and learns it at its next forward; rank 0 must still finish its step
      ddp.forward(torch::ones({3, 4}), group.rank() == 0).sum().backward();
      ddp.forward(torch::ones({3, 4}), true);
      errors[group.rank()] = "(none)";
    } catch (const std::exception& e) {
      errors[group.rank()] = e.what();
    }
  });
  EXPECT_EQ(errors[0], "(none)");
  EXPECT_NE(errors[1].find("extra.weight extra.bias"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("find_unused_parameters(true)"), std::string::npos) << errors[1];
  EXPECT_EQ(errors[1].find('\n'), std::string::npos) << "one line";
}

// PyTorch's bug pytorch#69031: a parameter used in an early micro-batch but
// not the last must still be averaged.
TEST(Library, NoSyncOverMicroBatchesEqualsOneStepOnTheirConcatenation) {
  auto models = replicas<BranchImpl>(31);
  torch::manual_seed(32);
  const int k = 3;
  std::vector<torch::Tensor> micro;
  for (int j = 0; j < k; ++j) micro.push_back(torch::randn({4, 4}));
  std::vector<Snapshot> got(kWorld);
  for (bool find_unused : {false, true}) {
    run_ranks(kWorld, [&](ProcessGroup& group) {
      auto model = models[group.rank()];
      model->zero_grad();
      DistributedDataParallel ddp(model, group, DdpOptions().find_unused_parameters(find_unused));
      const int64_t before = ddp.wire_stats().bytes;
      for (int j = 0; j < k - 1; ++j) {
        auto guard = ddp.no_sync();
        ddp.forward(shard(micro[j], group.rank()), find_unused || true).pow(2).mean().backward();
      }
      EXPECT_EQ(ddp.wire_stats().bytes, before) << "no_sync sent something";
      // The last micro-batch leaves `extra` out where that is allowed.
      ddp.forward(shard(micro[k - 1], group.rank()), !find_unused).pow(2).mean().backward();
      EXPECT_GT(ddp.wire_stats().bytes, before);
      got[group.rank()] = snapshot(*model);
    });
    auto oracle = models.back();
    oracle->zero_grad();
    for (int j = 0; j < k; ++j) oracle->forward(micro[j], j < k - 1 || !find_unused).pow(2).mean().backward();
    expect_oracle(got, snapshot(*oracle));
  }
}

TEST(Library, TwoForwardAndBackwardPassesBeforeOneStepAddTheirAverages) {
  auto models = replicas<BranchImpl>(41);
  torch::manual_seed(42);
  const auto x1 = torch::randn({4, 4}), x2 = torch::randn({4, 4});
  std::vector<Snapshot> got(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    DistributedDataParallel ddp(model, group);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    opt.zero_grad();
    ddp.forward(shard(x1, group.rank()), true).pow(2).mean().backward();
    ddp.forward(shard(x2, group.rank()), true).abs().mean().backward();
    got[group.rank()] = snapshot(*model);
    opt.step();
    got[group.rank()].values = snapshot(*model).values;
  });
  auto oracle = models.back();
  torch::optim::SGD opt(oracle->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  opt.zero_grad();
  oracle->forward(x1, true).pow(2).mean().backward();
  oracle->forward(x2, true).abs().mean().backward();
  Snapshot expected = snapshot(*oracle);
  opt.step();
  expected.values = snapshot(*oracle).values;
  expect_oracle(got, expected);
}

// float32 and float64 parameters: a bucket each.
struct TwoTypesImpl : torch::nn::Module {
  TwoTypesImpl() {
    single = register_module("single", torch::nn::Linear(4, 3));
    dual = register_module("dual", torch::nn::Linear(3, 2));
    dual->to(torch::kFloat64);
  }
  torch::Tensor forward(const torch::Tensor& x) { return dual(torch::tanh(single(x)).to(torch::kFloat64)); }
  torch::nn::Linear single{nullptr}, dual{nullptr};
};
TORCH_MODULE(TwoTypes);

TEST(Library, ParametersOfTwoDtypesGoInBucketsOfTheirOwn) {
  auto models = replicas<TwoTypesImpl>(51);
  torch::manual_seed(52);
  const auto x = torch::randn({6, 4});
  std::vector<Snapshot> got(kWorld);
  std::map<std::string, Snapshot> by_hook;
  for (const std::string hook : {"none", "fp16"}) {
    run_ranks(kWorld, [&](ProcessGroup& group) {
      auto model = models[group.rank()];
      model->zero_grad();
      DistributedDataParallel ddp(model, group);
      if (hook == "fp16") ddp.register_comm_hook(hooks::fp16_compress());
      const auto& buckets = reducer_of(ddp).buckets();
      ASSERT_EQ(buckets.size(), 2u);
      EXPECT_EQ(buckets[0].buffer().scalar_type(), torch::kFloat64);
      EXPECT_EQ(buckets[1].buffer().scalar_type(), torch::kFloat32);
      ddp.forward(shard(x, group.rank())).pow(2).mean().backward();
      got[group.rank()] = snapshot(*model);
    });
    auto oracle = models.back();
    oracle->zero_grad();
    oracle->forward(x).pow(2).mean().backward();
    expect_oracle(got, snapshot(*oracle), hook == "fp16" ? 2e-3 : 1e-6);
    by_hook[hook] = got[0];
  }
  // fp16 sent both buckets rounded to float16: every gradient of the float64
  // and of the float32 layer differs from the exact sums somewhere.
  const Snapshot& none = by_hook["none"];
  const Snapshot& fp16 = by_hook["fp16"];
  for (size_t i = 0; i < none.grads.size(); ++i)
    EXPECT_GT(max_abs_diff(fp16.grads[i].to(torch::kFloat64), none.grads[i].to(torch::kFloat64)), 0)
        << "gradient " << i << " was not compressed";
}

// Every buffer of `m` (running mean and variance, batches tracked), as float64, end to end.
torch::Tensor every_buffer(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (const auto& b : m.buffers()) parts.push_back(b.detach().to(torch::kFloat64).reshape(-1));
  return torch::cat(parts);
}

// BatchNorm's running statistics without SyncBatchNorm: rank 0's before
// every training forward (broadcast_buffers), or each rank's own.
struct PlainNormImpl : torch::nn::Module {
  PlainNormImpl() {
    fc = register_module("fc", torch::nn::Linear(3, 4));
    bn = register_module("bn", torch::nn::BatchNorm1d(4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return bn(fc(x)); }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(PlainNorm);

TEST(Library, BuffersComeFromRank0BeforeEachForwardOrStayEachRanksOwn) {
  torch::manual_seed(62);
  const auto x1 = torch::randn({8, 3}), x2 = torch::randn({8, 3});
  for (bool broadcast : {true, false}) {
    auto models = replicas<PlainNormImpl>(61);
    std::vector<torch::Tensor> means(kWorld);  // every buffer, end to end
    run_ranks(kWorld, [&](ProcessGroup& group) {
      auto model = models[group.rank()];
      DistributedDataParallel ddp(model, group, DdpOptions().broadcast_buffers(broadcast));
      ddp.forward(shard(x1, group.rank())).sum().backward();
      ddp.forward(shard(x2, group.rank())).sum().backward();
      means[group.rank()] = every_buffer(*model);
    });
    // One BatchNorm1d replays what each rank's saw.
    for (int r = 0; r < kWorld; ++r) {
      auto oracle = models.back();
      torch::NoGradGuard no_grad;
      oracle->bn->running_mean.zero_();
      oracle->bn->running_var.fill_(1);
      oracle->bn->num_batches_tracked.zero_();
      oracle->forward(shard(x1, broadcast ? 0 : r));
      oracle->forward(shard(x2, r));
      EXPECT_LE(max_abs_diff(means[r], every_buffer(*oracle)), 1e-6) << "rank " << r << " broadcast " << broadcast;
    }
    EXPECT_EQ(torch::equal(means[0], means[1]), false) << "after its forward, each rank holds its own statistics";
  }
}

// SyncBatchNorm wherever the forward finds its norm layers: a Sequential's,
// 1d, 2d and 3d, and one a model declares itself.
struct NormsImpl : torch::nn::Module {
  NormsImpl() {
    seq = register_module("seq", torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 3, 3)),
                                                        torch::nn::BatchNorm2d(3), torch::nn::ReLU()));
    register_module("norm3d", torch::nn::BatchNorm3d(3));
    fc = register_module("fc", torch::nn::Linear(3 * 4 * 4, 5));
    register_module("norm1d", torch::nn::BatchNorm1d(5));
    own = register_module("own", SyncBatchNorm(5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = seq->forward(x);                                                   // [N, 3, 4, 4]
    h = call("norm3d", h.unsqueeze(2)).squeeze(2);                             // 3d over [N, 3, 1, 4, 4]
    h = call("norm1d", fc(h.flatten(1)));
    return call("own", h);
  }
  // A child looked up by name, as the forward of a model that converts finds it.
  torch::Tensor call(const std::string& name, const torch::Tensor& x) {
    const auto layer = named_children()[name];
    if (auto* sync = layer->as<SyncBatchNormImpl>()) return sync->forward(x);
    if (auto* bn = layer->as<torch::nn::BatchNorm1dImpl>()) return bn->forward(x);
    return layer->as<torch::nn::BatchNorm3dImpl>()->forward(x);
  }
  torch::nn::Sequential seq{nullptr};
  torch::nn::Linear fc{nullptr};
  SyncBatchNorm own{nullptr};
};
TORCH_MODULE(Norms);

TEST(Library, ConvertedNormLayersOfEveryKindMatchBatchNormOnTheWholeBatch) {
  auto models = replicas<NormsImpl>(71);
  torch::manual_seed(72);
  const auto x = torch::randn({8, 1, 6, 6});
  std::vector<Snapshot> got(kWorld);
  std::vector<torch::Tensor> stats(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    convert_sync_batchnorm(model);  // no group: DDP binds its own
    EXPECT_TRUE(model->seq[1]->as<SyncBatchNormImpl>()) << "the Sequential runs the SyncBatchNorm";
    EXPECT_TRUE(model->named_children()["norm1d"]->as<SyncBatchNormImpl>());
    DistributedDataParallel ddp(model, group);
    ddp.forward(shard(x, group.rank())).pow(2).mean().backward();
    got[group.rank()] = snapshot(*model);
    std::vector<torch::Tensor> buffers;
    for (const auto& b : model->buffers()) buffers.push_back(b.to(torch::kFloat64).reshape(-1));
    stats[group.rank()] = torch::cat(buffers);
  });
  // The oracle: plain BatchNorms, its own SyncBatchNorm too (weights copied).
  auto oracle = models.back();
  torch::nn::BatchNorm1d own_oracle(5);
  {
    torch::NoGradGuard no_grad;
    own_oracle->weight.copy_(oracle->own->weight);
    own_oracle->bias.copy_(oracle->own->bias);
  }
  oracle->replace_module("own", own_oracle);
  oracle->forward(x).pow(2).mean().backward();
  expect_oracle(got, snapshot(*oracle), 1e-5);
  std::vector<torch::Tensor> buffers;
  for (const auto& b : oracle->buffers()) buffers.push_back(b.to(torch::kFloat64).reshape(-1));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_LE(max_abs_diff(stats[r], torch::cat(buffers)), 1e-5) << "rank " << r;
    EXPECT_TRUE(torch::equal(stats[r], stats[0])) << "rank " << r << "'s running statistics";
  }
}

// A member handle the forward calls: no conversion can re-point it.
struct MemberNormImpl : torch::nn::Module {
  MemberNormImpl() { bn = register_module("bn", torch::nn::BatchNorm2d(6)); }
  torch::Tensor forward(const torch::Tensor& x) { return bn(x); }
  torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(MemberNorm);

struct ListNormImpl : torch::nn::Module {
  ListNormImpl() { layers = register_module("layers", torch::nn::ModuleList(torch::nn::BatchNorm1d(2))); }
  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(ListNorm);

// Both kinds in one model, and one the conversion reaches: every layer it
// cannot reach is named in one message, and nothing is changed.
struct ManyNormsImpl : torch::nn::Module {
  ManyNormsImpl() {
    bn = register_module("bn", torch::nn::BatchNorm2d(6));
    layers = register_module("layers", torch::nn::ModuleList(torch::nn::BatchNorm1d(2)));
    fine = register_module("fine", torch::nn::Sequential(torch::nn::BatchNorm1d(3)));
  }
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::Sequential fine{nullptr};
};
TORCH_MODULE(ManyNorms);

// What convert_sync_batchnorm refuses `model` with ("" where it does not).
template <typename Model>
std::string conversion_refusal(Model& model) {
  try {
    convert_sync_batchnorm(model);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(Library, ANormLayerTheConversionCannotReachIsRefusedNamingItAndNothingChanges) {
  MemberNorm member;
  std::string error = conversion_refusal(member);
  EXPECT_NE(error.find("convert_sync_batchnorm: 1 layer "), std::string::npos) << error;
  EXPECT_NE(error.find("bn (a torch::nn::BatchNorm2d also held by a member"), std::string::npos) << error;
  EXPECT_NE(error.find("mnist_ddp::SyncBatchNorm(6)"), std::string::npos) << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  EXPECT_TRUE(member->named_children()["bn"]->as<torch::nn::BatchNorm2dImpl>()) << "the model was changed";

  ListNorm list;
  error = conversion_refusal(list);
  EXPECT_NE(error.find("layers.0 (a torch::nn::BatchNorm1d in a torch::nn::ModuleList"), std::string::npos) << error;
  EXPECT_TRUE(list->layers[0]->as<torch::nn::BatchNorm1dImpl>());

  ManyNorms many;
  error = conversion_refusal(many);
  EXPECT_NE(error.find("convert_sync_batchnorm: 2 layers "), std::string::npos) << error;
  EXPECT_NE(error.find("bn (a torch::nn::BatchNorm2d"), std::string::npos) << error;
  EXPECT_NE(error.find("layers.0 (a torch::nn::BatchNorm1d"), std::string::npos) << error;
  EXPECT_EQ(error.find("fine"), std::string::npos) << "a layer the conversion reaches is named: " << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  EXPECT_TRUE(many->fine[0]->as<torch::nn::BatchNorm1dImpl>()) << "a layer was converted though others were refused";
}

// A program's own hook: a subclass of CommHook, registered as the built-in ones.
class CountingHook : public hooks::CommHook {
 public:
  std::string name() const override { return "counting"; }
  FuturePtr run(const hooks::GradBucket& bucket, hooks::Wire& wire) override {
    ++buckets;
    return wire.allreduce_mean(bucket.buffer());
  }
  int buckets = 0;
};

TEST(Library, AProgramsOwnHookRunsOncePerBucketAndBackward) {
  auto models = replicas<BranchImpl>(81);
  torch::manual_seed(82);
  const auto x = torch::randn({4, 4});
  std::vector<Snapshot> got(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    DistributedDataParallel ddp(model, group, DdpOptions().bucket_cap_mb(1e-6));  // a bucket a parameter
    auto hook = std::make_shared<CountingHook>();
    ddp.register_comm_hook(hook);
    EXPECT_THROW(ddp.register_comm_hook(hooks::allreduce()), UsageError) << "a second hook";
    ddp.forward(shard(x, group.rank()), true).pow(2).mean().backward();
    EXPECT_EQ(hook->buckets, 4);
    got[group.rank()] = snapshot(*model);
  });
  auto oracle = models.back();
  oracle->forward(x, true).pow(2).mean().backward();
  expect_oracle(got, snapshot(*oracle));
}

// examples/topk.hpp, a hook written as a program writes one, on 3 ranks
// against its exact math in one process: each rank sends the k largest
// entries of its gradient plus its error (values and indices, through the
// Wire's allgather) and keeps the rest as its error; the average is the
// sum of every rank's entries in rank order over the world size. Float64,
// so that no near tie can pick other entries. The hook sees its bucket's
// parameters and their names.
TEST(Library, ATopKHookOverAllgatherMatchesItsExactMathOnThreeRanks) {
  constexpr int kRanks = 3, kSteps = 3;
  const double lr = 0.1;
  torch::manual_seed(91);
  auto start = std::make_shared<torch::nn::LinearImpl>(6, 4);
  start->to(torch::kFloat64);
  const auto x = torch::randn({kRanks * 5, 6}, torch::kFloat64), y = torch::randn({kRanks * 5, 4}, torch::kFloat64);
  auto part = [&](const torch::Tensor& t, int r) { return t.slice(0, 5 * r, 5 * (r + 1)); };
  std::vector<std::vector<torch::Tensor>> got(kRanks);  // each rank's parameters after the steps
  std::vector<std::string> layout;                       // the bucket's parameter names, in bucket order
  std::mutex mutex;
  run_ranks(kRanks, [&](ProcessGroup& group) {
    std::shared_ptr<torch::nn::LinearImpl> model;
    {
      std::lock_guard<std::mutex> lock(mutex);
      model = std::dynamic_pointer_cast<torch::nn::LinearImpl>(start->clone());
    }
    DistributedDataParallel ddp(model, group);
    ddp.register_comm_hook(std::make_shared<TopKHook>(0.25));
    const auto& bucket = reducer_of(ddp).buckets().at(0);
    ASSERT_EQ(bucket.parameters().size(), 2u);
    for (size_t i = 0; i < 2; ++i)
      EXPECT_TRUE(bucket.parameters()[i].is_same(bucket.parameter_names()[i] == "weight" ? model->weight : model->bias))
          << bucket.parameter_names()[i];
    torch::optim::SGD sgd(model->parameters(), lr);
    for (int step = 0; step < kSteps; ++step) {
      sgd.zero_grad();
      torch::mse_loss(ddp.forward(part(x, group.rank())), part(y, group.rank())).backward();
      sgd.step();
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (group.rank() == 0) layout = bucket.parameter_names();
    for (const auto& p : model->parameters()) got[group.rank()].push_back(p.detach().clone());
  });
  ASSERT_EQ(layout.size(), 2u);
  // The oracle: one model, each rank's gradient on its part, top-k by hand.
  auto oracle = std::dynamic_pointer_cast<torch::nn::LinearImpl>(start->clone());
  std::vector<torch::Tensor> error(kRanks);
  for (int step = 0; step < kSteps; ++step) {
    torch::Tensor sum;
    for (int r = 0; r < kRanks; ++r) {
      oracle->zero_grad();
      torch::mse_loss(oracle->forward(part(x, r)), part(y, r)).backward();
      std::vector<torch::Tensor> flat;
      for (const auto& name : layout) flat.push_back((name == "weight" ? oracle->weight : oracle->bias).grad().reshape(-1));
      torch::Tensor m = torch::cat(flat);
      if (error[r].defined()) m = error[r] + m;
      const int64_t k = static_cast<int64_t>(std::ceil(0.25 * static_cast<double>(m.numel())));
      const auto indices = std::get<1>(m.abs().topk(k));
      if (!sum.defined()) sum = torch::zeros_like(m);
      sum.index_add_(0, indices, m.index_select(0, indices));
      error[r] = m.index_fill(0, indices, 0);
    }
    const torch::Tensor average = sum / kRanks;
    torch::NoGradGuard no_grad;
    int64_t at = 0;
    for (const auto& name : layout) {
      torch::Tensor p = name == "weight" ? oracle->weight : oracle->bias;
      p.add_(average.slice(0, at, at + p.numel()).view_as(p), -lr);
      at += p.numel();
    }
  }
  const auto expected = oracle->parameters();
  for (int r = 0; r < kRanks; ++r)
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_LE(max_abs_diff(got[r][i], expected[i]), 1e-12) << "rank " << r << " parameter " << i;
      EXPECT_TRUE(torch::equal(got[r][i], got[0][i])) << "replica " << r << " parameter " << i;
    }
  EXPECT_GT(max_abs_diff(got[0][0], start->weight), 0) << "the steps changed nothing";
}

// PowerSGD's state saved with torch::save and loaded with torch::load into
// a new hook: the resumed run continues exactly as the straight one.
TEST(Library, AHooksStateSavedWithTorchSaveResumesExactly) {
  test::TempDir dir;
  torch::manual_seed(92);
  std::vector<torch::Tensor> xs, ys;
  for (int s = 0; s < 6; ++s) {
    xs.push_back(torch::randn({8, 4}));
    ys.push_back(torch::randn({8, 5}));
  }
  const auto options =
      hooks::PowerSgdOptions().matrix_approximation_rank(1).start_powersgd_iter(2).min_compression_rate(0.1);
  auto models = replicas<TwoWayImpl>(91), copies = replicas<TwoWayImpl>(91);
  std::vector<torch::Tensor> straight(kWorld), resumed(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& group) {
    const int r = group.rank();
    const std::string file = dir / ("hook" + std::to_string(r) + ".pt");
    auto steps = [&](DistributedDataParallel<TwoWayImpl>& ddp, int from, int to) {
      for (int s = from; s < to; ++s) {
        ddp->zero_grad();
        two_way_loss(ddp.forward(shard(xs[s], r), shard(ys[s], r))).backward();
        torch::NoGradGuard no_grad;
        for (auto& p : ddp->parameters())
          if (p.requires_grad()) p.sub_(p.grad() * 0.1);
      }
    };
    auto flat = [](torch::nn::Module& m) {
      std::vector<torch::Tensor> parts;
      for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape(-1).clone());
      return torch::cat(parts);
    };
    {
      auto psgd = hooks::powersgd(options);
      DistributedDataParallel ddp(models[r], group);
      ddp.register_comm_hook(hooks::fp16_compress_wrapper(psgd));
      steps(ddp, 0, 3);
      torch::save(ddp.comm_hook(), file);
      {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < models[r]->parameters().size(); ++i)
          copies[r]->parameters()[i].copy_(models[r]->parameters()[i]);
      }
      steps(ddp, 3, 6);
      EXPECT_GT(psgd->compression_stats().first, 0) << "PowerSGD never compressed";
      straight[r] = flat(*models[r]);
    }
    {
      DistributedDataParallel ddp(copies[r], group);
      auto hook = hooks::fp16_compress_wrapper(hooks::powersgd(options));
      torch::load(*hook, file);
      ddp.register_comm_hook(hook);
      steps(ddp, 3, 6);
      resumed[r] = flat(*copies[r]);
    }
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(torch::equal(resumed[r], straight[r])) << "rank " << r;
    EXPECT_TRUE(torch::equal(straight[r], straight[0])) << "rank " << r;
  }
  // Another hook's state is refused, naming both.
  auto other = hooks::powersgd(options);
  try {
    torch::load(*other, dir / "hook0.pt");
    ADD_FAILURE() << "loaded powersgd_fp16's state into powersgd";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("powersgd_fp16"), std::string::npos) << e.what();
  }
}

// float16's loss scale, agreed: an inf in one rank's gradient at step 2,
// put there after backward (so DDP's averaging never carried it), makes
// every rank skip that step and halve its scale, under plain averaging and
// under PowerSGD: only the scaler's own agreement can tell rank 0. The
// replicas end identical and finite.
TEST(Library, AnInfOnOneRankMakesEveryRankSkipTheStepAlike) {
  torch::manual_seed(102);
  std::vector<torch::Tensor> xs;
  for (int s = 0; s < 5; ++s) xs.push_back(torch::randn({8, 4}));
  for (const std::string hook : {"none", "powersgd"}) {
    SCOPED_TRACE(hook);
    auto models = replicas<BranchImpl>(101);
    std::vector<torch::Tensor> final(kWorld);
    std::vector<std::vector<double>> scales(kWorld);
    std::vector<int64_t> skipped(kWorld);
    run_ranks(kWorld, [&](ProcessGroup& group) {
      auto model = models[group.rank()];
      DistributedDataParallel ddp(model, group);
      if (hook == "powersgd")
        ddp.register_comm_hook(hooks::powersgd(
            hooks::PowerSgdOptions().start_powersgd_iter(2).min_compression_rate(0.1).use_error_feedback(true)));
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      GradScaler scaler(group, GradScalerOptions().init_scale(1024).growth_interval(2));
      for (int s = 0; s < 5; ++s) {
        opt.zero_grad();
        auto loss = ddp.forward(shard(xs[s], group.rank()), true).pow(2).mean();
        scaler.scale(loss).backward();
        if (s == 2 && group.rank() == 1) {
          torch::NoGradGuard no_grad;
          model->parameters()[0].mutable_grad().view(-1)[0].fill_(std::numeric_limits<float>::infinity());
        }
        const bool stepped = scaler.step(opt);
        EXPECT_EQ(stepped, s != 2) << "step " << s;
        scaler.update();
        scales[group.rank()].push_back(scaler.get_scale());
      }
      skipped[group.rank()] = scaler.skipped_steps();
      std::vector<torch::Tensor> parts;
      for (const auto& p : model->parameters()) parts.push_back(p.detach().reshape(-1).clone());
      final[group.rank()] = torch::cat(parts);
    });
    // 1024 -> 2048 after two good steps, 1024 on the skip, 2048 two good steps later.
    EXPECT_EQ(scales[0], (std::vector<double>{1024, 2048, 1024, 1024, 2048}));
    EXPECT_EQ(scales[1], scales[0]);
    EXPECT_EQ(skipped[0], 1);
    EXPECT_EQ(skipped[1], 1);
    EXPECT_TRUE(torch::isfinite(final[0]).all().item<bool>());
    EXPECT_TRUE(torch::equal(final[0], final[1])) << "the replicas differ";
  }
}

// GradScalers made with other options are named at their first step(),
// on every rank, in one line.
TEST(Library, GradScalersOfOtherOptionsAreNamedAtTheirFirstStep) {
  auto models = replicas<BranchImpl>(103);
  std::vector<std::string> said(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    DistributedDataParallel ddp(model, group);
    torch::optim::SGD opt(model->parameters(), 0.1);
    GradScaler scaler(group, GradScalerOptions().growth_interval(group.rank() == 1 ? 100 : 2000));
    scaler.scale(ddp.forward(shard(torch::ones({8, 4}), group.rank()), true).pow(2).mean()).backward();
    try {
      scaler.step(opt);
    } catch (const UsageError& e) {
      said[group.rank()] = e.what();
    }
  });
  for (const auto& s : said)
    EXPECT_EQ(s, "GradScaler: rank 1's options is init_scale 65536, growth_factor 2, backoff_factor 0.5, "
                 "growth_interval 100, rank 0's is init_scale 65536, growth_factor 2, backoff_factor 0.5, "
                 "growth_interval 2000: every rank must make its GradScaler with the same options and state");
}

// Runs `lin` again in its backward and backpropagates through it there, a
// reentrant backward (as activation checkpointing does): lin's parameters
// get one more gradient from inside the outer backward.
struct Recomputed : torch::autograd::Function<Recomputed> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& anchor, torch::nn::LinearImpl* lin) {
    ctx->saved_data["lin"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(lin));
    ctx->saved_data["x"] = x.detach();
    torch::NoGradGuard no_grad;
    return lin->forward(x) + anchor;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* lin = reinterpret_cast<torch::nn::LinearImpl*>(static_cast<intptr_t>(ctx->saved_data["lin"].toInt()));
    torch::AutoGradMode enabled(true);
    torch::autograd::backward({lin->forward(ctx->saved_data["x"].toTensor())}, {grads[0]});
    return {torch::Tensor(), grads[0].sum().reshape({1}), torch::Tensor()};
  }
};

// static_graph where a parameter gets two gradients a step (one from a
// reentrant backward) averages as one process; a later step that gives it
// three, or one, is refused naming it.
TEST(Library, StaticGraphCountsEachParametersGradientsAndNamesAnotherCount) {
  struct ReentrantImpl : torch::nn::Module {
    ReentrantImpl() {
      lin = register_module("lin", torch::nn::Linear(4, 4));
      anchor = register_parameter("anchor", torch::zeros({1}));
    }
    torch::Tensor forward(const torch::Tensor& x, int64_t recomputed) {
      torch::Tensor y = lin(x);
      for (int64_t i = 0; i < recomputed; ++i) y = y + Recomputed::apply(x, anchor, lin.get());
      return y.pow(2).mean();
    }
    torch::nn::Linear lin{nullptr};
    torch::Tensor anchor;
  };
  auto models = replicas<ReentrantImpl>(104);
  torch::manual_seed(105);
  const auto x = torch::randn({8, 4});
  std::vector<Snapshot> first(kWorld);
  std::vector<std::string> more(kWorld), fewer(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    for (const int64_t later : {2, 0}) {
      DistributedDataParallel ddp(model, group, DdpOptions().static_graph(true));
      model->zero_grad();
      ddp.forward(shard(x, group.rank()), int64_t{1}).backward();
      if (later == 2) first[group.rank()] = snapshot(*model);
      try {
        ddp.forward(shard(x, group.rank()), later).backward();
        ddp.forward(shard(x, group.rank()), int64_t{1});
      } catch (const std::exception& error) {
        (later == 2 ? more : fewer)[group.rank()] = error.what();
      }
    }
  });
  auto oracle = models[kWorld];
  ((oracle->forward(shard(x, 0), 1) + oracle->forward(shard(x, 1), 1)) / kWorld).backward();
  expect_oracle(first, snapshot(*oracle));
  for (int r = 0; r < kWorld; ++r) {
    // lin.bias or lin.weight, whichever the autograd engine reaches first
    EXPECT_EQ(more[r].rfind("DistributedDataParallel: parameter lin.", 0), 0u) << more[r];
    EXPECT_NE(more[r].find(" received 3 gradients in this step, 2 in the first: with static_graph the graph must be "
                           "the same every step"),
              std::string::npos)
        << more[r];
    EXPECT_EQ(fewer[r], "DistributedDataParallel: the last backward ended before these parameters received as many "
                        "gradients as in the first step: anchor lin.weight lin.bias; every parameter must take part in "
                        "the loss, or construct DDP with DdpOptions().find_unused_parameters(true)");
  }
}

// Autocast lowers what its scope computes to bfloat16 (and float16 where
// this LibTorch's CPU autocast has it, else says why not), nests, and puts
// the state before back; the parameters' gradients stay float32 and agree
// across ranks.
TEST(Library, AutocastLowersTheForwardAndTheGradientsStayFloat32) {
  const torch::Device cpu(torch::kCPU);
  EXPECT_EQ(autocast_unsupported(cpu, torch::kBFloat16), "");
  const std::string half = autocast_unsupported(cpu, torch::kHalf);
  EXPECT_TRUE(half.empty() || half == "this LibTorch's CPU autocast has no float16") << half;
  const auto a = torch::ones({2, 2});
  {
    Autocast outer(cpu, torch::kBFloat16);
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
    if (half.empty()) {
      Autocast inner(cpu, torch::kHalf);
      EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kHalf);
    }
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
  }
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kFloat32);

  torch::manual_seed(103);
  const auto x = torch::randn({8, 4});
  auto models = replicas<BranchImpl>(104);
  std::vector<torch::Tensor> grads(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    DistributedDataParallel ddp(model, group);
    torch::Tensor loss;
    {
      Autocast autocast(group.device(), torch::kBFloat16);
      const auto out = ddp.forward(shard(x, group.rank()), true);
      EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
      loss = out.to(torch::kFloat32).pow(2).mean();
    }
    loss.backward();
    std::vector<torch::Tensor> parts;
    for (const auto& p : model->parameters()) {
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat32);
      parts.push_back(p.grad().reshape(-1).clone());
    }
    grads[group.rank()] = torch::cat(parts);
  });
  EXPECT_TRUE(torch::equal(grads[0], grads[1]));
}

}  // namespace
}  // namespace mnist_ddp

namespace mnist_ddp {
namespace {

// Registered a then b, run b then a: the gradients become ready in another
// order than the buckets' first (reverse registration), so static_graph's
// rebuild changes which parameters each bucket holds.
struct CrossedImpl : torch::nn::Module {
  CrossedImpl() {
    a = register_module("a", torch::nn::Linear(8, 8));
    b = register_module("b", torch::nn::Linear(4, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return a(torch::relu(b(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

// A new model holding `from`'s values (a module's copy would share its tensors).
std::shared_ptr<CrossedImpl> copy_of(CrossedImpl& from) {
  auto to = std::make_shared<CrossedImpl>();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < to->parameters().size(); ++i) to->parameters()[i].copy_(from.parameters()[i]);
  return to;
}

// static_graph rebuilds its buckets after the first step, and PowerSGD
// keeps its state (error feedback, P and Q) by bucket. Its state saved
// names the buckets it was kept for: a run resumed from it lays out its
// buckets as the saved run's from its first step, and ends bit-identical
// to the run never stopped (before, its first step ran the first layout
// against the rebuilt one's state: the errors, of equal sizes, landed on
// other gradients).
TEST(Library, AStaticGraphUnderPowerSgdResumedFromItsSavedHookEndsAsTheStraightRun) {
  const auto options = DdpOptions().static_graph(true).bucket_cap_mb(1e-6).first_bucket_cap_mb(1e-6);
  const auto powersgd = hooks::PowerSgdOptions().start_powersgd_iter(2).min_compression_rate(0.1);
  auto train = [&](ProcessGroup& group, std::shared_ptr<CrossedImpl> model, std::shared_ptr<hooks::PowerSgdHook> hook,
                   int from, int to) {
    DistributedDataParallel ddp(model, group, options);
    ddp.register_comm_hook(hook);
    torch::optim::SGD sgd(model->parameters(), 0.1);
    for (int k = from; k < to; ++k) {
      torch::Tensor x;
      {
        static std::mutex mutex;
        std::lock_guard<std::mutex> lock(mutex);
        torch::manual_seed(1000 * group.rank() + k);
        x = torch::randn({6, 4});
      }
      sgd.zero_grad();
      ddp.forward(x).pow(2).mean().backward();
      sgd.step();
    }
  };
  auto models = replicas<CrossedImpl>(61);
  std::vector<torch::Tensor> straight(kWorld), resumed(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& group) {
    auto model = copy_of(*models[group.rank()]);
    train(group, model, hooks::powersgd(powersgd), 0, 6);
    straight[group.rank()] = torch::cat({model->a->weight.reshape(-1), model->b->weight.reshape(-1)}).detach().clone();
  });
  run_ranks(kWorld, [&](ProcessGroup& group) {
    auto first = copy_of(*models[group.rank()]);
    auto hook = hooks::powersgd(powersgd);
    train(group, first, hook, 0, 3);
    const hooks::HookState saved = hook->state();
    auto again = copy_of(*first);  // as a new process would: a new model, hook and DDP
    auto loaded = hooks::powersgd(powersgd);
    loaded->load_state(saved);
    train(group, again, loaded, 3, 6);
    resumed[group.rank()] = torch::cat({again->a->weight.reshape(-1), again->b->weight.reshape(-1)}).detach().clone();
  });
  for (int r = 0; r < kWorld; ++r)
    EXPECT_TRUE(torch::equal(resumed[r], straight[r])) << "rank " << r << ": resumed differs from the straight run by "
                                                       << max_abs_diff(resumed[r], straight[r]);
}

// A state kept for other buckets (another bucket_cap_mb) is refused by
// name, not applied to other gradients.
TEST(Library, AHookStateKeptForOtherBucketsIsRefusedByName) {
  const auto powersgd = hooks::PowerSgdOptions().start_powersgd_iter(2).min_compression_rate(0.1);
  auto models = replicas<CrossedImpl>(62);
  std::vector<std::string> said(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    hooks::HookState saved;
    {
      DistributedDataParallel ddp(model, group, DdpOptions().bucket_cap_mb(1e-6).first_bucket_cap_mb(1e-6));
      auto hook = hooks::powersgd(powersgd);
      ddp.register_comm_hook(hook);
      for (int k = 0; k < 3; ++k) ddp.forward(torch::ones({2, 4})).sum().backward();
      saved = hook->state();
    }
    DistributedDataParallel ddp(model, group);  // one bucket
    auto hook = hooks::powersgd(powersgd);
    hook->load_state(saved);
    ddp.register_comm_hook(hook);
    try {
      ddp.forward(torch::ones({2, 4})).sum().backward();
    } catch (const UsageError& e) {
      said[group.rank()] = e.what();
    }
  });
  for (int r = 0; r < kWorld; ++r)
    EXPECT_EQ(said[r], "register_comm_hook: the hook's state was kept for other buckets (its bucket 0: b.bias; this "
                       "DistributedDataParallel's: b.bias b.weight a.bias a.weight): resume with the model, "
                       "bucket_cap_mb and static_graph it was saved with")
        << "rank " << r;
}

}  // namespace
}  // namespace mnist_ddp
