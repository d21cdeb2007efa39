// The check before each collective, the watch on collectives that wait,
// and ddp.join(): ranks as threads over Gloo (and shared memory), each
// case against what every rank must say.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <chrono>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "comm/group.hpp"
#include "mnist_ddp/ddp.hpp"
#include "parallel/advice.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::run_ranks;
using test::Sums;

// Ranks that issue different collectives on one lane: each learns at once
// what every rank was about to issue, and says so in the same line, through
// Gloo and through shared memory.
TEST(CollectiveCheck, RanksThatIssueDifferentCollectivesEachSayWhatEveryRankWasDoing) {
  use_library_advice();
  for (const Sums sums : {Sums::gloo, Sums::shared_memory}) {
    std::vector<std::string> said(2);
    std::mutex mutex;
    const auto start = std::chrono::steady_clock::now();
    try {
      run_ranks(
          2,
          [&](ProcessGroup& group) {
            std::string what = "(passed)";
            try {
              if (group.rank() == 0) {
                auto stats = torch::zeros({65});
                bulk_stream(group)->allreduce_sum(stats, Issuer(kSyncBnForward, 0, -1, "SyncBatchNorm features.1's forward"));
              } else {
                auto bucket = torch::zeros({1000});
                bulk_stream(group)->allreduce_sum(bucket, DdpNames().bucket(0));
              }
            } catch (const CollectiveMismatch& e) {
              what = e.what();
            }
            std::lock_guard<std::mutex> lock(mutex);
            said[group.rank()] = what;
            throw std::runtime_error("spent");  // no barrier on a group that mismatched
          },
          torch::kCPU, sums);
    } catch (const std::runtime_error&) {
    }
    const std::string expected =
        "rank 0 is in SyncBatchNorm features.1's forward (allreduce, 65 float32); rank 1 is in DDP bucket 0's "
        "backward (allreduce, 1000 float32): a train-mode forward through SyncBatchNorm must run on every rank "
        "(evaluate or sample under eval(), or on every rank)";
    EXPECT_EQ(said[0], expected) << (sums == Sums::gloo ? "gloo" : "shared memory");
    EXPECT_EQ(said[1], expected) << (sums == Sums::gloo ? "gloo" : "shared memory");
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "the answer was known at once";
  }
}

// What each rank caught: the CollectiveMismatch's line (or another error's,
// prefixed with its kind), "(passed)" where it caught none.
struct Caught {
  std::vector<std::string> said;
  std::chrono::steady_clock::duration took{};
};

// `hold`: each rank keeps its group until every rank has caught what it
// will (a group destroyed early would tell the others its rank ended).
Caught catch_on_ranks(int world, const std::function<void(ProcessGroup&)>& fn, const test::Ranks& how,
                      bool hold = true) {
  Caught caught;
  caught.said.assign(world, "(not run)");
  std::mutex mutex;
  std::condition_variable all_caught;
  int done = 0;
  const auto start = std::chrono::steady_clock::now();
  test::Ranks spent = how;
  spent.barrier_after = false;  // no barrier on a group whose collectives went wrong
  run_ranks(
      world,
      [&](ProcessGroup& group) {
        std::string what = "(passed)";
        try {
          fn(group);
        } catch (const CollectiveMismatch& e) {
          what = e.what();
        } catch (const Timeout& e) {
          what = std::string("Timeout: ") + e.what();
        } catch (const PeerLost& e) {
          what = std::string("PeerLost: ") + e.what();
        } catch (const UsageError& e) {
          what = std::string("UsageError: ") + e.what();
        }
        std::unique_lock<std::mutex> lock(mutex);
        caught.said[group.rank()] = what;
        ++done;
        all_caught.notify_all();
        if (hold) all_caught.wait_for(lock, 60s, [&] { return done == world; });
      },
      spent);
  caught.took = std::chrono::steady_clock::now() - start;
  return caught;
}

test::Ranks summing(Sums sums) {
  test::Ranks how;
  how.sums = sums;
  return how;
}

