// What PyTorch's own DDP tests check (torch/testing/_internal/distributed/
// distributed_test.py, test_c10d_common.py, test_c10d_gloo.py), as C++
// programs against the library's API: each behaviour on 2 ranks (3 where
// PyTorch's test uses more), against one process on the concatenated batch
// or PyTorch's stated semantics.
#include <gtest/gtest.h>

#include <dirent.h>
#include <unistd.h>

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <mutex>
#include <tuple>

#include "comm/group.hpp"
#include "mnist_ddp/ddp.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace pytorch_behaviours {  // named: a unity batch shares one anonymous namespace

using namespace std::chrono_literals;
using test::expect_oracle;
using test::max_abs_diff;
using test::run_ranks;
using test::Snapshot;
using test::snapshot;
using test::Sums;

// Two outputs from two sub-modules (PyTorch's test_multiple_outputs_multiple_backward).
struct TwoOutputsImpl : torch::nn::Module {
  TwoOutputsImpl() {
    first = register_module("first", torch::nn::Linear(4, 3));
    second = register_module("second", torch::nn::Linear(4, 3));
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x) { return {first(x), second(x)}; }
  torch::nn::Linear first{nullptr}, second{nullptr};
};

// Each output's loss gets its own backward: the step's gradients are
// averaged once, when the second backward completes them, with and without
// find_unused_parameters, and equal one process's on the concatenated batch.
TEST(PyTorchDdp, TwoOutputsEachWithItsOwnBackwardAverageAsOneProcess) {
  for (const bool find_unused : {false, true}) {
    auto models = test::replicas<TwoOutputsImpl>(41, 2);
    torch::manual_seed(42);
    const auto x = torch::randn({8, 4});
    std::vector<Snapshot> got(2);
    run_ranks(2, [&](ProcessGroup& group) {
      auto model = models[group.rank()];
      DistributedDataParallel ddp(model, group, DdpOptions().find_unused_parameters(find_unused));
      for (int step = 0; step < 2; ++step) {  // twice: the second step opens where the first closed
        model->zero_grad();
        auto [a, b] = ddp.forward(test::shard(x, group.rank(), 2));
        a.pow(2).mean().backward();
        b.pow(2).mean().backward();
      }
      got[group.rank()] = snapshot(*model);
    });
    auto oracle = models[2];
    oracle->zero_grad();
    torch::Tensor loss = torch::zeros({});
    for (int r = 0; r < 2; ++r) {
      auto [a, b] = oracle->forward(test::shard(x, r, 2));
      loss = loss + (a.pow(2).mean() + b.pow(2).mean()) / 2;
    }
    loss.backward();
    expect_oracle(got, snapshot(*oracle));
  }
}

// With find_unused_parameters, an output the loss leaves out is fine, as
// in PyTorch: its parameters' .grad stays undefined, the others' are the
// oracle's average, and the next forward goes on.
TEST(PyTorchDdp, AnOutputTheLossLeavesOutWithFindUnusedParametersLeavesItsGradientsUndefined) {
  auto models = test::replicas<TwoOutputsImpl>(43, 2);
  torch::manual_seed(44);
  const auto x = torch::randn({8, 4});
  std::vector<Snapshot> got(2);
  run_ranks(2, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    DistributedDataParallel ddp(model, group, DdpOptions().find_unused_parameters(true));
    for (int step = 0; step < 2; ++step) {  // the second forward finds nothing left open
      model->zero_grad();
      auto [a, b] = ddp.forward(test::shard(x, group.rank(), 2));
      a.pow(2).mean().backward();
    }
    got[group.rank()] = snapshot(*model);
  });
  auto oracle = models[2];
  oracle->zero_grad();
  torch::Tensor loss = torch::zeros({});
  for (int r = 0; r < 2; ++r) loss = loss + std::get<0>(oracle->forward(test::shard(x, r, 2))).pow(2).mean() / 2;
  loss.backward();
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(models[r]->second->weight.grad().defined()) << "rank " << r;
    EXPECT_FALSE(models[r]->second->bias.grad().defined()) << "rank " << r;
  }
  expect_oracle(got, snapshot(*oracle));
}

