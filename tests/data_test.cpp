#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <set>

#include "app/train/data.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using test::idx_bytes;
using test::TempDir;
using test::write_file;

std::vector<uint8_t> ramp(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 7);
  return v;
}

std::string data_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const DataError& e) {
    return e.what();
  }
  return "(no error)";
}

void expect_contains(const std::string& text, const std::string& piece) {
  EXPECT_NE(text.find(piece), std::string::npos) << "'" << text << "' lacks '" << piece << "'";
}

TEST(Idx, ReadsRawAndGzipAlike) {
  TempDir dir;
  const auto pixels = ramp(3 * 28 * 28);
  for (bool gz : {false, true}) {
    const std::string path = dir / (gz ? "a.gz" : "a");
    write_file(path, idx_bytes({3, 28, 28}, pixels), gz);
    const auto t = read_idx(path, 3);
    ASSERT_EQ(t.sizes(), (std::vector<int64_t>{3, 28, 28}));
    EXPECT_TRUE(torch::equal(t.flatten(), torch::tensor(std::vector<int64_t>(pixels.begin(), pixels.end())).to(torch::kUInt8)));
  }
}

TEST(Idx, EachKindOfBadFileIsNamed) {
  TempDir dir;
  const std::string f = dir / "bad.gz";
  write_file(f, idx_bytes({3, 28, 28}, ramp(3 * 28 * 28), 0x00000801), true);
  auto msg = data_error([&] { read_idx(f, 3); });
  expect_contains(msg, f);
  expect_contains(msg, "bad magic number 0x00000801, expected 0x00000803");

  write_file(f, idx_bytes({3, 28, 28}, ramp(2 * 28 * 28)), true);
  msg = data_error([&] { read_idx(f, 3); });
  expect_contains(msg, f);
  expect_contains(msg, "truncated");

  write_file(f, idx_bytes({3, 28, 28}, ramp(2 * 28 * 28)).substr(0, 10), false);
  expect_contains(data_error([&] { read_idx(f, 3); }), "truncated");

  write_file(f, idx_bytes({2}, ramp(3)), true);
  expect_contains(data_error([&] { read_idx(f, 1); }), "past the end");

  expect_contains(data_error([&] { read_idx(dir / "missing", 1); }), "cannot open");
}

// A gzip file damaged anywhere is named, never read as data: bytes flipped
// mid-stream (as a bad disk or download does), a wrong CRC32, a wrong length.
TEST(Idx, DamagedGzipDataIsNamedNotTrained) {
  TempDir dir;
  const std::string f = dir / "damaged.gz";
  std::vector<uint8_t> pixels(64 * 28 * 28);
  std::mt19937 random(7);
  for (auto& p : pixels) p = static_cast<uint8_t>(random() % 7 == 0 ? random() : 0);  // compresses, but not to nothing
  write_file(f, idx_bytes({64, 28, 28}, pixels), true);
  const std::string good = test::read_text(f);
  ASSERT_GT(good.size(), 200u);
  struct Damage {
    std::string what;
    size_t at, count;
  };
  for (const Damage& d : {Damage{"six bytes mid-stream", good.size() / 2, 6}, Damage{"the CRC32", good.size() - 8, 1},
                          Damage{"the length", good.size() - 4, 1}}) {
    SCOPED_TRACE(d.what);
    std::string bad = good;
    for (size_t i = 0; i < d.count; ++i) bad[d.at + i] = static_cast<char>(bad[d.at + i] ^ 0x5a);
    write_file(f, bad, false);
    const std::string msg = data_error([&] { read_idx(f, 3); });
    expect_contains(msg, f);
    expect_contains(msg, "the gzip data is damaged");
  }
}

void write_split(const TempDir& dir, const std::string& split, uint32_t images, uint32_t labels, uint8_t max_label = 9,
                 uint32_t side = 28) {
  std::vector<uint8_t> label_bytes(labels);
  for (uint32_t i = 0; i < labels; ++i) label_bytes[i] = static_cast<uint8_t>(i % (max_label + 1));
  write_file(dir / ("MNIST/raw/" + split + "-images-idx3-ubyte.gz"), idx_bytes({images, side, side}, ramp(images * side * side)), true);
  write_file(dir / ("MNIST/raw/" + split + "-labels-idx1-ubyte.gz"), idx_bytes({labels}, label_bytes), true);
}