// A group's only DDP is "the" DDP; once it has several, each is named by
// its place, the first too (issue 55: never "DDP bucket 0" beside "the
// second DDP's bucket 0").
TEST(CollectiveCheck, ADdpAmongSeveralIsNamedByItsPlace) {
  const auto models = std::make_shared<std::atomic<int>>(1);
  const DdpNames first(0, models), second(1, models);
  EXPECT_EQ(first.bucket(3).text, "DDP bucket 3's backward");
  EXPECT_EQ(first.issuer(kBuffers, "DistributedDataParallel's buffers").text, "DistributedDataParallel's buffers");
  *models = 2;
  EXPECT_EQ(first.bucket(3).text, "the first DDP's bucket 3's backward");
  EXPECT_EQ(second.bucket(3).text, "the second DDP's bucket 3's backward");
  EXPECT_EQ(first.issuer(kBuffers, "DistributedDataParallel's buffers").text, "the first DistributedDataParallel's buffers");
  EXPECT_EQ(second.issuer(kReplicaCheck, "the replica check").text, "the second DistributedDataParallel's replica check");
  EXPECT_EQ(second.issuer(kHookAgreement, "register_comm_hook").text,
            "the second DistributedDataParallel's register_comm_hook");
  EXPECT_EQ(DdpNames(11, models).bucket(0).text, "the 12th DDP's bucket 0's backward");

  // Rank 0 has built its second DDP, rank 1 not yet: their words for the
  // first one's bucket differ, and the check still sees one collective;
  // the second DDP's bucket is another.
  use_library_advice();
  const auto alone = std::make_shared<std::atomic<int>>(1);
  const Caught caught = catch_on_ranks(
      2,
      [&](ProcessGroup& group) {
        auto bucket = torch::zeros({1000});
        bulk_stream(group)->allreduce_sum(bucket, DdpNames(0, group.rank() == 0 ? models : alone).bucket(3));
        bulk_stream(group)->allreduce_sum(bucket, DdpNames(group.rank(), models).bucket(3));
      },
      summing(Sums::gloo));
  EXPECT_EQ(caught.said[0], caught.said[1]);
  EXPECT_EQ(caught.said[0], "rank 0 is in the first DDP's bucket 3's backward (allreduce, 1000 float32); rank 1 is in "
                            "the second DDP's bucket 3's backward (allreduce, 1000 float32): every rank must build the "
                            "same model and register the same communication hook");
}

// Two ranks that differ in one thing only (the count, the dtype, the
// operation, the root), each the same issuer: the check alone tells them
// apart, before anything of a size the other does not expect reaches Gloo
// (which aborts the process on one), through Gloo's groups and through
// shared memory, for a sum the check carries (10 elements) and one it
// does not (1000).
TEST(CollectiveCheck, RanksThatDifferInOneThingOnlyAreNamedWhateverItIs) {
  struct Case {
    std::string name;
    std::function<void(Channel&, int rank)> issue;
    std::string line;
  };
  auto sum = [](int64_t n, c10::ScalarType type) {
    return [n, type](Channel& c, int) { c.allreduce_sum(torch::zeros({n}, type))->waitAndThrow(); };
  };
  const std::string advice = ": every rank must issue the same collectives in the same order (docs/library.md, "
                             "\"What is checked\")";
  const std::vector<Case> cases = {
      {"count", [](Channel& c, int rank) { c.allreduce_sum(torch::zeros({rank == 0 ? 1000 : 1001}))->waitAndThrow(); },
       "rank 0 is in the test (allreduce, 1000 float32); rank 1 is in the test (allreduce, 1001 float32)" + advice},
      {"small count",
       [](Channel& c, int rank) { c.allreduce_sum(torch::zeros({rank == 0 ? 10 : 11}))->waitAndThrow(); },
       "rank 0 is in the test (allreduce, 10 float32); rank 1 is in the test (allreduce, 11 float32)" + advice},
      {"dtype",
       [&](Channel& c, int rank) { sum(1000, rank == 0 ? torch::kFloat32 : torch::kFloat64)(c, rank); },
       "rank 0 is in the test (allreduce, 1000 float32); rank 1 is in the test (allreduce, 1000 float64)" + advice},
      {"operation",
       [](Channel& c, int rank) {
         auto t = torch::zeros({1000});
         if (rank == 0) c.allreduce_sum(t)->waitAndThrow();
         else c.broadcast(t, 0);
       },
       "rank 0 is in the test (allreduce, 1000 float32); rank 1 is in the test (broadcast, 1000 float32, from rank "
       "0)" + advice},
      {"root",
       [](Channel& c, int rank) {
         auto t = torch::zeros({1000});
         c.broadcast(t, rank);
       },
       "rank 0 is in the test (broadcast, 1000 float32, from rank 0); rank 1 is in the test (broadcast, 1000 "
       "float32, from rank 1)" + advice},
  };
  for (const Sums sums : {Sums::gloo, Sums::shared_memory})
    for (const auto& c : cases) {
      const std::string where = c.name + (sums == Sums::gloo ? ", gloo" : ", shared memory");
      const Caught caught = catch_on_ranks(
          2, [&](ProcessGroup& group) { bulk_stream(group)->run([&](Channel& ch) { c.issue(ch, group.rank()); }, "the test"); },
          summing(sums));
      EXPECT_EQ(caught.said[0], c.line) << where;
      EXPECT_EQ(caught.said[1], c.line) << where;
      EXPECT_LT(caught.took, 15s) << where << ": the answer was known at once (a second or two idle)";
    }
}

