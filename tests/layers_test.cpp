// Net's hand-written CPU layers against ATen's max_pool2d and dropout.
#include <gtest/gtest.h>

#include <limits>

#include "app/train/layers.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

// Small integers: many ties inside the windows; NaN and infinities at fixed
// places; an odd height and width, so a row and a column belong to no window.
torch::Tensor tricky_input(int64_t h, int64_t w) {
  torch::manual_seed(3);
  auto x = torch::randint(-3, 4, {2, 3, h, w}).to(torch::kFloat32);
  x[0][0][0][1] = std::numeric_limits<float>::quiet_NaN();
  x[0][1][2][2] = -std::numeric_limits<float>::infinity();
  x[1][2][1][0] = std::numeric_limits<float>::infinity();
  return x;
}

TEST(Layers, MaxPoolWithoutDropoutIsAtensMaxPoolAndItsGradientBitForBit) {
  for (auto [h, w] : {std::pair<int64_t, int64_t>{6, 8}, {5, 7}}) {
    const auto x = tricky_input(h, w);
    auto mine = x.clone().requires_grad_(true), theirs = x.clone().requires_grad_(true);
    const auto out = max_pool2_dropout(mine, 0.0, /*training=*/true);
    const auto expected = torch::max_pool2d(theirs, 2);
    EXPECT_TRUE(torch::equal(out.isnan(), expected.isnan()));
    EXPECT_TRUE(torch::equal(out.nan_to_num(0), expected.nan_to_num(0)));
    const auto dy = torch::randn(out.sizes());
    out.backward(dy);
    expected.backward(dy);
    EXPECT_TRUE(torch::equal(mine.grad(), theirs.grad())) << h << "x" << w;
  }
}

TEST(Layers, MaxPoolDropoutKeepsOneMinusPScaledAndRoutesGradientsThroughTheKeptMaxima) {
  torch::manual_seed(5);
  const auto x = (torch::rand({32, 64, 24, 24}) + 0.5).requires_grad_(true);  // positive: a kept output is never 0
  const auto out = max_pool2_dropout(x, 0.25, /*training=*/true);
  const auto pooled = torch::max_pool2d(x.detach(), 2);
  const auto kept = out.detach() != 0;
  EXPECT_NEAR(kept.to(torch::kFloat64).mean().item<double>(), 0.75, 0.005);
  EXPECT_TRUE(torch::equal(out.detach(), torch::where(kept, pooled * static_cast<float>(1 / 0.75), torch::zeros_like(pooled))));
  // The gradient is max-pool's, of the gradient dropout lets through.
  const auto dy = torch::randn(out.sizes());
  out.backward(dy);
  auto y = x.detach().clone().requires_grad_(true);
  torch::max_pool2d(y, 2).backward(dy * kept.to(torch::kFloat32) * static_cast<float>(1 / 0.75));
  EXPECT_TRUE(torch::equal(x.grad(), y.grad()));
  // Evaluation: max-pool alone.
  EXPECT_TRUE(torch::equal(max_pool2_dropout(x.detach(), 0.25, false), pooled));
}

TEST(Layers, MasksFollowTheDefaultGeneratorsSeed) {
  const auto x = torch::rand({4, 8, 10, 10}) + 0.5;
  auto masks = [&](uint64_t seed) {
    torch::manual_seed(seed);
    return std::make_pair(max_pool2_dropout(x, 0.25, true) != 0, net_dropout(x, 0.5, true) != 0);
  };
  const auto a = masks(1), b = masks(1), c = masks(2);
  EXPECT_TRUE(torch::equal(a.first, b.first));
  EXPECT_TRUE(torch::equal(a.second, b.second));
  EXPECT_FALSE(torch::equal(a.first, c.first));
  EXPECT_FALSE(torch::equal(a.second, c.second));
}

TEST(Layers, DropoutKeepsOneMinusPOfTheElementsScaledAndPassesTheirGradients) {
  for (double p : {0.5, 0.25, 0.3}) {  // 0.3 draws no bits of its own: ATen's dropout
    torch::manual_seed(7);
    const auto x = (torch::rand({256, 128}) + 0.5).requires_grad_(true);
    const auto out = net_dropout(x, p, /*training=*/true);
    const auto kept = out.detach() != 0;
    EXPECT_NEAR(kept.to(torch::kFloat64).mean().item<double>(), 1 - p, 0.01) << p;
    const auto scale = static_cast<float>(1 / (1 - p));
    EXPECT_LE(test::max_abs_diff(out.detach(), torch::where(kept, x.detach() * scale, torch::zeros_like(x))), 1e-6) << p;
    out.sum().backward();
    EXPECT_LE(test::max_abs_diff(x.grad(), kept.to(torch::kFloat32) * scale), 1e-6) << p;
    EXPECT_TRUE(torch::equal(net_dropout(x.detach(), p, false), x.detach()));
  }
}

}  // namespace
}  // namespace mnist_ddp
