// mnist_ddp: data-parallel training for LibTorch programs. The one header a
// program includes for the library (it brings every installed header, and
// of LibTorch what they use: a program includes <torch/torch.h> for its own
// model); docs/library.md shows the API and a porting guide.
//
//   auto group = mnist_ddp::init_process_group();   // the launcher's job, or a world of 1
//   mnist_ddp::convert_sync_batchnorm(model);
//   model->to(group.device());
//   mnist_ddp::DistributedDataParallel ddp(model, group, mnist_ddp::DdpOptions().bucket_cap_mb(25));
//   ddp.register_comm_hook(mnist_ddp::hooks::fp16_compress());
//   loss(ddp.forward(x)).backward();                // gradients averaged over ranks
#pragma once

#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/comm/process_group.hpp"
#include "mnist_ddp/parallel/amp.hpp"
#include "mnist_ddp/parallel/comm_hooks.hpp"
#include "mnist_ddp/parallel/distributed.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "mnist_ddp/version.hpp"