// The collectives a lane issued and the checks it made.
struct CountingProbe : StreamProbe {
  std::atomic<int> collectives{0}, checks{0};
  void issued(const std::string&) override { ++collectives; }
  void checked() override { ++checks; }
};

// Checked alongside (as under NCCL), the collective is issued at once and
// its check held to it when it completes: matched collectives give their
// sums, and a mismatch is the same line, thrown by the rank's next wait,
// after the mismatched collective went out (checked before, it never
// would).
TEST(CollectiveCheck, ACheckAlongsideItsCollectiveFindsTheSameMismatch) {
  test::Ranks how;
  how.check = Check::alongside;
  std::vector<double> sums(2);
  run_ranks(
      2,
      [&](ProcessGroup& group) {
        for (int i = 0; i < 5; ++i) {
          auto t = torch::full({1000}, static_cast<double>(group.rank() + i), torch::kFloat64);
          bulk_stream(group)->allreduce_sum(t, "the test");
          if (i == 4) sums[group.rank()] = t[999].item<double>();
        }
      },
      how);
  EXPECT_EQ(sums[0], 9.0);
  EXPECT_EQ(sums[1], 9.0);
  // Found as the check completes, in the background: one of the next
  // collectives' waits (within a second or so) throws it.
  std::vector<std::shared_ptr<CountingProbe>> probes = {std::make_shared<CountingProbe>(),
                                                         std::make_shared<CountingProbe>()};
  const Caught caught = catch_on_ranks(
      2,
      [&](ProcessGroup& group) {
        auto t = torch::zeros({1000});
        bulk_stream(group)->watch(probes[group.rank()]);
        bulk_stream(group)->allreduce_sum(t, group.rank() == 0 ? "the program's A" : "the program's B");
        for (int i = 0; i < 100; ++i) {
          bulk_stream(group)->allreduce_sum(t, "the program's next");
          std::this_thread::sleep_for(50ms);
        }
      },
      how);
  const std::string line = "rank 0 is in the program's A (allreduce, 1000 float32); rank 1 is in the program's B "
                           "(allreduce, 1000 float32): every rank must issue the same collectives in the same order "
                           "(docs/library.md, \"What is checked\")";
  EXPECT_EQ(caught.said[0], line);
  EXPECT_EQ(caught.said[1], line);
  for (int r = 0; r < 2; ++r) {
    EXPECT_GE(probes[r]->checks, 1) << "rank " << r;
    EXPECT_GE(probes[r]->collectives, 1) << "rank " << r << ": the mismatched collective was not issued";
  }
}

// Ranks waiting on two lanes at once are no evidence of a mistake (two
// threads, or a rank a step ahead on one lane, do that): each waits, and
// when the late rank comes, both lanes complete. Rank 1 comes 6 s late,
// longer than any pause the check once took for a mismatch.
TEST(CollectiveCheck, RanksWaitingOnTwoLanesWaitForEachOther) {
  std::vector<std::vector<double>> got(2, std::vector<double>(4));
  std::vector<std::thread> runs;  // Gloo and shared memory at once: the 6 s waits overlap
  for (const Sums sums : {Sums::gloo, Sums::shared_memory})
    runs.emplace_back([&, sums] {
      auto& mine = got[sums == Sums::gloo ? 0 : 1];
      try {
      run_ranks(
          2,
          [&](ProcessGroup& group) {
            auto small = torch::full({10}, 1.0), large = torch::full({2000}, 2.0);
            if (group.rank() == 0) {
              quick_stream(group)->allreduce_sum(small, "SyncBatchNorm bn1's forward");
              bulk_stream(group)->allreduce_sum(large, "DDP bucket 0's backward");
            } else {
              const auto bucket = bulk_stream(group)->post(
                  [large](Channel& c) { c.allreduce_sum(large)->waitAndThrow(); }, "DDP bucket 0's backward");
              std::this_thread::sleep_for(6s);
              quick_stream(group)->allreduce_sum(small, "SyncBatchNorm bn1's forward");
              bulk_stream(group)->wait(bucket);
            }
            mine[2 * group.rank()] = small[0].item<double>();
            mine[2 * group.rank() + 1] = large[0].item<double>();
          },
          summing(sums));
      } catch (const std::exception& e) {
        ADD_FAILURE() << (sums == Sums::gloo ? "gloo: " : "shared memory: ") << e.what();
      }
    });
  for (auto& run : runs) run.join();
  EXPECT_EQ(got[0], (std::vector<double>{2, 4, 2, 4})) << "gloo";
  EXPECT_EQ(got[1], (std::vector<double>{2, 4, 2, 4})) << "shared memory";
}