// .grad stays undefined after a forward, until a backward writes it (as
// PyTorch's test_ddp_grad_is_none... checks); one no rank used stays
// undefined after the backward too.
TEST(PyTorchDdp, GradientsAreUndefinedUntilABackwardWritesThem) {
  struct WithSpareImpl : torch::nn::Module {
    WithSpareImpl() {
      used = register_module("used", torch::nn::Linear(4, 2));
      spare = register_module("spare", torch::nn::Linear(4, 2));
    }
    torch::Tensor forward(const torch::Tensor& x) { return used(x); }
    torch::nn::Linear used{nullptr}, spare{nullptr};
  };
  std::vector<std::vector<bool>> after_forward(2), after_backward(2);
  run_ranks(2, [&](ProcessGroup& group) {
    auto model = std::make_shared<WithSpareImpl>();
    DistributedDataParallel ddp(model, group, DdpOptions().find_unused_parameters(true));
    const auto out = ddp.forward(torch::ones({2, 4}));
    for (const auto& p : model->parameters()) after_forward[group.rank()].push_back(p.grad().defined());
    out.sum().backward();
    for (const auto& p : model->parameters()) after_backward[group.rank()].push_back(p.grad().defined());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(after_forward[r], (std::vector<bool>{false, false, false, false})) << "rank " << r;
    EXPECT_EQ(after_backward[r], (std::vector<bool>{true, true, false, false})) << "rank " << r;
  }
}

TEST(PyTorchDdp, AModuleWithoutAParameterThatRequiresAGradientIsRefused) {
  std::vector<std::string> said(2);
  run_ranks(2, [&](ProcessGroup& group) {
    auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
    for (auto& p : model->parameters()) p.requires_grad_(false);
    try {
      DistributedDataParallel ddp(model, group);
    } catch (const UsageError& e) {
      said[group.rank()] = e.what();
    }
  });
  for (const auto& s : said)
    EXPECT_EQ(s, "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a "
                 "gradient");
}

// An Embedding and an EmbeddingBag with sparse(true), under the fp16 hook:
// their gradients stay sparse, averaged exactly, without the hook (the
// dense ones through it); join() refuses such a model.
TEST(PyTorchDdp, SparseGradientsAreAveragedAsSparseTensors) {
  struct BagImpl : torch::nn::Module {
    BagImpl() {
      embedding = register_module("embedding", torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 3).sparse(true)));
      bag = register_module("bag", torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(10, 3).sparse(true)));
      head = register_module("head", torch::nn::Linear(3, 1));
    }
    torch::Tensor forward(const torch::Tensor& ids) {
      return head(embedding(ids)).sum() + head(bag(ids.unsqueeze(0))).sum();
    }
    torch::nn::Embedding embedding{nullptr};
    torch::nn::EmbeddingBag bag{nullptr};
    torch::nn::Linear head{nullptr};
  };
  auto models = test::replicas<BagImpl>(43, 2);
  const std::vector<torch::Tensor> ids{torch::tensor({1, 2, 2}), torch::tensor({2, 7})};
  std::vector<torch::Tensor> embedding(2), bag(2), head(2);
  std::vector<std::string> joined(2);
  run_ranks(2, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    DistributedDataParallel ddp(model, group);
    ddp.register_comm_hook(hooks::fp16_compress());
    ddp.forward(ids[group.rank()]).backward();
    EXPECT_TRUE(model->embedding->weight.grad().is_sparse());
    EXPECT_TRUE(model->bag->weight.grad().is_sparse());
    embedding[group.rank()] = model->embedding->weight.grad().to_dense();
    bag[group.rank()] = model->bag->weight.grad().to_dense();
    head[group.rank()] = model->head->weight.grad().clone();
    try {
      ddp.join([] {});
    } catch (const UsageError& e) {
      joined[group.rank()] = e.what();
    }
  });
  auto oracle = models[2];
  ((oracle->forward(ids[0]) + oracle->forward(ids[1])) / 2).backward();
  for (int r = 0; r < 2; ++r) {
    EXPECT_LE(max_abs_diff(embedding[r], oracle->embedding->weight.grad().to_dense()), 1e-6) << "rank " << r;
    EXPECT_LE(max_abs_diff(bag[r], oracle->bag->weight.grad().to_dense()), 1e-6) << "rank " << r;
    EXPECT_LE(max_abs_diff(head[r], oracle->head->weight.grad()), 1e-2) << "rank " << r;  // through float16
    EXPECT_EQ(joined[r], "ddp.join(): a model with sparse gradients cannot be joined (a rank that ran out cannot "
                         "serve a sparse sum whose shape it does not know); give every rank as many batches");
  }
}

TEST(PyTorchDdp, ComplexParametersAreAveragedAsTheirRealAndImaginaryParts) {
  struct RotationImpl : torch::nn::Module {
    RotationImpl() { w = register_parameter("w", torch::randn({3, 3}, torch::kComplexFloat)); }
    torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x.to(torch::kComplexFloat), w).abs().sum(); }
    torch::Tensor w;
  };
  auto models = test::replicas<RotationImpl>(44, 2);
  torch::manual_seed(45);
  const auto x = torch::randn({4, 3});
  std::vector<torch::Tensor> grads(2), values(2);
  run_ranks(2, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    DistributedDataParallel ddp(model, group);
    ddp.forward(test::shard(x, group.rank(), 2)).backward();
    grads[group.rank()] = model->w.grad().clone();
    values[group.rank()] = model->w.detach().clone();
  });
  auto oracle = models[2];
  ((oracle->forward(test::shard(x, 0, 2)) + oracle->forward(test::shard(x, 1, 2))) / 2).backward();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(grads[r].is_complex());
    EXPECT_LE(max_abs_diff(torch::view_as_real(grads[r]), torch::view_as_real(oracle->w.grad())), 1e-5) << r;
    EXPECT_TRUE(torch::equal(values[r], oracle->w.detach())) << "rank 0's start, on rank " << r;
  }
}

