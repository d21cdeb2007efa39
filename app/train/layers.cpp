#include "app/train/layers.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

namespace mnist_ddp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether dropout with this p can draw its decisions with draw_keeps().
bool drawable(double p) { return p >= 0 && p < 1 && p * 256 == std::floor(p * 256); }

// Decisions from `Bits` bits each, 64 / Bits per draw (a whole number of
// compile-time shifts per draw, so that the loop unrolls).
template <int Bits>
void draw_keeps(uint8_t* out, int64_t n, uint64_t below, uint8_t kept, at::CPUGeneratorImpl& engine) {
  constexpr int64_t per_draw = 64 / Bits;
  constexpr uint64_t mask = (uint64_t{1} << Bits) - 1;
  for (int64_t i = 0; i < n; i += per_draw) {
    const uint64_t word = engine.random64();
    if (n - i >= per_draw) {
      for (int64_t k = 0; k < per_draw; ++k) out[i + k] = ((word >> (k * Bits)) & mask) >= below ? kept : 0;
    } else {
      for (int64_t k = 0; k < n - i; ++k) out[i + k] = ((word >> (k * Bits)) & mask) >= below ? kept : 0;
    }
  }
}

// Dropout's keep/drop decisions for n elements, with p = k / 2^bits
// (bits <= 8): an element is dropped when its `bits` random bits, read as a
// number, are below k. out[i] = `kept` or 0. The bits come from 64-bit
// draws of the default CPU generator, lowest bits first.
void draw_keeps(uint8_t* out, int64_t n, double p, uint8_t kept) {
  int bits = 0;
  while (bits < 8 && p * (1 << bits) != std::floor(p * (1 << bits))) ++bits;
  const uint64_t below = static_cast<uint64_t>(p * (1 << bits));
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  auto& engine = *generator.get<at::CPUGeneratorImpl>();
  switch (bits) {
    case 0: std::memset(out, kept, static_cast<size_t>(n)); return;
    case 1: return draw_keeps<1>(out, n, below, kept, engine);
    case 2: return draw_keeps<2>(out, n, below, kept, engine);
    case 3: return draw_keeps<3>(out, n, below, kept, engine);
    case 4: return draw_keeps<4>(out, n, below, kept, engine);
    case 5: return draw_keeps<5>(out, n, below, kept, engine);
    case 6: return draw_keeps<6>(out, n, below, kept, engine);
    case 7: return draw_keeps<7>(out, n, below, kept, engine);
    default: return draw_keeps<8>(out, n, below, kept, engine);
  }
}

bool fusable(const torch::Tensor& x, double p) {
  return x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && drawable(p);
}

// Per output: which of the 2x2 window won (0..3, row-major) in bits 0-1,
// and whether dropout kept it in bit 2.
constexpr uint8_t kKept = 4;

class MaxPool2DropoutFunction : public torch::autograd::Function<MaxPool2DropoutFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, double p) {
    const auto x = input.contiguous();
    const int64_t planes = x.size(0) * x.size(1), h = x.size(2), w = x.size(3), oh = h / 2, ow = w / 2;
    auto out = torch::empty({x.size(0), x.size(1), oh, ow}, x.options());
    auto codes = torch::empty({x.size(0), x.size(1), oh, ow}, x.options().dtype(torch::kUInt8));
    const float scale = static_cast<float>(1.0 / (1.0 - p));
    const float* in = x.data_ptr<float>();
    float* o = out.data_ptr<float>();
    uint8_t* code = codes.data_ptr<uint8_t>();
    draw_keeps(code, codes.numel(), p, kKept);
    for (int64_t plane = 0; plane < planes; ++plane) {
      for (int64_t i = 0; i < oh; ++i, o += ow, code += ow) {
        const float* top = in + (plane * h + 2 * i) * w;
        const float* bottom = top + w;
        for (int64_t j = 0; j < ow; ++j) {
          // As ATen: the window's first value, then each later one that is
          // greater, or NaN. Branch-free, so that it vectorises.
          const float a = top[2 * j], b = top[2 * j + 1], c = bottom[2 * j], d = bottom[2 * j + 1];
          const bool to_b = (b > a) | (b != b);
          float best = to_b ? b : a;
          uint8_t at = to_b ? 1 : 0;
          const bool to_c = (c > best) | (c != c);
          best = to_c ? c : best;
          at = to_c ? 2 : at;
          const bool to_d = (d > best) | (d != d);
          best = to_d ? d : best;
          at = to_d ? 3 : at;
          const uint8_t kept = code[j];
          o[j] = best * (kept ? scale : 0.0f);  // as ATen's x * mask: a dropped NaN stays NaN
          code[j] = static_cast<uint8_t>(kept | at);
        }
      }
    }
    ctx->save_for_backward({codes});
    ctx->saved_data["height"] = h;
    ctx->saved_data["width"] = w;
    ctx->saved_data["scale"] = static_cast<double>(scale);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto codes = ctx->get_saved_variables()[0];
    const int64_t h = ctx->saved_data["height"].toInt(), w = ctx->saved_data["width"].toInt();
    const float scale = static_cast<float>(ctx->saved_data["scale"].toDouble());
    const auto dy = grad_outputs[0].contiguous();
    const int64_t planes = codes.size(0) * codes.size(1), oh = codes.size(2), ow = codes.size(3);
    auto dx = torch::zeros({codes.size(0), codes.size(1), h, w}, dy.options());
    const float* g = dy.data_ptr<float>();
    const uint8_t* code = codes.data_ptr<uint8_t>();
    float* d = dx.data_ptr<float>();
    for (int64_t plane = 0; plane < planes; ++plane) {
      for (int64_t i = 0; i < oh; ++i) {
        float* top = d + (plane * h + 2 * i) * w;
        for (int64_t j = 0; j < ow; ++j, ++g, ++code) {
          const uint8_t at = *code & 3;
          top[(at >> 1) * w + 2 * j + (at & 1)] = *g * ((*code & kKept) ? scale : 0.0f);
        }
      }
    }
    return {dx, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor max_pool2_dropout(const torch::Tensor& x, double p, bool training) {
  if (!training) return torch::max_pool2d(x, 2);
  if (!fusable(x, p) || x.dim() != 4) return torch::dropout(torch::max_pool2d(x, 2), p, true);
  return MaxPool2DropoutFunction::apply(x, p);
}

torch::Tensor net_dropout(const torch::Tensor& x, double p, bool training) {
  if (!training) return x;
  if (!fusable(x, p)) return torch::dropout(x, p, true);
  std::vector<uint8_t> keeps(static_cast<size_t>(x.numel()));
  draw_keeps(keeps.data(), x.numel(), p, 1);
  auto mask = torch::empty(x.sizes(), x.options());
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  float* m = mask.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) m[i] = keeps[i] ? scale : 0.0f;
  return x * mask;
}

}  // namespace mnist_ddp