TEST(Dataset, LoadsAndNormalisesAsTorchvision) {
  TempDir dir;
  write_split(dir, "train", 20, 20);
  write_split(dir, "t10k", 10, 10);
  check_dataset_files(dir.path(), "mnist");
  const Dataset d = load_dataset(dir.path(), "mnist", true);
  ASSERT_EQ(d.images.sizes(), (std::vector<int64_t>{20, 1, 28, 28}));
  EXPECT_EQ(d.labels.scalar_type(), torch::kInt64);
  const auto pixels = ramp(20 * 28 * 28);
  const float expected = (static_cast<float>(pixels[5]) / 255.0f - 0.1307f) / 0.3081f;
  EXPECT_FLOAT_EQ(d.images.flatten()[5].item<float>(), expected);
  EXPECT_EQ(d.labels[13].item<int64_t>(), 3);
}

TEST(Dataset, MismatchedCountsBadLabelsAndMissingFilesAreRefused) {
  {
    TempDir dir;
    write_split(dir, "train", 20, 19);
    write_split(dir, "t10k", 10, 10);
    const auto msg = data_error([&] { load_dataset(dir.path(), "mnist", true); });
    expect_contains(msg, "20 images but 19 labels");
    expect_contains(data_error([&] { check_dataset_files(dir.path(), "mnist"); }), "20 images but 19 labels");
  }
  {
    TempDir dir;
    write_split(dir, "train", 20, 20, /*max_label=*/12);
    const auto msg = data_error([&] { load_dataset(dir.path(), "mnist", true); });
    expect_contains(msg, "label 12 is outside 0..9");
    expect_contains(msg, "train-labels-idx1-ubyte.gz");
  }
  {
    TempDir dir;
    write_split(dir, "train", 4, 4, 9, /*side=*/32);
    expect_contains(data_error([&] { load_dataset(dir.path(), "mnist", true); }), "32x32, the model needs 28x28");
  }
  {
    TempDir dir;
    const auto msg = data_error([&] { check_dataset_files(dir.path(), "fashion-mnist"); });
    expect_contains(msg, "FashionMNIST/raw");
    expect_contains(msg, "bash scripts/fetch_data.sh fashion-mnist");
  }
}

// A header that claims 2^31 - 1 images is named with its file, before any
// memory of that size is asked for: by the launcher's check (which sizes
// its workers by the headers), by a worker's load, gzip or plain.
TEST(Dataset, AHeaderThatClaimsMoreThanTheFileHoldsIsNamedBeforeAllocating) {
  for (const bool gzip : {true, false}) {
    SCOPED_TRACE(gzip ? "gzip" : "plain");
    TempDir dir;
    write_split(dir, "t10k", 10, 10);
    const std::string images = dir / (std::string("MNIST/raw/train-images-idx3-ubyte") + (gzip ? ".gz" : ""));
    write_file(images, idx_bytes({0x7fffffffu, 28, 28}, ramp(5 * 28 * 28)), gzip);
    write_file(dir / "MNIST/raw/train-labels-idx1-ubyte.gz", idx_bytes({5}, ramp(5)), true);
    for (const auto& msg : {data_error([&] { check_dataset_files(dir.path(), "mnist"); }),
                            data_error([&] { dataset_bytes(dir.path(), "mnist"); }),
                            data_error([&] { load_dataset(dir.path(), "mnist", true); })}) {
      expect_contains(msg, images);
      expect_contains(msg, "truncated");
      expect_contains(msg, "2147483647");
    }
  }
}