// Three ranks, a subgroup of ranks 0 and 2: a DDP with SyncBatchNorm over
// it averages their two batches alone, and its own collectives sum theirs.
TEST(PyTorchDdp, ASubgroupCarriesADdpSyncBatchNormAndCollectivesOfItsOwn) {
  struct NormedImpl : torch::nn::Module {
    NormedImpl() {
      layers = register_module("layers", torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3),
                                                               torch::nn::Linear(3, 1)));
    }
    torch::Tensor forward(const torch::Tensor& x) { return layers->forward(x); }
    torch::nn::Sequential layers{nullptr};
  };
  for (const Sums sums : {Sums::gloo, Sums::shared_memory}) {
    auto models = test::replicas<NormedImpl>(46, 3);
    torch::manual_seed(47);
    const auto x = torch::randn({12, 4});
    std::vector<Snapshot> got(3);
    std::vector<double> summed(3, -1);
    std::vector<bool> member(3);
    run_ranks(
        3,
        [&](ProcessGroup& group) {
          auto& placed = GroupAccess::state(group);  // as one host's ranks 0 to 2
          placed.local_rank = group.rank();
          placed.local_world_size = 3;
          const auto sub = new_group(group, {2, 0});
          member[group.rank()] = sub.has_value();
          if (!sub) return;
          EXPECT_EQ(sub->world_size(), 2);
          EXPECT_EQ(sub->rank(), group.rank() / 2);
          // Its local ranks are its members' on this host: 0 and 1 of 2.
          EXPECT_EQ(sub->local_rank(), sub->rank());
          EXPECT_EQ(sub->local_world_size(), 2);
          auto model = models[group.rank()];
          convert_sync_batchnorm(model, *sub);
          DistributedDataParallel ddp(model, *sub);
          ddp.forward(test::shard(x, group.rank(), 3)).pow(2).mean().backward();
          got[group.rank()] = snapshot(*model);
          auto t = torch::full({5}, static_cast<double>(group.rank() + 1), torch::kFloat64);
          sub->allreduce_sum(t);
          summed[group.rank()] = t[0].item<double>();
        },
        [&] {
          test::Ranks how;
          how.sums = sums;
          return how;
        }());
    EXPECT_EQ(member, (std::vector<bool>{true, false, true}));
    EXPECT_EQ(summed[0], 4.0);
    EXPECT_EQ(summed[2], 4.0);
    auto oracle = models[3];
    oracle->train();
    const auto both = torch::cat({test::shard(x, 0, 3), test::shard(x, 2, 3)});
    oracle->forward(both).pow(2).mean().backward();  // BatchNorm over both batches, the mean over both
    expect_oracle({got[0], got[2]}, snapshot(*oracle), 1e-5);
  }
}

TEST(PyTorchDdp, NewGroupWithOtherRanksOnSomeRanksIsRefusedOnEvery) {
  std::vector<std::string> said(2);
  run_ranks(2, [&](ProcessGroup& group) {
    try {
      new_group(group, group.rank() == 0 ? std::vector<int>{0, 1} : std::vector<int>{1});
    } catch (const UsageError& e) {
      said[group.rank()] = e.what();
    }
  });
  for (const auto& s : said)
    EXPECT_EQ(s, "new_group: rank 1's new_group 1 is 1, rank 0's is 0, 1: every rank must call new_group, with the "
                 "same ranks, in the same order");
}

// The threads of this process.
size_t threads_now() {
  size_t n = 0;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (const dirent* entry = readdir(dir)) n += entry->d_name[0] != '.';
    closedir(dir);
  }
  return n;
}

// A new_group() whose last handle goes lets go of what it holds: its
// watchdog, its streams and their backends' threads. Five made and dropped
// in turn leave the process with the threads it had.
TEST(PyTorchDdp, ANewGroupDroppedLetsGoOfItsThreads) {
  size_t before = 0, after = 0;
  std::vector<double> sums(2);
  run_ranks(2, [&](ProcessGroup& group) {
    group.barrier();
    if (group.rank() == 0) before = threads_now();
    group.barrier();
    for (int i = 0; i < 5; ++i) {
      auto sub = new_group(group, {0, 1});
      auto t = torch::ones({2});
      sub->allreduce_sum(t);
      sums[group.rank()] += t[0].item<double>();
    }
    group.barrier();
    if (group.rank() == 0) {
      test::eventually([&] { return threads_now() <= before; }, std::chrono::seconds(5));
      after = threads_now();
    }
    group.barrier();
  });
  EXPECT_EQ(sums, (std::vector<double>{10, 10}));
  EXPECT_LE(after, before) << "threads left by five groups made and dropped";
}

