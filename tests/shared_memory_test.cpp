// Sums through shared memory: the exact math, every dtype a step sends,
// tensors larger than a slot, and the ways a peer can fail; broadcasts and
// barriers.
#include <gtest/gtest.h>

#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <fcntl.h>
#include <sys/mman.h>

#include <chrono>
#include <thread>

#include "comm/shared_memory.hpp"
#include "comm/store.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::run_ranks;
using test::Sums;

// Rank r's tensor: values that round differently in every order of adding.
torch::Tensor values(int rank, int64_t n, torch::ScalarType dtype) {
  auto gen = at::detail::createCPUGenerator(100 + rank);
  auto t = torch::randn({n}, gen, torch::kFloat64) * std::pow(10.0, rank);
  if (dtype == torch::kInt64) t = t * 1000;
  return t.to(dtype);
}

// The segment names this process created (rank 0 of threads is this process).
int segments_of_this_process() {
  const std::string prefix = "mnist_ddp." + std::to_string(getpid()) + ".";
  int count = 0;
  if (DIR* dir = opendir("/dev/shm")) {
    while (const dirent* entry = readdir(dir)) count += std::string(entry->d_name).rfind(prefix, 0) == 0;
    closedir(dir);
  }
  return count;
}

TEST(SharedMemory, SumsEveryDtypeInRankOrderAsTheExactMath) {
  struct Sum {
    int64_t n;
    torch::ScalarType dtype;
  };
  // Small (each rank adds every slot), large (each adds its share), and
  // larger than a slot (in pieces, alternating the two slot sets).
  const std::vector<Sum> sums = {{5, torch::kFloat32},      {100'000, torch::kFloat32}, {1'500'000, torch::kFloat32},
                                 {17, torch::kFloat64},     {70'000, torch::kFloat16},  {9, torch::kInt64},
                                 {0, torch::kFloat32}};
  const int world = 3;
  run_ranks(
      world,
      [&](ProcessGroup& group) {
        bool shares = false;
        bulk_stream(group)->run([&](Channel& c) { shares = c.shares_memory(); });
        ASSERT_TRUE(shares);
        for (const auto& s : sums) {
          torch::Tensor mine = values(group.rank(), s.n, s.dtype);
          bulk_stream(group)->allreduce_sum(mine);
          torch::Tensor expected;
          if (s.dtype == torch::kFloat16) {
            expected = values(0, s.n, s.dtype).to(torch::kFloat32);
            for (int r = 1; r < world; ++r) expected = expected + values(r, s.n, s.dtype).to(torch::kFloat32);
            expected = expected.to(torch::kFloat16);
          } else {
            expected = values(0, s.n, s.dtype);
            for (int r = 1; r < world; ++r) expected = expected + values(r, s.n, s.dtype);
          }
          EXPECT_TRUE(torch::equal(mine, expected)) << s.n << " of " << s.dtype << " on rank " << group.rank();
        }
        // A view that is not contiguous is summed in place.
        torch::Tensor matrix = values(group.rank(), 12, torch::kFloat32).view({3, 4});
        torch::Tensor column = matrix.select(1, 2);
        bulk_stream(group)->allreduce_sum(column);
        torch::Tensor expected = values(0, 12, torch::kFloat32).view({3, 4}).select(1, 2).clone();
        for (int r = 1; r < world; ++r) expected += values(r, 12, torch::kFloat32).view({3, 4}).select(1, 2);
        EXPECT_TRUE(torch::equal(matrix.select(1, 2), expected));
        // So is a broadcast's (Link::broadcast).
        torch::Tensor from2 = values(group.rank(), 12, torch::kFloat32).view({3, 4});
        torch::Tensor column1 = from2.select(1, 1);
        bulk_stream(group)->broadcast(column1, 2);
        EXPECT_TRUE(torch::equal(from2.select(1, 1), values(2, 12, torch::kFloat32).view({3, 4}).select(1, 1)));
        const torch::Tensor mine = values(group.rank(), 12, torch::kFloat32).view({3, 4});
        EXPECT_TRUE(torch::equal(from2.select(1, 0), mine.select(1, 0)));
      },
      torch::kCPU, Sums::shared_memory);
  EXPECT_EQ(segments_of_this_process(), 0) << "a segment was left in /dev/shm";
}

// Ranks as threads of this process, each with a reducer over `store`; the
// barrier the constructor needs, through the store.
std::function<void()> store_barrier(c10d::Store& store, int world) {
  return [&store, world] {
    store.add("mapped", 1);
    while (store.add("mapped", 0) < world) std::this_thread::sleep_for(1ms);
  };
}

// Any bytes, NaNs' and negative zeros' among them, from any root, in
// pieces where larger than a slot; and a barrier no rank leaves before the
// last arrives. The ranks are threads of this process.
TEST(SharedMemory, BroadcastsTheRootsBytesAndBarriersWaitForEveryRank) {
  const int world = 3;
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto bits = [](int root, int64_t n) {
    auto gen = at::detail::createCPUGenerator(7 + root);
    auto t = torch::randint(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(), {n}, gen,
                            torch::kInt64)
                 .to(torch::kInt32);
    if (n >= 2) {
      t[0] = std::numeric_limits<int32_t>::min();  // float32's -0.0
      t[1] = 0x7fc00123;                            // a NaN with a payload
    }
    return t;
  };
  std::atomic<int> arrived{0};
  std::vector<std::string> failures(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r)
    ranks.emplace_back([&, r] {
      SharedMemoryReducer reducer(*store, r, world, 60'000ms, store_barrier(*store, world));
      for (const int64_t n : {int64_t{0}, int64_t{5}, int64_t{3'000'000}})
        for (int root = 0; root < world; ++root) {
          torch::Tensor t = r == root ? bits(root, n) : torch::zeros({n}, torch::kInt32);
          reducer.broadcast(t, root);
          if (!torch::equal(t, bits(root, n)))
            failures[r] +=
                std::to_string(n) + " from rank " + std::to_string(root) + " to rank " + std::to_string(r) + "; ";
        }
      std::this_thread::sleep_for(std::chrono::milliseconds(30 * r));
      ++arrived;
      reducer.barrier();
      if (arrived.load() != world) failures[r] += "rank " + std::to_string(r) + " left the barrier early; ";
    });
  for (auto& t : ranks) t.join();
  for (const auto& f : failures) EXPECT_EQ(f, "");
}

// What rank 0's sum throws while rank 1 stays away: "peer lost: <what>",
// "error: <what>" or "" (it completed), and how long it took to say so.
struct Alone {
  std::string outcome;
  std::chrono::steady_clock::duration took;
};
Alone sum_without_rank1(SharedMemoryReducer& rank0) {
  auto t = torch::ones({4});
  const auto start = std::chrono::steady_clock::now();
  Alone alone;
  try {
    rank0.allreduce_sum(t);
  } catch (const PeerLost& e) {
    alone.outcome = std::string("peer lost: ") + e.what();
  } catch (const std::runtime_error& e) {
    alone.outcome = std::string("error: ") + e.what();
  }
  alone.took = std::chrono::steady_clock::now() - start;
  return alone;
}

TEST(SharedMemory, ARankThatNeverArrivesIsNamedAfterTheTimeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::unique_ptr<SharedMemoryReducer> late;
  std::thread rank1([&] { late = std::make_unique<SharedMemoryReducer>(*store, 1, 2, 1000ms, store_barrier(*store, 2)); });
  SharedMemoryReducer rank0(*store, 0, 2, 1000ms, store_barrier(*store, 2));
  rank1.join();
  const Alone alone = sum_without_rank1(rank0);
  EXPECT_EQ(alone.outcome, "error: rank 1 did not reach a collective within 1 s (--timeout)");
  EXPECT_LT(alone.took, 3s);
}

// Rank 1 is a child process that maps the segment and exits; rank 0, in
// this process, learns it within milliseconds, before its parent (this
// process) has even reaped it. The pair is a new_group() of the job's
// ranks 3 and 5, and is named so.
TEST(SharedMemory, APeerWhoseProcessEndedIsNamedAtOnce) {
  test::TempDir dir;
  const std::string path = dir / "store";
  const pid_t child = fork();
  if (child == 0) {
    try {
      c10d::FileStore store(path, 2);
      SharedMemoryReducer rank1(store, 1, 2, 60'000ms, store_barrier(store, 2));
    } catch (...) {
      _exit(1);
    }
    _exit(0);
  }
  ASSERT_GT(child, 0);
  c10d::FileStore store(path, 2);
  RankNames names;
  names.global = {3, 5};
  names.group = "new_group 2 (ranks 3, 5)";
  SharedMemoryReducer rank0(store, 0, 2, 60'000ms, store_barrier(store, 2), names);
  const Alone alone = sum_without_rank1(rank0);
  EXPECT_EQ(alone.outcome, "peer lost: in new_group 2 (ranks 3, 5): lost rank 5: its process ended during a collective");
  EXPECT_LT(alone.took, 2s);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child could not join";
  EXPECT_EQ(segments_of_this_process(), 0) << "a segment was left in /dev/shm";
}

}  // namespace
}  // namespace mnist_ddp

namespace mnist_ddp {
namespace {

// The segment's name comes through the store, which any process that
// reaches it may write: a name rank 0 could not have made, or a segment
// that is not rank 0's (another user's, another size), is named as a
// foreign value, never opened for use.
TEST(SharedMemory, ASegmentNameNoRankWroteIsNamedNotOpened) {
  const std::string foreign = "another process is writing into this job's store";
  for (const std::string name : {"/mnist_ddp.evil", "/../../etc/passwd", "/mnist_ddp.1.0000000g"}) {
    c10d::HashStore store;
    store.set("shared_memory", bytes_of(name));
    try {
      SharedMemoryReducer(store, 1, 2, 2s, [] {});
      ADD_FAILURE() << name << " was taken";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(foreign), std::string::npos) << e.what();
    }
  }
  // A well-formed name whose segment is not the one rank 0 made: another size.
  const std::string name = "/mnist_ddp." + std::to_string(getpid()) + ".0badf00d";
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  c10d::HashStore store;
  store.set("shared_memory", bytes_of(name));
  try {
    SharedMemoryReducer(store, 1, 2, 2s, [] {});
    ADD_FAILURE() << "a segment of another size was taken";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(foreign), std::string::npos) << e.what();
  }
  shm_unlink(name.c_str());
}

}  // namespace
}  // namespace mnist_ddp
