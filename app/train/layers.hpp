// Net's parameter-free layers after the convolutions, written for the CPU.
//
// Why: in LibTorch 1.13 a CPU step spent 5.7 ms in max_pool2d (an NCHW
// kernel that goes element by element with 64-bit indices) and 3.5 ms in
// dropout's bernoulli_ (a double drawn and compared per element), against
// about 40 ms for the whole step. Here max-pool and the dropout after it
// are one pass that writes the output and one byte per output (which of the
// four won, whether it was kept); backward is one pass that writes the
// input's gradient. A keep/drop decision takes the few bits it needs from
// one 64-bit draw of LibTorch's default CPU generator, so the masks follow
// torch::manual_seed and the generator state a checkpoint saves.
//
// The values are the reference's: max-pool picks and propagates as ATen's
// kernel does (first maximum in row-major order; NaN wins), dropout keeps
// an element with probability 1 - p and scales it by 1 / (1 - p). The masks
// are drawn differently from ATen's, so a given seed drops other elements.
#pragma once

#include <torch/torch.h>

namespace mnist_ddp {

// dropout(max_pool2d(x, 2), p) in training, max_pool2d(x, 2) otherwise. On
// a contiguous float32 CPU tensor [N, C, H, W], with p a multiple of 1/256
// in [0, 1), it runs fused; anywhere else (CUDA, other p) as ATen's two ops.
torch::Tensor max_pool2_dropout(const torch::Tensor& x, double p, bool training);

// net_dropout(x, p) is dropout(x, p): in training on a float32 CPU tensor, with p a multiple of
// 1/256 in [0, 1), the mask is drawn as above; anywhere else ATen's.
torch::Tensor net_dropout(const torch::Tensor& x, double p, bool training);

}  // namespace mnist_ddp
