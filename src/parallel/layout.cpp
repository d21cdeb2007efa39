// Bucket assignment and the bucket layout (layout.hpp).
#include "parallel/layout.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

namespace mnist_ddp {

std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<int64_t>& sizes_bytes,
                                                           int64_t first_cap_bytes, int64_t cap_bytes,
                                                           const std::vector<int>& kinds) {
  struct Open {
    std::vector<size_t> tensors;
    int64_t filled = 0;
    bool first = true;  // the kind's first bucket
  };
  std::map<int, Open> open;  // kind -> its bucket being filled
  std::vector<std::vector<size_t>> buckets;
  for (size_t i = 0; i < sizes_bytes.size(); ++i) {
    Open& b = open[kinds.empty() ? 0 : kinds[i]];
    b.tensors.push_back(i);
    b.filled += sizes_bytes[i];
    if (b.filled >= (b.first ? first_cap_bytes : cap_bytes)) {
      buckets.push_back(std::move(b.tensors));
      b = Open{{}, 0, false};
    }
  }
  for (auto& [kind, b] : open)
    if (!b.tensors.empty()) buckets.push_back(std::move(b.tensors));
  std::sort(buckets.begin(), buckets.end(), [](const auto& a, const auto& b) { return a.front() < b.front(); });
  return buckets;
}

namespace {

// A tensor of `type` over part of `buffer`'s memory (from `offset`
// elements of the buffer's) that autograd does not treat as a view, so
// optimizers may detach_() and zero_() it in place. It keeps the buffer
// alive. A complex one lies over twice as many of the buffer's reals.
torch::Tensor alias(const torch::Tensor& buffer, int64_t offset, at::IntArrayRef sizes, c10::ScalarType type) {
  auto* data = static_cast<char*>(buffer.data_ptr()) + offset * buffer.element_size();
  return torch::from_blob(data, sizes, [keep = buffer](void*) {}, buffer.options().dtype(type));
}

std::string megabytes(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f MB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return text;
}

int64_t reals(const torch::Tensor& t) { return t.numel() * (t.is_complex() ? 2 : 1); }

}  // namespace

BucketLayout::BucketLayout(const std::vector<AveragedParam>& params, const std::vector<size_t>& order,
                           int64_t first_cap_bytes, int64_t cap_bytes)
    : order_(order), bucket_of_(params.size(), 0), views_(params.size()) {
  std::vector<int64_t> sizes;
  std::vector<int> kinds;
  for (size_t p : order) {
    sizes.push_back(params[p].tensor.numel() * params[p].tensor.element_size());
    kinds.push_back(params[p].sparse ? -1 - static_cast<int>(p) : static_cast<int>(params[p].tensor.scalar_type()));
  }
  const auto assignment = compute_bucket_assignment(sizes, std::min(first_cap_bytes, cap_bytes), cap_bytes, kinds);
  for (size_t b = 0; b < assignment.size(); ++b) {
    const AveragedParam& first = params[order[assignment[b].front()]];
    int64_t total = 0;
    for (size_t k : assignment[b]) total += reals(params[order[k]].tensor);
    torch::Tensor buffer;
    if (!first.sparse)
      buffer = torch::zeros({total}, first.tensor.options().dtype(c10::toRealValueType(first.tensor.scalar_type())).requires_grad(false));
    std::vector<torch::Tensor> gradients, tensors;
    std::vector<std::string> names;
    int64_t offset = 0;
    for (size_t k : assignment[b]) {
      const size_t p = order[k];
      const torch::Tensor& param = params[p].tensor;
      if (!first.sparse) {
        views_[p] = alias(buffer, offset, param.sizes(), param.scalar_type());
        gradients.push_back(param.is_complex() ? torch::view_as_real(views_[p]) : views_[p]);
        offset += reals(param);
      }
      tensors.push_back(param);
      names.push_back(params[p].name);
      bucket_of_[p] = b;
    }
    buckets_.emplace_back(b, b + 1 == assignment.size(), buffer, gradients, tensors, names);
    counts_.push_back(assignment[b].size());
  }
}

void BucketLayout::adopt_gradients(const std::vector<AveragedParam>& params, const BucketLayout& old) const {
  torch::NoGradGuard no_grad;
  for (size_t p = 0; p < params.size(); ++p) {
    torch::Tensor& grad = torch::Tensor(params[p].tensor).mutable_grad();
    if (grad.defined() && old.views_[p].defined() && grad.is_same(old.views_[p])) {
      views_[p].copy_(grad);
      grad = views_[p];
    }
  }
}

std::vector<std::string> BucketLayout::describe() const {
  std::vector<std::string> lines;
  for (const auto& b : buckets_) {
    std::ostringstream s;
    const bool sparse = !b.buffer().defined();
    const int64_t elements = sparse ? b.parameters()[0].numel() : b.buffer().numel();
    s << "bucket " << b.index() << ": " << b.parameters().size() << " parameters, " << elements << " elements ("
      << (sparse ? "sparse" : megabytes(elements * b.buffer().element_size())) << "):";
    for (const auto& name : b.parameter_names()) s << " " << name;
    lines.push_back(s.str());
  }
  return lines;
}

}  // namespace mnist_ddp
