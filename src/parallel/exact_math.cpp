// The exact math: sums and products whose rounding depends on nothing but
// the values (exact_math.hpp).
#include "parallel/exact_math.hpp"

#include <limits>

namespace mnist_ddp {

torch::Tensor exact_row_sum(const torch::Tensor& a) {
  torch::Tensor rows = a;
  if (rows.size(0) == 0) return torch::zeros({a.size(1)}, a.options());
  while (rows.size(0) > 1) {
    const int64_t n = rows.size(0), half = n / 2;
    torch::Tensor sums = rows.slice(0, 0, half) + rows.slice(0, half, 2 * half);
    rows = n % 2 ? torch::cat({sums, rows.slice(0, n - 1, n)}) : sums;
  }
  return rows[0];
}

namespace {

// exact_outer_product on the CPU in one pass over `out`, row by row, with
// the same roundings as the tensor ops below: each product rounded, then
// added in order. A fused multiply-add would round once and break that
// (and agreement with ranks on a GPU), so the compiler may not contract.
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void outer_product_rows(float* out, const float* p, const float* q_t, int64_t n, int64_t m, int64_t r) {
  for (int64_t i = 0; i < n; ++i, out += m) {
    const float first = p[i * r];
    for (int64_t j = 0; j < m; ++j) out[j] = first * q_t[j];
    for (int64_t k = 1; k < r; ++k) {
      const float pk = p[i * r + k];
      const float* qk = q_t + k * m;
      for (int64_t j = 0; j < m; ++j) {
        const float product = pk * qk[j];
        out[j] = out[j] + product;
      }
    }
  }
}

}  // namespace

void exact_outer_product(torch::Tensor out, const torch::Tensor& p, const torch::Tensor& q) {
  if (out.is_cpu() && out.scalar_type() == torch::kFloat32 && out.is_contiguous()) {
    const auto p_rows = p.contiguous(), q_t = q.t().contiguous();
    outer_product_rows(out.data_ptr<float>(), p_rows.data_ptr<float>(), q_t.data_ptr<float>(), out.size(0),
                       out.size(1), p.size(1));
    return;
  }
  torch::mul_out(out, p.narrow(1, 0, 1), q.narrow(1, 0, 1).t());
  for (int64_t k = 1; k < p.size(1); ++k) out.add_(p.narrow(1, k, 1) * q.narrow(1, k, 1).t());
}

void orthogonalize(torch::Tensor& matrix, double epsilon, Sums sums) {
  auto row_sum = [sums](const torch::Tensor& a) { return sums == Sums::kExact ? exact_row_sum(a) : a.sum(0); };
  const int64_t cols = matrix.size(1);
  for (int64_t i = 0; i < cols; ++i) {
    auto col = matrix.narrow(1, i, 1);
    auto norm = row_sum(col * col).sqrt_();
    if (epsilon == 0) {
      norm.clamp_min_(std::numeric_limits<float>::min());  // a zero column stays zero, never NaN
    } else {
      norm.add_(epsilon);
    }
    col.div_(norm);
    if (i + 1 < cols) {
      auto rest = matrix.narrow(1, i + 1, cols - i - 1);
      rest.sub_(col * row_sum(col * rest));
    }
  }
}

}  // namespace mnist_ddp