// A new_group()'s verdicts name the group and its ranks as the job numbers
// them: a mismatch inside it, and a member that let go of it (its handle
// dropped, while it waits in the whole group's barrier, its program alive).
TEST(PyTorchDdp, ASubgroupsVerdictsNameItAndTheJobsRanks) {
  std::vector<std::string> mismatch(3), let_go(3);
  run_ranks(3, [&](ProcessGroup& group) {
    const int me = group.rank();
    auto t = torch::ones({3});
    if (auto sub = new_group(group, {1, 2})) {
      try {
        if (me == 1) sub->allreduce_sum(t); else sub->broadcast(t, 0);
      } catch (const Error& e) {
        mismatch[me] = e.what();
      }
    }
    if (auto sub = new_group(group, {1, 2}); sub && me == 1) {
      try {
        sub->allreduce_sum(t);
      } catch (const Error& e) {
        let_go[me] = e.what();
      }
    }
    group.barrier();
  });
  for (int r : {1, 2})
    EXPECT_EQ(mismatch[r], "in new_group 1 (ranks 1, 2): rank 1 is in the program's own allreduce_sum (allreduce, 3 "
                           "float32); rank 2 is in the program's own broadcast (broadcast, 3 float32, from rank 1): "
                           "every rank must issue the same collectives in the same order (docs/library.md, \"What "
                           "is checked\")")
        << r;
  EXPECT_EQ(let_go[1], "in new_group 2 (ranks 1, 2): rank 1 is in the program's own allreduce_sum (allreduce, 3 "
                       "float32); rank 2 let go of the group (its program ended, or its last handle to it went): every "
                       "rank must issue the same collectives in the same order (docs/library.md, \"What is checked\")");
}

// The program's own collectives as Works: each call returns before its
// peer has made its own (rank 1 makes its calls only once rank 0's have
// returned), and each completes with its result, its future holding it.
TEST(PyTorchDdp, AsyncCollectivesCompleteWithTheirResults) {
  std::vector<std::vector<double>> got(2);
  std::atomic<bool> issued{false};
  bool done_early = true;
  run_ranks(2, [&](ProcessGroup& group) {
    const double me = group.rank() + 1;
    if (group.rank() == 1)
      for (int i = 0; i < 1000 && !issued; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    auto a = torch::full({3}, me, torch::kFloat64);
    auto b = torch::full({2}, me, torch::kFloat64);
    auto out = torch::zeros({2}, torch::kFloat64);
    const auto scattered = torch::arange(4, torch::kFloat64) * me;  // chunks [0, 1] and [2, 3], times the rank's
    Work sum = group.allreduce_sum_async(a);
    Work cast = group.broadcast_async(b, 1);
    Work gathered = group.allgather_async(torch::full({1}, me, torch::kFloat64));
    Work reduced = group.reduce_scatter_async(out, scattered);
    Work met = group.barrier_async();
    if (group.rank() == 0) {
      done_early = sum.is_completed() || met.is_completed();
      issued = true;
    }
    met.wait();
    for (const Work* w : {&sum, &cast, &gathered, &reduced}) w->wait();
    EXPECT_TRUE(sum.is_completed() && cast.is_completed() && reduced.is_completed() && met.is_completed());
    EXPECT_TRUE(torch::equal(sum.get_future()->value().toTensor(), a));
    EXPECT_TRUE(torch::equal(cast.get_future()->value().toTensor(), b));
    EXPECT_TRUE(torch::equal(reduced.get_future()->value().toTensor(), out));
    auto& mine = got[group.rank()];
    mine = {a[0].item<double>(), b[0].item<double>()};
    const auto all = gathered.get_future()->value().toTensor();
    mine.push_back(all[0][0].item<double>());
    mine.push_back(all[1][0].item<double>());
    mine.push_back(out[0].item<double>());
    mine.push_back(out[1].item<double>());
  });
  EXPECT_FALSE(done_early) << "rank 0's calls waited for rank 1";
  EXPECT_EQ(got[0], (std::vector<double>{3, 2, 1, 2, 0, 3}));   // rank 0's chunk: 0*1 + 0*2, 1*1 + 1*2
  EXPECT_EQ(got[1], (std::vector<double>{3, 2, 1, 2, 6, 9}));   // rank 1's: 2*1 + 2*2, 3*1 + 3*2
}

TEST(PyTorchDdp, AProgramsOwnCollectivesRefuseWhatCannotWorkAtTheCall) {
  std::vector<std::vector<std::string>> said(2);
  run_ranks(2, [&](ProcessGroup& group) {
    auto attempt = [&](const std::function<void()>& call) {
      try {
        call();
        said[group.rank()].push_back("(accepted)");
      } catch (const UsageError& e) {
        said[group.rank()].push_back(e.what());
      }
    };
    auto t = torch::zeros({2});
    attempt([&] { group.broadcast(t, 5); });
    attempt([&] {
      torch::Tensor none;
      group.allreduce_sum(none);
    });
    attempt([&] {
      auto weight = torch::zeros({2}, torch::requires_grad());
      group.allreduce_sum(weight);
    });
  });
  for (const auto& s : said)
    EXPECT_EQ(s, (std::vector<std::string>{
                     "the program's own broadcast: root 5 is not a rank of the group (0 to 1)",
                     "the program's own allreduce_sum: the tensor is undefined",
                     "the program's own allreduce_sum: the tensor requires grad, and a collective writes into it: "
                     "pass t.detach() (or work under torch::NoGradGuard)"}));
}

// static_graph: two backward calls a step, a parameter never used; the
// first step learns the graph, the buckets are rebuilt once in the order
// its gradients came on rank 0 (rank 1's came the other way, as do every
// rank's later steps', which change nothing), and every step averages as
// one process.
TEST(PyTorchDdp, StaticGraphAveragesSeveralBackwardsAndRebuildsTheBucketsOnce) {
  struct ThreeImpl : TwoOutputsImpl {
    ThreeImpl() { spare = register_module("spare", torch::nn::Linear(4, 3)); }
    torch::nn::Linear spare{nullptr};
  };
  auto models = test::replicas<ThreeImpl>(48, 2);
  torch::manual_seed(49);
  const auto x = torch::randn({3, 8, 4});
  std::vector<std::vector<Snapshot>> got(2, std::vector<Snapshot>(3));
  std::vector<std::vector<std::string>> layouts(2);
  run_ranks(2, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    DistributedDataParallel ddp(model, group, DdpOptions().static_graph(true));
    torch::optim::SGD sgd(model->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      sgd.zero_grad();
      auto [a, b] = ddp.forward(test::shard(x[step], group.rank(), 2));
      if (step == 0 && group.rank() == 0) {
        b.pow(2).mean().backward();  // the second output's gradients first
        a.pow(2).mean().backward();
      } else {
        a.pow(2).mean().backward();
        b.pow(2).mean().backward();
      }
      layouts[group.rank()].push_back(ddp.describe_buckets().at(0));
      got[group.rank()][step] = snapshot(*model);
      sgd.step();
    }
  });
  auto oracle = models[2];
  torch::optim::SGD sgd(oracle->parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    sgd.zero_grad();
    torch::Tensor loss = torch::zeros({});
    for (int r = 0; r < 2; ++r) {
      auto [a, b] = oracle->forward(test::shard(x[step], r, 2));
      loss = loss + (a.pow(2).mean() + b.pow(2).mean()) / 2;
    }
    loss.backward();
    expect_oracle({got[0][step], got[1][step]}, snapshot(*oracle));
    sgd.step();
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(layouts[r][0], "bucket 0: 6 parameters, 45 elements (0.00 MB): spare.bias spare.weight second.bias "
                             "second.weight first.bias first.weight");
    EXPECT_NE(layouts[r][1], layouts[r][0]) << "not rebuilt";
    EXPECT_EQ(layouts[r][1].find("bucket 0: 6 parameters, 45 elements (0.00 MB): second."), 0u)
        << layouts[r][1] << ": not in the order rank 0's gradients came";
    EXPECT_EQ(layouts[r][2], layouts[r][1]) << "rebuilt more than once";
  }
}

