#include "app/train/data.hpp"
#include "app/base/files.hpp"

#include <sys/stat.h>
#include <zlib.h>

#include <array>
#include <cstdio>
#include <memory>
#include <vector>

namespace mnist_ddp {
namespace {

constexpr int kSide = 28;
constexpr double kMean = 0.1307;
constexpr double kStd = 0.3081;

// zlib's gzread passes files that are not gzip through unchanged. Of a gzip
// file it checks the CRC32 and length in the trailer once the data is read
// to its end, which expect_end() does: a damaged file fails there or
// earlier, in inflate, never silently.
class IdxFile {
 public:
  explicit IdxFile(const std::string& path) : path_(path), file_(gzopen(path.c_str(), "rb"), &gzclose) {
    if (!file_) throw DataError("data file " + path + ": cannot open it");
  }

  // Reads exactly n bytes; anything less means the file is truncated
  // (`total`: the bytes expected in all, when n is a piece of them).
  void read(void* out, size_t n, const char* what, int64_t total = -1) {
    auto* p = static_cast<unsigned char*>(out);
    size_t done = 0;
    while (done < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30));
      const int got = gzread(file_.get(), p + done, chunk);
      if (got < 0) throw_corrupt();
      if (got == 0) {
        if (total >= 0)
          throw DataError("data file " + path_ + ": truncated: its header announces " + what + ", the file ends before " +
                          std::to_string(total) + " bytes of them");
        throw DataError("data file " + path_ + ": truncated, " + what + " end after " + std::to_string(done) + " of " +
                        std::to_string(n) + " bytes");
      }
      done += static_cast<size_t>(got);
    }
  }

  // The dimensions its header announces. With `check_size`, checked first
  // against the bytes the file holds (a plain file's size, a gzip file's
  // trailer), for a caller that sizes memory by the header.
  std::vector<int64_t> header(int dims, bool check_size = false) {
    unsigned char magic[4];
    read(magic, 4, "the header bytes");
    const unsigned value = (magic[0] << 24) | (magic[1] << 16) | (magic[2] << 8) | magic[3];
    const unsigned expected = 0x0800u | static_cast<unsigned>(dims);
    if (value != expected) {
      char text[128];
      std::snprintf(text, sizeof text, ": bad magic number 0x%08X, expected 0x%08X (IDX of unsigned bytes, %d dimension%s)",
                    value, expected, dims, dims == 1 ? "" : "s");
      throw DataError("data file " + path_ + text);
    }
    std::vector<int64_t> shape(dims);
    int64_t values = 1;
    std::string announced;
    for (auto& d : shape) {
      unsigned char b[4];
      read(b, 4, "the dimension sizes");
      d = (int64_t{b[0]} << 24) | (b[1] << 16) | (b[2] << 8) | b[3];
      values *= d;  // at most 2^32 ^ 3: no overflow
      announced += (announced.empty() ? "" : "x") + std::to_string(d);
    }
    if (check_size) {
      const int64_t held = data_bytes(4 + 4 * static_cast<int64_t>(dims), values);
      if (held >= 0 && held != values % (int64_t{1} << 32) && held != values)
        throw DataError("data file " + path_ + ": " + (held < values ? "truncated" : "has bytes past the end") +
                        ": its header announces " + announced + " values, the file holds " + std::to_string(held) +
                        " bytes of data; fetch it again: bash scripts/fetch_data.sh");
    }
    return shape;
  }

