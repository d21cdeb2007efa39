// Who in the library issues a collective, as comm/issuer.hpp's kinds, and
// what to do when ranks are found in different ones: the advice table the
// watch and the check print (set_advice()). Not installed.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "comm/issuer.hpp"

namespace mnist_ddp {

// The library's issuers. Training ones are those every rank issues in
// every step of a training loop.
enum IssuerKind : int {
  kBucket = 1,         // a DDP bucket's backward: its hook's collectives
  kHookAgreement,      // register_comm_hook's comparison, at the first backward
  kUnusedCount,        // DDP's count of the ranks that used each parameter
  kBuffers,            // DDP's buffers, broadcast before a forward
  kDdpStart,           // DDP's construction: the models compared, rank 0's state
  kRebuild,            // static_graph's buckets rebuilt in rank 0's order
  kReplicaCheck,       // check_replicas()
  kJoinVote,           // ddp.join(): a step's count of the ranks with data
  kJoined,             // ddp.join(): a rank whose data ran out, serving the others
  kJoinEnd,            // ddp.join(): the last rank's state, once every rank has joined
  kSyncBnForward,      // a SyncBatchNorm's forward with autograd (a training step's)
  kSyncBnSampling,     // a SyncBatchNorm's train-mode forward without autograd (sampling, evaluating)
  kSyncBnBackward,     // a SyncBatchNorm's backward
  kScalerVote,         // GradScaler's vote on skipping a step
};

// How one DistributedDataParallel names what it issues. While it is its
// group's only one: "DDP bucket 3's backward", "DistributedDataParallel's
// buffers before a forward". Once the group has several, each by its
// place, the first too: "the first DDP's bucket 3's backward", "the second
// DistributedDataParallel's buffers before a forward". A rank may build
// its second DDP before another does: the check compares the issuers' keys
// (the words without the place, and the place), never the words.
class DdpNames {
 public:
  DdpNames() = default;  // a group's only DDP
  // The `model`th DDP of a group that has built `models` (model_group()).
  DdpNames(int model, std::shared_ptr<const std::atomic<int>> models) : model_(model), models_(std::move(models)) {}
  Issuer issuer(IssuerKind kind, const std::string& what) const;
  Issuer bucket(int index) const;

 private:
  bool placed() const { return model_ > 0 || (models_ && models_->load() > 1); }
  Issuer named(int kind, int index, const std::string& alone, const std::string& placed_text) const;
  int model_ = 0;
  std::shared_ptr<const std::atomic<int>> models_;
};

// Registers the library's advice table with the comm layer (once; every
// constructor of a DDP, SyncBatchNorm and GradScaler calls it).
void use_library_advice();

// The table itself: what to do about ranks found where `where` says.
std::string library_advice(const std::vector<Whereabouts>& where);

}  // namespace mnist_ddp