// A rank that never comes is waited for until the group's timeout (3 s
// here), then every waiting rank names where each of the others waits.
TEST(CollectiveCheck, ARankThatNeverComesIsNamedAtTheTimeoutWithWhereItWaits) {
  test::Ranks how;
  how.timeout = 3s;
  const Caught caught = catch_on_ranks(
      2,
      [](ProcessGroup& group) {
        auto t = torch::zeros({10});
        if (group.rank() == 0) quick_stream(group)->allreduce_sum(t, "SyncBatchNorm bn1's forward");
        else bulk_stream(group)->allreduce_sum(t, "DDP bucket 0's backward");
      },
      how);
  EXPECT_EQ(caught.said[0], "Timeout: rank 1 did not reach SyncBatchNorm bn1's forward (allreduce, 10 float32) within "
                            "3 s (the timeout); rank 1 waits in DDP bucket 0's backward (allreduce, 10 float32)");
  EXPECT_EQ(caught.said[1], "Timeout: rank 0 did not reach DDP bucket 0's backward (allreduce, 10 float32) within 3 "
                            "s (the timeout); rank 0 waits in SyncBatchNorm bn1's forward (allreduce, 10 float32)");
  EXPECT_GE(caught.took, 3s) << "named before the timeout";
  EXPECT_LT(caught.took, 12s);
}

// A rank whose program ends (its group gone) before a collective another
// rank waits in will never come: that is named within seconds, as uneven
// inputs, whatever the timeout.
TEST(CollectiveCheck, ARankThatEndsItsProgramBeforeACollectiveIsNamedAsUnevenInputs) {
  use_library_advice();
  for (const Sums sums : {Sums::gloo, Sums::shared_memory}) {
    const Caught caught = catch_on_ranks(
        2,
        [](ProcessGroup& group) {
          auto t = torch::zeros({1000});
          bulk_stream(group)->allreduce_sum(t, DdpNames().bucket(0));
          if (group.rank() == 0) bulk_stream(group)->allreduce_sum(t, DdpNames().bucket(0));
        },
        summing(sums), /*hold=*/false);
    const std::string where = sums == Sums::gloo ? "gloo" : "shared memory";
    EXPECT_EQ(caught.said[0], "rank 0 is in DDP bucket 0's backward (allreduce, 1000 float32); rank 1 ended its "
                              "program (the last collective it passed there: DDP bucket 0's backward (allreduce, "
                              "1000 float32)): the ranks ran different numbers of steps (uneven inputs): give every "
                              "rank as many batches, or wrap each rank's training loop in ddp.join()")
        << where;
    EXPECT_EQ(caught.said[1], "(passed)") << where;
    EXPECT_LT(caught.took, 15s) << where << ": named within seconds (about one idle), not at the timeout (60 s)";
  }
}

// Off, collectives go out as the program issues them, and join() says it
// needs the check.
TEST(CollectiveCheck, OffIssuesCollectivesAsAskedAndJoinSaysItNeedsTheCheck) {
  test::Ranks how;
  how.check = Check::off;
  std::vector<double> got(2);
  std::vector<std::string> join(2);
  run_ranks(
      2,
      [&](ProcessGroup& group) {
        auto t = torch::full({10}, static_cast<double>(group.rank() + 1));
        group.allreduce_sum(t);
        got[group.rank()] = t[0].item<double>();
        auto model = std::make_shared<torch::nn::LinearImpl>(2, 2);
        DistributedDataParallel ddp(model, group);
        try {
          ddp.join([] {});
        } catch (const UsageError& e) {
          join[group.rank()] = e.what();
        }
      },
      how);
  EXPECT_EQ(got, (std::vector<double>{3, 3}));
  for (const auto& said : join)
    EXPECT_EQ(said, "ddp.join() needs the collective check, which tells a rank whose data ran out what the others "
                    "issue: leave ProcessGroupOptions().check_collectives on");
}