TEST(PyTorchDdp, ParamsToIgnoreAreNeitherBroadcastNorAveraged) {
  struct PairImpl : torch::nn::Module {
    PairImpl() {
      shared = register_module("shared", torch::nn::Linear(4, 2));
      own = register_module("own", torch::nn::Linear(4, 2));
      own_count = register_buffer("own_count", torch::zeros({1}));
      shared_count = register_buffer("shared_count", torch::zeros({1}));
    }
    torch::Tensor forward(const torch::Tensor& x) { return shared(x) + own(x); }
    torch::nn::Linear shared{nullptr}, own{nullptr};
    torch::Tensor own_count, shared_count;
  };
  auto models = test::replicas<PairImpl>(50, 2);
  const auto before = models[1]->own->weight.detach().clone();
  std::vector<torch::Tensor> own_grad(2), shared_grad(2), own_value(2), shared_value(2), counts(2);
  std::string refused;
  run_ranks(2, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    model->own_count.fill_(group.rank() + 1);
    model->shared_count.fill_(group.rank() + 1);
    DistributedDataParallel ddp(model, group,
                                DdpOptions().params_to_ignore({"own.weight", "own.bias", "own_count"}));
    own_value[group.rank()] = model->own->weight.detach().clone();
    shared_value[group.rank()] = model->shared->weight.detach().clone();
    ddp.forward(torch::full({2, 4}, static_cast<float>(group.rank() + 1))).sum().backward();
    counts[group.rank()] = torch::cat({model->own_count, model->shared_count});  // after the forward's broadcast too
    own_grad[group.rank()] = model->own->weight.grad().clone();
    shared_grad[group.rank()] = model->shared->weight.grad().clone();
    if (group.rank() == 0) {
      try {
        DistributedDataParallel other(std::make_shared<PairImpl>(), group, DdpOptions().params_to_ignore({"nope"}));
      } catch (const UsageError& e) {
        refused = e.what();
      }
    }
  });
  EXPECT_TRUE(torch::equal(own_value[1], before)) << "an ignored parameter was broadcast";
  EXPECT_TRUE(torch::equal(counts[0], torch::tensor({1.0f, 1.0f}))) << counts[0];
  EXPECT_TRUE(torch::equal(counts[1], torch::tensor({2.0f, 1.0f}))) << "an ignored buffer was broadcast: " << counts[1];
  EXPECT_FALSE(torch::equal(own_value[0], own_value[1]));
  EXPECT_TRUE(torch::equal(shared_value[0], shared_value[1]));
  EXPECT_TRUE(torch::equal(own_grad[0], torch::full({2, 4}, 2.0f))) << "an ignored gradient was averaged";
  EXPECT_TRUE(torch::equal(own_grad[1], torch::full({2, 4}, 4.0f)));
  EXPECT_TRUE(torch::equal(shared_grad[0], torch::full({2, 4}, 3.0f)));
  EXPECT_TRUE(torch::equal(shared_grad[1], shared_grad[0]));
  EXPECT_EQ(refused, "DistributedDataParallel: params_to_ignore names nope, which the module does not have");
}

