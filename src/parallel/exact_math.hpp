// Note on exact math. What a rank computes from a collective's result and
// keeps (the averaged gradient, so the parameters; SyncBatchNorm's running
// statistics) must come out bit-identical on every rank, whatever its thread
// count, CPU or GPU model. Matrix products and ATen's reductions do not
// promise that: they split the work, and so the rounding, by thread count
// and device. Elementwise operations do: IEEE rounds each one exactly. So
// the math that follows a collective uses elementwise operations only, and
// its sums are pairwise trees of elementwise adds whose shape depends on the
// size alone.
#pragma once

#include <torch/torch.h>

namespace mnist_ddp {

// The sum of the rows of `a` [n, k], as [k]: exact in the sense above.
torch::Tensor exact_row_sum(const torch::Tensor& a);

// out [n, m] = p [n, r] q [m, r]^T: r outer products added in order, exact
// in the sense above.
void exact_outer_product(torch::Tensor out, const torch::Tensor& p, const torch::Tensor& q);

// Gram-Schmidt on the columns of `matrix` [n, r], in place. A column of
// zeros stays zeros (no division by a zero norm); epsilon is added to each
// norm as PyTorch does. `exact` in the sense above, as P after its allreduce
// needs; Q is orthogonalised before it meets the data, and only the
// allreduced P = M Q depends on it, so it may take ATen's faster sums (on a
// GPU, a tree is a dozen kernel launches per column).
enum class Sums { kExact, kFast };
void orthogonalize(torch::Tensor& matrix, double epsilon, Sums sums = Sums::kExact);

}  // namespace mnist_ddp