// A store that refuses the heartbeat for a while, then one that stalls it
// (a write that does not return): the heartbeat goes on once it takes
// writes again.
TEST(CollectiveWatch, TheHeartbeatGoesOnAfterTheStoreRefusedIt) {
  struct RefusingStore : c10d::HashStore {
    std::atomic<bool> refusing{false}, stalling{false};
    void set(const std::string& key, const std::vector<uint8_t>& value) override {
      if (refusing && key.rfind("heartbeat/", 0) == 0) throw std::runtime_error("the store refuses");
      while (stalling && key.rfind("heartbeat/", 0) == 0) std::this_thread::sleep_for(10ms);
      HashStore::set(key, value);
    }
  };
  auto store = c10::make_intrusive<RefusingStore>();
  CollectiveWatch watch(store, 0, 2, 60s);
  auto beats = [&] {
    const auto value = store->get("heartbeat/0");
    return std::stoll(std::string(value.begin(), value.end()));
  };
  ASSERT_TRUE(test::eventually([&] { return store->check({"heartbeat/0"}); }, 5s));
  store->refusing = true;
  std::this_thread::sleep_for(2500ms);
  const auto during = beats();
  store->refusing = false;
  EXPECT_TRUE(test::eventually([&] { return beats() > during; }, 5s)) << "the heartbeat stopped for good";
  store->stalling = true;
  std::this_thread::sleep_for(2500ms);
  const auto stalled = beats();
  std::this_thread::sleep_for(1500ms);
  EXPECT_EQ(beats(), stalled) << "a heartbeat went through a stalled store";
  store->stalling = false;
  EXPECT_TRUE(test::eventually([&] { return beats() > stalled; }, 5s)) << "the heartbeat stopped after the stall";
}