  // The bytes past the header: the file's size for a plain file; for a gzip
  // file its trailer's ISIZE (the uncompressed size modulo 2^32) where that
  // is the `values` announced, else as many as it inflates to, counted up to
  // one past them (a file cut short ends in no trailer). -1 when neither
  // can be read.
  int64_t data_bytes(int64_t header_bytes, int64_t values) const {
    struct stat st;
    if (stat(path_.c_str(), &st) != 0) return -1;
    std::unique_ptr<FILE, int (*)(FILE*)> raw(std::fopen(path_.c_str(), "rb"), &std::fclose);
    unsigned char b[4] = {};
    if (!raw || std::fread(b, 1, 2, raw.get()) != 2) return -1;
    if (b[0] != 0x1f || b[1] != 0x8b) return static_cast<int64_t>(st.st_size) - header_bytes;
    if (st.st_size < 18 || std::fseek(raw.get(), -4, SEEK_END) != 0 || std::fread(b, 1, 4, raw.get()) != 4) return -1;
    const uint32_t size = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
    const int64_t trailer = (static_cast<int64_t>(size) - header_bytes + (int64_t{1} << 32)) % (int64_t{1} << 32);
    if (trailer == values % (int64_t{1} << 32)) return trailer;
    std::unique_ptr<gzFile_s, int (*)(gzFile)> gz(gzopen(path_.c_str(), "rb"), &gzclose);
    if (!gz) return -1;
    std::vector<char> chunk(1 << 20);
    int64_t inflated = 0;
    while (inflated <= header_bytes + values) {
      const int n = gzread(gz.get(), chunk.data(), static_cast<unsigned>(chunk.size()));
      if (n <= 0) break;
      inflated += n;
    }
    return inflated - header_bytes;
  }

  void expect_end() {
    unsigned char extra;
    const int got = gzread(file_.get(), &extra, 1);
    if (got < 0) throw_corrupt();
    if (got > 0) throw DataError("data file " + path_ + ": has bytes past the end its header announces");
  }

 private:
  [[noreturn]] void throw_corrupt() {
    int err = Z_OK;
    const char* msg = gzerror(file_.get(), &err);
    throw DataError("data file " + path_ + ": the gzip data is damaged (" + (msg && *msg ? msg : "read error") +
                    "); fetch it again: bash scripts/fetch_data.sh");
  }

  std::string path_;
  std::unique_ptr<gzFile_s, int (*)(gzFile)> file_;
};

struct SplitFiles {
  std::string images;
  std::string labels;
};

const char* display_name(const std::string& dataset) { return dataset == "mnist" ? "MNIST" : "FashionMNIST"; }

std::string find_file(const std::string& dir, const std::string& stem, const std::string& dataset) {
  for (const std::string& name : {stem, stem + ".gz"}) {
    const std::string p = files::join(dir, name);
    if (files::exists(p)) return p;
  }
  throw DataError(std::string(display_name(dataset)) + " data not found: no " + stem + "[.gz] in " + dir +
                  "; run: bash scripts/fetch_data.sh " + dataset + " (or pass --data-dir)");
}

SplitFiles split_files(const std::string& data_dir, const std::string& dataset, bool train) {
  const std::string dir = raw_dir(data_dir, dataset);
  const std::string prefix = train ? "train" : "t10k";
  return {find_file(dir, prefix + "-images-idx3-ubyte", dataset), find_file(dir, prefix + "-labels-idx1-ubyte", dataset)};
}

void check_shapes(const SplitFiles& f, const std::vector<int64_t>& images, const std::vector<int64_t>& labels) {
  if (images[1] != kSide || images[2] != kSide)
    throw DataError("data file " + f.images + ": images are " + std::to_string(images[1]) + "x" +
                    std::to_string(images[2]) + ", the model needs 28x28");
  if (images[0] != labels[0])
    throw DataError("data files " + f.images + " and " + f.labels + " disagree: " + std::to_string(images[0]) +
                    " images but " + std::to_string(labels[0]) + " labels");
  if (images[0] == 0) throw DataError("data file " + f.images + ": holds no images");
}

}  // namespace