// join() with each of its options on 3 ranks, rank r having 3 - r steps.
TEST(PyTorchDdp, JoinDividesByTheActiveRanksOrThrowsEverywhereAsItsOptionsSay) {
  struct ProbeImpl : torch::nn::LinearImpl {
    ProbeImpl() : LinearImpl(4, 2) {}
  };
  auto models = test::replicas<ProbeImpl>(51, 3);
  torch::manual_seed(52);
  const auto x = torch::randn({3, 3, 2, 4});  // [step][rank] batches of 2
  std::vector<torch::Tensor> weights(3);
  run_ranks(3, [&](ProcessGroup& group) {
    auto model = models[group.rank()];
    DistributedDataParallel ddp(model, group);
    torch::optim::SGD sgd(model->parameters(), 0.1);
    const int r = group.rank();
    ddp.join(
        [&] {
          for (int step = 0; step < 3 - r; ++step) {
            sgd.zero_grad();
            ddp.forward(x[step][r]).pow(2).sum().backward();
            sgd.step();
          }
        },
        JoinOptions().divide_by_initial_world_size(false));
    weights[r] = model->weight.detach().clone();
  });
  auto oracle = models[3];
  torch::optim::SGD sgd(oracle->parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    sgd.zero_grad();
    const int active = 3 - step;
    torch::Tensor loss = torch::zeros({});
    for (int r = 0; r < active; ++r) loss = loss + oracle->forward(x[step][r]).pow(2).sum() / active;
    loss.backward();
    sgd.step();
  }
  for (int r = 0; r < 3; ++r) EXPECT_LE(max_abs_diff(weights[r], oracle->weight.detach()), 1e-5) << "rank " << r;

  std::vector<std::string> said(3);
  std::vector<int> steps(3);
  std::vector<double> gathered(3);
  run_ranks(3, [&](ProcessGroup& group) {
    auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
    DistributedDataParallel ddp(model, group);
    try {
      ddp.join(
          [&] {
            for (int step = 0; step < (group.rank() == 1 ? 1 : 3); ++step) {
              ddp.forward(torch::ones({2, 4})).sum().backward();
              ++steps[group.rank()];
            }
          },
          JoinOptions().throw_on_early_termination(true));
    } catch (const Error& e) {
      said[group.rank()] = e.what();
    }
    // The group goes on, as PyTorch's test goes on using it.
    group.barrier();
    gathered[group.rank()] = group.allgather(torch::full({1}, double(group.rank()))).sum().item<double>();
    DistributedDataParallel again(std::make_shared<torch::nn::LinearImpl>(4, 2), group);
    again.forward(torch::ones({2, 4})).sum().backward();
    ddp.forward(torch::ones({2, 4})).sum().backward();
  });
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(said[r], "ddp.join(): rank 1 ran out of inputs, and throw_on_early_termination stops every rank there")
        << "rank " << r;
  EXPECT_EQ(steps, (std::vector<int>{1, 1, 1})) << "the others stop at their next step";
  EXPECT_EQ(gathered, (std::vector<double>{3, 3, 3})) << "the group is usable after the early termination";

  // enable(false): join() is the loop alone, no vote in any step, so a
  // rank that calls the loop without join() trains alongside.
  std::vector<int> ran(2);
  std::vector<torch::Tensor> trained(2);
  run_ranks(2, [&](ProcessGroup& group) {
    auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
    DistributedDataParallel ddp(model, group);
    auto loop = [&] {
      for (int step = 0; step < 2; ++step) ddp.forward(torch::ones({2, 4})).sum().backward();
      ++ran[group.rank()];
    };
    if (group.rank() == 0)
      ddp.join(loop, JoinOptions().enable(false));
    else
      loop();
    trained[group.rank()] = model->weight.grad().clone();
  });
  EXPECT_EQ(ran, (std::vector<int>{1, 1}));
  EXPECT_TRUE(torch::equal(trained[0], trained[1]));
}