// A model with SyncBatchNorm between two layers, for ddp.join().
struct NormedImpl : torch::nn::Module {
  NormedImpl() {
    a = register_module("a", torch::nn::Linear(4, 3));
    norm = register_module("norm", torch::nn::Sequential(torch::nn::BatchNorm1d(3)));
    b = register_module("b", torch::nn::Linear(3, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(norm->forward(a(x)))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::nn::Sequential norm{nullptr};
};
TORCH_MODULE(Normed);

// Uneven inputs on 3 ranks: rank r trains 3 - r steps inside ddp.join().
// The oracle is one process applying, at each step, the gradient of the
// active ranks' losses summed (SyncBatchNorm over their concatenated
// batches: the joined ranks contribute nothing) and divided by the world
// size at the start, as PyTorch's join divides it. Every rank ends with
// the oracle's parameters and running statistics, bit-identical replicas.
TEST(Join, UnevenInputsOnThreeRanksEndAsOneProcessApplyingTheSameAverages) {
  constexpr int kRanks = 3;
  const double lr = 0.1;
  std::mutex mutex;
  auto make = [&] {  // the same model every time: ranks as threads share LibTorch's generator
    std::lock_guard<std::mutex> lock(mutex);
    torch::manual_seed(7);
    Normed model;
    model->to(torch::kFloat64);
    return model;
  };
  torch::manual_seed(8);
  std::vector<torch::Tensor> xs, ys;  // [rank][step] batches of 4
  for (int r = 0; r < kRanks; ++r) {
    xs.push_back(torch::randn({3, 4, 4}, torch::kFloat64));
    ys.push_back(torch::randn({3, 4, 2}, torch::kFloat64));
  }
  std::vector<std::vector<torch::Tensor>> got(kRanks);
  run_ranks(kRanks, [&](ProcessGroup& group) {
    Normed model = make();
    convert_sync_batchnorm(model, group);
    DistributedDataParallel<Normed> ddp(model, group);
    torch::optim::SGD sgd(model->parameters(), lr);
    const int r = group.rank();
    ddp.join([&] {
      for (int step = 0; step < kRanks - r; ++step) {
        sgd.zero_grad();
        torch::mse_loss(ddp.forward(xs[r][step]), ys[r][step]).backward();
        sgd.step();
      }
    });
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& t : model->parameters()) got[r].push_back(t.detach().clone());
    for (const auto& t : model->buffers()) got[r].push_back(t.detach().clone());
  });
  Normed oracle = make();
  for (int step = 0; step < kRanks; ++step) {
    std::vector<torch::Tensor> x, y;
    for (int r = 0; r < kRanks - step; ++r) {  // the ranks still active
      x.push_back(xs[r][step]);
      y.push_back(ys[r][step]);
    }
    oracle->zero_grad();
    const auto out = oracle->forward(torch::cat(x));
    torch::Tensor loss = torch::zeros({}, torch::kFloat64);
    for (size_t r = 0; r < x.size(); ++r) loss = loss + torch::mse_loss(out.slice(0, 4 * r, 4 * (r + 1)), y[r]);
    loss.backward();
    torch::NoGradGuard no_grad;
    for (auto& p : oracle->parameters()) p.add_(p.grad() / kRanks, -lr);
  }
  std::vector<torch::Tensor> expected;
  for (const auto& t : oracle->parameters()) expected.push_back(t.detach());
  for (const auto& t : oracle->buffers()) expected.push_back(t.detach());
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(got[r].size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_LE(test::max_abs_diff(got[r][i].to(torch::kFloat64), expected[i].to(torch::kFloat64)), 1e-12)
          << "rank " << r << " tensor " << i;
      EXPECT_TRUE(torch::equal(got[r][i], got[0][i])) << "replica " << r << " tensor " << i;
    }
  }
}

// Under PowerSGD with float16 on the wire (compressing from the first
// step), ranks that join early serve every P and Q of the others with
// zeros; after join() every rank holds the last rank's parameters and
// PowerSGD's shared state (its step count), so the next steps agree.
// A hook of ours pays one check a bucket, its first collective's: the sizes
// of the rest follow from it and from what the ranks agreed. A program's own
// hook, a subclass of ours included, has every collective checked.
TEST(CollectiveCheck, AHookOfOursIsCheckedOnceABucketAProgramsHookAtEveryCollective) {
  struct Mine : hooks::PowerSgdHook {
    using PowerSgdHook::PowerSgdHook;
  };
  for (const bool ours : {true, false}) {
    std::vector<int> collectives(2), checks(2);
    std::mutex mutex;
    run_ranks(2, [&](ProcessGroup& group) {
      torch::nn::Sequential model{nullptr};
      {
        std::lock_guard<std::mutex> lock(mutex);
        torch::manual_seed(3);
        model = torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
      }
      DistributedDataParallel ddp(model, group);
      const auto options = hooks::PowerSgdOptions().start_powersgd_iter(0).use_error_feedback(false).warm_start(false);
      ddp.register_comm_hook(ours ? hooks::CommHookPtr(hooks::powersgd(options))
                                  : hooks::CommHookPtr(std::make_shared<Mine>(options)));
      const auto x = torch::ones({4, 16}) * (group.rank() + 1);
      ddp.forward(x).sum().backward();  // the first: the hooks' agreement
      auto counter = std::make_shared<CountingProbe>();
      bulk_stream(group)->watch(counter);
      ddp.forward(x).sum().backward();
      bulk_stream(group)->watch(nullptr);
      collectives[group.rank()] = counter->collectives;
      checks[group.rank()] = counter->checks;
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_GE(collectives[r], 3) << "rank " << r << ": PowerSGD's collectives over one bucket";
      if (ours)
        EXPECT_EQ(checks[r], 1) << "rank " << r << ", " << collectives[r] << " collectives";
      else
        EXPECT_EQ(checks[r], collectives[r]) << "rank " << r << ", a program's hook";
    }
  }
}

TEST(Join, UnevenInputsUnderPowerSgdEndWithIdenticalReplicasAndHookState) {
  constexpr int kRanks = 3;
  std::vector<std::vector<torch::Tensor>> got(kRanks);
  std::vector<int64_t> iters(kRanks);
  std::mutex mutex;
  run_ranks(kRanks, [&](ProcessGroup& group) {
    torch::nn::Sequential model{nullptr};
    {
      std::lock_guard<std::mutex> lock(mutex);
      torch::manual_seed(3);
      model = torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
    }
    DistributedDataParallel ddp(model, group);
    auto hook = hooks::powersgd(hooks::PowerSgdOptions().start_powersgd_iter(2).matrix_approximation_rank(2));
    ddp.register_comm_hook(hooks::fp16_compress_wrapper(hook));
    torch::optim::SGD sgd(model->parameters(), 0.05);
    const int r = group.rank();
    auto step = [&](int k) {
      torch::Tensor x, y;
      {
        std::lock_guard<std::mutex> lock(mutex);
        torch::manual_seed(100 * r + k);
        x = torch::randn({8, 16});
        y = torch::randn({8, 4});
      }
      sgd.zero_grad();
      torch::mse_loss(ddp.forward(x), y).backward();
      sgd.step();
    };
    ddp.join([&] {
      for (int k = 0; k < 2 * (kRanks - r); ++k) step(k);
    });
    step(99);  // every rank again: their hooks must agree on compressing
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& t : model->parameters()) got[r].push_back(t.detach().clone());
    iters[r] = hook->powersgd_state().iter;
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(iters[r], 2 * kRanks + 1) << "rank " << r << "'s PowerSGD steps";
    for (size_t i = 0; i < got[0].size(); ++i) {
      EXPECT_TRUE(torch::equal(got[r][i], got[0][i])) << "replica " << r << " tensor " << i;
      EXPECT_TRUE(got[r][i].isfinite().all().item<bool>());
    }
  }
}

}  // namespace
}  // namespace mnist_ddp