torch::Tensor read_idx(const std::string& path, int dims) {
  IdxFile file(path);
  const std::vector<int64_t> shape = file.header(dims);
  int64_t values = 1;
  std::string announced;
  for (int64_t d : shape) {
    values *= d;
    announced += (announced.empty() ? "" : "x") + std::to_string(d);
  }
  // Read in pieces, never allocating what the header claims before the
  // file has shown it holds that much: a lying header is named, not
  // allocated.
  std::vector<uint8_t> data;
  constexpr int64_t kPiece = 16 << 20;
  while (static_cast<int64_t>(data.size()) < values) {
    const size_t at = data.size();
    data.resize(at + static_cast<size_t>(std::min(kPiece, values - static_cast<int64_t>(at))));
    file.read(data.data() + at, data.size() - at, (announced + " values").c_str(), values);
  }
  file.expect_end();
  return torch::from_blob(data.data(), shape, torch::kUInt8).clone();
}

std::string raw_dir(const std::string& data_dir, const std::string& dataset) {
  return files::join(files::join(data_dir, display_name(dataset)), "raw");
}

void check_dataset_files(const std::string& data_dir, const std::string& dataset) {
  for (bool train : {true, false}) {
    const SplitFiles f = split_files(data_dir, dataset, train);
    const auto images = IdxFile(f.images).header(3, true);
    const auto labels = IdxFile(f.labels).header(1, true);
    check_shapes(f, images, labels);
  }
}

int64_t dataset_bytes(const std::string& data_dir, const std::string& dataset) {
  int64_t bytes = 0;
  for (bool train : {true, false}) {
    const SplitFiles f = split_files(data_dir, dataset, train);
    const int64_t images = IdxFile(f.images).header(3, true)[0];
    bytes += images * (kSide * kSide * static_cast<int64_t>(sizeof(float)) + static_cast<int64_t>(sizeof(int64_t)));
  }
  return bytes;
}

Dataset load_dataset(const std::string& data_dir, const std::string& dataset, bool train) {
  const SplitFiles f = split_files(data_dir, dataset, train);
  const torch::Tensor images = read_idx(f.images, 3);
  const torch::Tensor labels = read_idx(f.labels, 1);
  check_shapes(f, images.sizes().vec(), labels.sizes().vec());
  if (labels.max().item<int64_t>() > 9)
    throw DataError("data file " + f.labels + ": label " + std::to_string(labels.max().item<int64_t>()) +
                    " is outside 0..9");
  Dataset d;
  // ToTensor then Normalize, in float32 and in this order, as torchvision does.
  d.images = images.to(torch::kFloat32).div_(255).sub_(kMean).div_(kStd).unsqueeze_(1);
  d.labels = labels.to(torch::kInt64);
  return d;
}

DistributedSampler::DistributedSampler(int64_t size, int world_size, int rank, bool shuffle, uint64_t seed)
    : size_(size),
      world_size_(world_size),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      num_samples_((size + world_size - 1) / world_size) {}

torch::Tensor DistributedSampler::indices() const {
  torch::Tensor order;
  if (shuffle_) {
    auto gen = at::detail::createCPUGenerator(seed_ + static_cast<uint64_t>(epoch_));
    order = torch::randperm(size_, gen, torch::kInt64);
  } else {
    order = torch::arange(size_, torch::kInt64);
  }
  const int64_t total = num_samples_ * world_size_;
  while (order.size(0) < total) {
    order = torch::cat({order, order.slice(0, 0, std::min(total - order.size(0), order.size(0)))});
  }
  return order.slice(0, rank_, total, world_size_).contiguous();
}

torch::Tensor shard_indices(int64_t size, int world_size, int rank) {
  return torch::arange(rank, size, world_size, torch::kInt64);
}

int64_t num_batches(int64_t samples, int64_t batch_size) { return (samples + batch_size - 1) / batch_size; }

std::pair<torch::Tensor, torch::Tensor> get_batch(const Dataset& data, const torch::Tensor& indices, int64_t b,
                                                  int64_t batch_size) {
  const int64_t begin = b * batch_size;
  const torch::Tensor idx = indices.slice(0, begin, std::min(begin + batch_size, indices.size(0)));
  return {data.images.index_select(0, idx), data.labels.index_select(0, idx)};
}

}  // namespace mnist_ddp