// The installed headers offer no way in to the library's own state: no
// handle made from it, no accessor of it (a program that tried would not
// compile; checked here as what a program could write).
template <typename T, typename = void>
struct HasImpl : std::false_type {};
template <typename T>
struct HasImpl<T, std::void_t<decltype(std::declval<T&>().impl())>> : std::true_type {};
template <typename T, typename = void>
struct HasState : std::false_type {};
template <typename T>
struct HasState<T, std::void_t<decltype(std::declval<T&>().state())>> : std::true_type {};
static_assert(!std::is_constructible_v<ProcessGroup, std::nullptr_t>, "ProcessGroup(nullptr) compiles");
static_assert(!std::is_constructible_v<ProcessGroup, std::shared_ptr<ProcessGroup::State>>, "a group from its state");
static_assert(!std::is_constructible_v<Work, std::shared_ptr<Work::State>>, "a Work from its state");
static_assert(!HasState<ProcessGroup>::value, "ProcessGroup::state() is public");
static_assert(!HasImpl<DistributedDataParallelBase>::value, "DistributedDataParallelBase::impl() is public");

// Mistakes each refused in one line of the library's hierarchy, never a
// crash: a null module, a PowerSGD of rank 0, an autocast this LibTorch
// lacks, one model in two DDPs, parameters registered in another order.
TEST(PyTorchDdp, MistakesInTheApiAreOneLineErrorsNotCrashes) {
  auto message = [](const std::function<void()>& call) {
    try {
      call();
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_EQ(message([] { convert_sync_batchnorm(nullptr); }), "convert_sync_batchnorm: the module is null");
  EXPECT_EQ(message([] { convert_sync_batchnorm(torch::nn::Linear(nullptr)); }),
            "convert_sync_batchnorm: the module is null");
  EXPECT_EQ(message([] { hooks::powersgd(hooks::PowerSgdOptions().matrix_approximation_rank(0)); }),
            "PowerSgdOptions: matrix_approximation_rank 0: must be at least 1");
  // As PyTorch's PowerSGDState: with error feedback or warm start, the first step's buckets may be rebuilt.
  for (const auto& options : {hooks::PowerSgdOptions().start_powersgd_iter(1),
                              hooks::PowerSgdOptions().start_powersgd_iter(0).use_error_feedback(false)})
    EXPECT_EQ(message([&] { hooks::powersgd(options); }).find("PowerSgdOptions: start_powersgd_iter"), 0u)
        << message([&] { hooks::powersgd(options); });
  EXPECT_EQ(message([] {
              hooks::powersgd(hooks::PowerSgdOptions().start_powersgd_iter(0).use_error_feedback(false).warm_start(false));
            }),
            "(accepted)");

  const std::string autocast = message([] { Autocast a(torch::kCPU, torch::kHalf); });
  if (autocast_unsupported(torch::kCPU, torch::kHalf).empty())
    EXPECT_EQ(autocast, "(accepted)");
  else
    EXPECT_EQ(autocast.find("Autocast(cpu, Half): "), 0u) << autocast;

  struct OrderedImpl : torch::nn::Module {
    explicit OrderedImpl(bool swapped) {
      a = register_module(swapped ? "b" : "a", torch::nn::Linear(4, 3));
      b = register_module(swapped ? "a" : "b", torch::nn::Linear(4, 3));
    }
    torch::Tensor forward(const torch::Tensor& x) { return a(x) + b(x); }
    torch::nn::Linear a{nullptr}, b{nullptr};
  };
  std::vector<std::string> said(2), twice(2), empty(2);
  run_ranks(2, [&](ProcessGroup& group) {
    empty[group.rank()] = message([&] { DistributedDataParallel<torch::nn::Linear> ddp(torch::nn::Linear(nullptr), group); });
    said[group.rank()] = message([&] { DistributedDataParallel ddp(std::make_shared<OrderedImpl>(group.rank() == 1), group); });
    auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
    DistributedDataParallel first(model, group);
    twice[group.rank()] = message([&] { DistributedDataParallel second(model, group); });
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(said[r], "DistributedDataParallel: rank 1 registers b.weight where rank 0 registers a.weight: the same "
                       "tensors in another order: every rank must build the same model, with the same DdpOptions");
    EXPECT_EQ(twice[r], "DistributedDataParallel: this module is wrapped in another DistributedDataParallel "
                        "already; wrap each model once");
    EXPECT_EQ(empty[r], "DistributedDataParallel: the module is null (an empty module holder?)");
  }
}

// A hook's view of the gradients as shaped tensors over a flat one; the
// group a SyncBatchNorm takes when nothing names one.
TEST(PyTorchDdp, SameLayoutAndTheDefaultGroup) {
  const auto flat = torch::arange(10, torch::kFloat32);
  const hooks::GradBucket bucket(0, true, torch::zeros({10}), {torch::zeros({2, 3}), torch::zeros({4})}, {}, {});
  const auto views = hooks::same_layout(bucket, flat);
  ASSERT_EQ(views.size(), 2u);
  EXPECT_EQ(views[0].sizes(), (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(torch::equal(views[1], torch::arange(6, 10, torch::kFloat32)));
  EXPECT_EQ(views[1].data_ptr<float>(), flat.data_ptr<float>() + 6) << "views, not copies";
  run_ranks(2, [&](ProcessGroup& group) {
    EXPECT_FALSE(default_process_group()) << "a group made for tests never becomes the default";
  });
}

}  // namespace pytorch_behaviours
}  // namespace mnist_ddp

namespace mnist_ddp {
namespace pytorch_behaviours {

// After shutdown(), each rank forms the job's group anew (PyTorch's
// destroy_process_group() and init_process_group()) and trains on it.
void form_anew() {
  auto group = init_process_group();
  auto t = torch::full({3}, group.rank() + 1.0);
  group.allreduce_sum(t);
  auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
  DistributedDataParallel ddp(model, group);
  ddp(torch::ones({2, 4}) * (group.rank() + 1)).sum().backward();
  default_process_group()->barrier();  // the new group (the old one refuses)
  test::write_line("formed anew: sum " + std::to_string(t[0].item<int>()) + ", gradient " +
                   std::to_string(model->weight.grad()[0][0].item<int>()));
}

// Rank 1 goes silent (alive, issuing nothing) while rank 0's collective
// waits for it: rank 0 shuts its group down, sees the wait end and what
// follows refused, and returns from its program through the destructors
// of its DDP and group, which wait for nothing. Then rank 1 shuts its
// group down too, and both form the job's group anew: rank 0 with every
// handle to the first gone, rank 1 holding one.
TEST(PyTorchDdpProgram, Run) {
  const char* done = std::getenv("MNIST_DDP_TEST_SHUTDOWN");
  if (!done) GTEST_SKIP() << "the program of PyTorchDdp.AShutDownGroup*, run by it";
  {
    auto group = init_process_group();
    auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
    DistributedDataParallel ddp(model, group);
    group.barrier();
    if (group.rank() == 1) {  // alive and silent (as a hung peer) until rank 0 has returned
      for (int i = 0; i < 300 && !test::is_regular_file(done); ++i) std::this_thread::sleep_for(100ms);
      group.shutdown();
      form_anew();
      _exit(0);
    }
    auto t = torch::zeros({1000});
    const Work pending = group.allreduce_sum_async(t);
    if (!pending.wait(1s)) test::write_line("still in flight after 1 s");
    group.shutdown();
    try {
      pending.wait();
    } catch (const PeerLost& e) {
      test::write_line(std::string("caught: ") + e.what());
    }
    try {
      group.barrier();
    } catch (const UsageError& e) {
      test::write_line(std::string("refused: ") + e.what());
    }
  }
  test::write_line("returned through the destructors");
  std::ofstream(done) << "done\n";
  form_anew();
  _exit(0);
}

// A peer alive but silent: rank 0's collective waits for it (the timeout is
// 60 s); shutdown() ends that wait at once, refuses what comes after, and
// the destructors of the DDP and the group wait for nothing.
TEST(PyTorchDdp, AShutDownGroupLetsAProgramReturnAfterAPeerIsLost) {
  test::TempDir dir;
  const test::Ran ran = test::run_program("PyTorchDdpProgram.Run", {"MNIST_DDP_TEST_SHUTDOWN=" + dir / "done"}, 60, 90s);
  EXPECT_EQ(ran.code, 0) << ran.output;
  EXPECT_NE(ran.output.find("still in flight after 1 s"), std::string::npos) << ran.output;
  EXPECT_NE(ran.output.find("caught: the process group was shut down (ProcessGroup::shutdown)"), std::string::npos)
      << ran.output;
  EXPECT_NE(ran.output.find("refused: the process group was shut down (ProcessGroup::shutdown): no collective runs "
                            "on it after that"),
            std::string::npos)
      << ran.output;
  EXPECT_NE(ran.output.find("returned through the destructors"), std::string::npos) << ran.output;
  // Both ranks: (1 + 2) summed; d(sum of outputs)/d(weight) of two rows of
  // ones times (rank + 1), averaged: (2 + 4) / 2.
  EXPECT_EQ(test::count_of(ran.output, "formed anew: sum 3, gradient 3"), 2u) << ran.output;
  EXPECT_LT(ran.seconds, 30 * test::kSlower) << "a wait outlived shutdown() (the timeout is 60 s)\n" << ran.output;
}

// A process no launcher started (a world of 1) forms its group anew too.
TEST(PyTorchDdp, AWorldOfOneFormsItsGroupAnewAfterShutdown) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child runs this test alone, its default group its own
  EXPECT_EXIT(
      {
        auto first = init_process_group();
        first.shutdown();
        auto again = init_process_group();
        auto t = torch::ones({2});
        again.allreduce_sum(t);
        const bool anew = GroupAccess::share(again) != GroupAccess::share(first) &&
                          GroupAccess::share(*default_process_group()) == GroupAccess::share(again);
        std::exit(anew && t[1].item<float>() == 1 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace pytorch_behaviours
}  // namespace mnist_ddp