namespace mnist_ddp {
namespace {

// static_graph under join(), rank 0 out of data from the start: the others
// learn the graph and rebuild their buckets without it (their rebuild
// comes from the highest rank with data), and after join() every rank
// holds the last rank's model and buckets, so the next step is every
// rank's alike.
TEST(Join, StaticGraphWithRank0OutOfDataFirstEndsWithOneModelAndOneLayout) {
  constexpr int kRanks = 3;
  std::vector<std::vector<torch::Tensor>> got(kRanks);
  std::vector<std::vector<std::string>> buckets(kRanks);
  std::mutex mutex;
  run_ranks(kRanks, [&](ProcessGroup& group) {
    torch::nn::Sequential model{nullptr};
    {
      std::lock_guard<std::mutex> lock(mutex);
      torch::manual_seed(5);
      model = torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
    }
    // Small buckets, so that the rebuilt order changes the layout.
    DistributedDataParallel ddp(model, group, DdpOptions().static_graph(true).bucket_cap_mb(1e-4).first_bucket_cap_mb(1e-4));
    torch::optim::SGD sgd(model->parameters(), 0.1);
    const int r = group.rank();
    auto step = [&](int k) {
      torch::manual_seed(100 * r + k);
      sgd.zero_grad();
      torch::mse_loss(ddp.forward(torch::randn({4, 8})), torch::randn({4, 2})).backward();
      sgd.step();
    };
    ddp.join([&] {
      for (int k = 0; k < 2 * r; ++k) step(k);
    });
    step(99);
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& t : model->parameters()) got[r].push_back(t.detach().clone());
    buckets[r] = ddp.describe_buckets();
  });
  for (int r = 1; r < kRanks; ++r) {
    EXPECT_EQ(buckets[r], buckets[0]) << "rank " << r << "'s buckets";
    for (size_t i = 0; i < got[0].size(); ++i) EXPECT_TRUE(torch::equal(got[r][i], got[0][i])) << "replica " << r;
  }
}

// A broadcast from a rank that has joined has nothing to send: refused on
// every rank by name (never delivered as zeros), a replica check's too,
// and the group's streams stay usable. A reduce_scatter before it is
// served: the joined rank adds zeros.
TEST(Join, ABroadcastFromARankThatHasJoinedIsRefusedOnEveryRank) {
  std::vector<std::string> said(2);
  std::vector<double> after(2);
  torch::Tensor scattered = torch::zeros({2});
  run_ranks(2, [&](ProcessGroup& group) {
    auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
    DistributedDataParallel ddp(model, group);
    try {
      ddp.join([&] {
        if (group.rank() == 0) return;  // no data at all
        ddp.forward(torch::ones({2, 4})).sum().backward();
        group.reduce_scatter(scattered, torch::arange(1, 5, torch::kFloat32));  // rank 1's chunk: [3, 4]
        auto t = torch::ones({3});
        group.broadcast(t, 0);
      });
    } catch (const UsageError& e) {
      said[group.rank()] = e.what();
    }
    auto t = torch::ones({1});
    group.allreduce_sum(t);
    after[group.rank()] = t.item<double>();
  });
  const std::string tail = "rank 0 has joined (ddp.join(): its data ran out) and has nothing to send; broadcast from a "
                           "rank that still has data, or after join() returns on every rank";
  EXPECT_EQ(said[0], "ddp.join(): the other ranks broadcast 3 float32 from rank 0, and " + tail);
  EXPECT_EQ(said[1], "the program's own broadcast (broadcast, 3 float32, from rank 0): " + tail);
  EXPECT_EQ(after, (std::vector<double>{2, 2}));
  EXPECT_TRUE(torch::equal(scattered, torch::tensor({3.0F, 4.0F}))) << scattered;
}

}  // namespace
}  // namespace mnist_ddp