// A gzip file cut in half (a copy cut short) is called short, whatever
// its last bytes, which are then mid-stream data, say as a trailer.
TEST(Dataset, AGzipFileCutShortIsCalledShort) {
  TempDir dir;
  write_split(dir, "t10k", 10, 10);
  const std::string images = dir / "MNIST/raw/train-images-idx3-ubyte.gz";
  std::vector<uint8_t> pixels(400 * 28 * 28);
  std::mt19937 random(7);
  for (auto& p : pixels) p = static_cast<uint8_t>(random());
  write_file(images, idx_bytes({400, 28, 28}, pixels), true);
  write_file(dir / "MNIST/raw/train-labels-idx1-ubyte.gz", idx_bytes({400}, ramp(400)), true);
  const int64_t half = test::file_size(images) / 2;
  test::resize_file(images, half);
  {
    std::fstream f(images, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(half - 4);
    f.write("\xff\xff\xff\x7f", 4);  // an "uncompressed size" of 2^31 - 1
  }
  for (const auto& msg : {data_error([&] { check_dataset_files(dir.path(), "mnist"); }),
                          data_error([&] { load_dataset(dir.path(), "mnist", true); })}) {
    expect_contains(msg, images);
    expect_contains(msg, "truncated");
    EXPECT_EQ(msg.find("past the end"), std::string::npos) << msg;
  }
}

std::vector<int64_t> as_vector(const torch::Tensor& t) {
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

TEST(DistributedSampler, MatchesPyTorchsOrder) {
  // Printed by torch.utils.data.distributed.DistributedSampler (PyTorch 1.13).
  const std::vector<std::vector<int64_t>> epoch0 = {{4, 5, 0, 2}, {1, 3, 8, 4}, {7, 9, 6, 1}};
  const std::vector<std::vector<int64_t>> epoch1 = {{5, 2, 9, 4}, {6, 0, 3, 5}, {1, 8, 7, 6}};
  for (int r = 0; r < 3; ++r) {
    DistributedSampler s(10, 3, r, true, 0);
    EXPECT_EQ(as_vector(s.indices()), epoch0[r]);
    s.set_epoch(1);
    EXPECT_EQ(as_vector(s.indices()), epoch1[r]);
  }
  const std::vector<std::vector<int64_t>> small = {{5, 2}, {0, 6}, {3, 4}, {1, 5}};
  for (int r = 0; r < 4; ++r) {
    DistributedSampler s(7, 4, r, true, 5);
    s.set_epoch(2);
    EXPECT_EQ(as_vector(s.indices()), small[r]);
  }
}

TEST(DistributedSampler, ShardsAreEqualDisjointUpToPaddingAndCoverTheData) {
  for (int world : {1, 2, 3, 7}) {
    const int64_t n = 100;
    std::multiset<int64_t> all;
    int64_t per_rank = -1;
    for (int r = 0; r < world; ++r) {
      DistributedSampler s(n, world, r, true, 42);
      s.set_epoch(3);
      const auto idx = as_vector(s.indices());
      if (per_rank < 0) per_rank = static_cast<int64_t>(idx.size());
      EXPECT_EQ(static_cast<int64_t>(idx.size()), per_rank);
      all.insert(idx.begin(), idx.end());
    }
    EXPECT_EQ(per_rank, (n + world - 1) / world);
    for (int64_t i = 0; i < n; ++i) EXPECT_GE(all.count(i), 1u) << "index " << i << " is in no shard";
    // Every index is a sample, and only the padding repeats: at most once,
    // as it wraps around to the start of the order.
    EXPECT_GE(*all.begin(), 0);
    EXPECT_LT(*all.rbegin(), n);
    for (int64_t i = 0; i < n; ++i) EXPECT_LE(all.count(i), 2u) << "index " << i;
  }
}

TEST(DistributedSampler, ChangesWithEpochAndRepeatsWithSeed) {
  DistributedSampler a(1000, 2, 0, true, 7), b(1000, 2, 0, true, 7), c(1000, 2, 0, true, 8);
  EXPECT_TRUE(torch::equal(a.indices(), b.indices()));
  EXPECT_FALSE(torch::equal(a.indices(), c.indices()));
  const auto before = a.indices();
  a.set_epoch(1);
  EXPECT_FALSE(torch::equal(before, a.indices()));
}

TEST(Sharding, TestSetShardsCountEveryImageExactlyOnce) {
  for (int world : {1, 2, 3, 4}) {
    std::vector<int> seen(1001, 0);
    for (int r = 0; r < world; ++r)
      for (int64_t i : as_vector(shard_indices(1001, world, r))) ++seen[i];
    for (int count : seen) EXPECT_EQ(count, 1);
  }
}

TEST(Batches, SliceInSamplerOrderWithAShortLastBatch) {
  Dataset d;
  d.images = torch::arange(10, torch::kFloat32).view({10, 1, 1, 1});
  d.labels = torch::arange(10, torch::kInt64);
  const auto idx = torch::tensor({9, 3, 5, 1, 0}, torch::kInt64);
  EXPECT_EQ(num_batches(5, 2), 3);
  auto [x, y] = get_batch(d, idx, 1, 2);
  EXPECT_EQ(as_vector(y), (std::vector<int64_t>{5, 1}));
  auto [x2, y2] = get_batch(d, idx, 2, 2);
  EXPECT_EQ(as_vector(y2), (std::vector<int64_t>{0}));
  EXPECT_EQ(x2.size(0), 1);
}

}  // namespace
}  // namespace mnist_ddp