namespace mnist_ddp {
namespace {

// A peer that stops in the middle of a transfer (past its check): the
// watchdog names it at the group's timeout (1 s here), a Timeout saying
// where the peer stands, not Gloo's failure 5 s later read as a lost peer.
TEST(CollectiveWatch, APeerThatHangsMidTransferIsANamedTimeout) {
  for (const Sums sums : {Sums::gloo, Sums::shared_memory}) {
    test::Ranks how = summing(sums);
    how.timeout = 1s;
    const Caught caught = catch_on_ranks(
        2,
        [](ProcessGroup& group) {
          auto t = torch::ones({1000});
          bulk_stream(group)->allreduce_sum(t, "the test");
          if (group.rank() == 0)  // a transfer rank 1 never makes
            bulk_stream(group)->run([t](Channel& c) { c.link().allreduce_sum(t)->waitAndThrow(); }, "the test");
        },
        how);
    const std::string where = sums == Sums::gloo ? "gloo" : "shared memory";
    EXPECT_EQ(caught.said[0], "Timeout: rank 1 did not reach the test (allreduce, 1000 float32)'s transfer within 1 s "
                              "(the timeout); rank 1 last passed the test (allreduce, 1000 float32)")
        << where;
    EXPECT_EQ(caught.said[1], "(passed)") << where;
    EXPECT_LT(caught.took, 5s) << where << ": named at the timeout, before Gloo's own (6 s)";
  }
}

// A wait that is no evidence (rank 1's thread is busy, not waiting) is
// reported once, at a third of the timeout, on the rank that waits, and
// waited for: the collective completes when rank 1 comes.
TEST(CollectiveWatch, AStallWithoutEvidenceIsReportedOnceAndWaitedFor) {
  test::Ranks how;
  how.timeout = 3s;
  std::vector<double> got(2);
  testing::internal::CaptureStderr();
  run_ranks(
      2,
      [&](ProcessGroup& group) {
        if (group.rank() == 1) std::this_thread::sleep_for(2s);
        auto t = torch::ones({10});
        quick_stream(group)->allreduce_sum(t, "the test");
        got[group.rank()] = t[0].item<double>();
      },
      how);
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_EQ(got, (std::vector<double>{2, 2}));
  EXPECT_NE(said.find("[rank 0] mnist_ddp: rank 0 has waited 1 s in the test (allreduce, 10 float32); rank 1 has "
                      "issued nothing there yet; likely cause: every rank must issue the same collectives in the same "
                      "order (docs/library.md, \"What is checked\"); waiting on, up to the timeout (3 s)"),
            std::string::npos)
      << said;
  EXPECT_EQ(test::count_lines_with(said, "has waited"), 1) << said;
}

// A Work's callback runs on the thread that issues the group's
// collectives: one that waits on a collective of the group would wait for
// itself, and is refused at once.
TEST(CollectiveWatch, AWorksCallbackThatWaitsOnItsOwnGroupIsRefusedAtOnce) {
  const Caught caught = catch_on_ranks(
      2,
      [](ProcessGroup& group) {
        if (group.rank() == 1) std::this_thread::sleep_for(300ms);  // rank 0's future completes on the stream's thread
        auto t = torch::ones({4});
        Work work = group.allreduce_sum_async(t);
        if (group.rank() == 0) work.get_future()->addCallback([group](c10::ivalue::Future&) { group.barrier(); });
        work.wait();
        group.barrier();
      },
      test::Ranks(), /*hold=*/false);
  EXPECT_NE(caught.said[0].find("a collective was waited for on the thread that issues them"), std::string::npos)
      << caught.said[0];
  EXPECT_LT(caught.took, 15s);
}

// A program's hook whose future never completes is named at the timeout.
TEST(CollectiveWatch, AHooksFutureThatNeverCompletesIsNamedAtTheTimeout) {
  struct Never : hooks::CommHook {
    std::string name() const override { return "never"; }
    FuturePtr run(const hooks::GradBucket&, hooks::Wire&) override {
      return c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    }
  };
  test::Ranks how;
  how.timeout = 1s;
  const Caught caught = catch_on_ranks(
      2,
      [](ProcessGroup& group) {
        auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
        DistributedDataParallel ddp(model, group);
        ddp.register_comm_hook(std::make_shared<Never>());
        ddp.forward(torch::ones({2, 4})).sum().backward();
      },
      how);
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(caught.said[r], "Timeout: the future never returned for DDP bucket 0's backward did not complete within "
                              "1 s (the timeout): a communication hook's future must complete")
        << "rank " << r;
}

}  // namespace
}  // namespace mnist_ddp
