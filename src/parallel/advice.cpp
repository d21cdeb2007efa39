// The advice table (advice.hpp): chosen by what each rank waits in, as
// kinds, never by searching an issuer's words.
#include "parallel/advice.hpp"

#include <algorithm>
#include <mutex>

namespace mnist_ddp {
namespace {

// "second", "third", ..., "11th": which DistributedDataParallel of its group.
std::string ordinal_of(int k) {
  static const char* const words[] = {"first", "second", "third", "fourth", "fifth",
                                      "sixth", "seventh", "eighth", "ninth", "tenth"};
  if (k < 10) return words[k];
  const int n = k + 1, last = n % 10;
  return std::to_string(n) + (n % 100 / 10 == 1 ? "th" : last == 1 ? "st" : last == 2 ? "nd" : last == 3 ? "rd" : "th");
}

bool training(const Whereabouts& w) {
  switch (w.issuer.kind) {
    case kBucket: case kHookAgreement: case kUnusedCount: case kBuffers: case kRebuild: case kJoinVote:
    case kSyncBnForward: case kSyncBnBackward: case kScalerVote:
      return !w.ended;
    default:
      return false;
  }
}

const char* const kSyncBnAdvice =
    "a train-mode forward through SyncBatchNorm must run on every rank (evaluate or sample under eval(), or on "
    "every rank)";
const char* const kUnevenAdvice =
    "the ranks ran different numbers of steps (uneven inputs): give every rank as many batches, or wrap each "
    "rank's training loop in ddp.join()";

}  // namespace

// The ranks agree on the words a DDP's place leaves out, and on the place.
Issuer DdpNames::named(int kind, int index, const std::string& alone, const std::string& placed_text) const {
  Issuer issuer(kind, model_, index, placed() ? placed_text : alone);
  issuer.key = alone + "#" + std::to_string(model_);
  return issuer;
}

Issuer DdpNames::issuer(IssuerKind kind, const std::string& what) const {
  const std::string the = "the " + ordinal_of(model_) + " ";
  if (what.rfind("the ", 0) == 0)  // "the replica check": "the second DistributedDataParallel's replica check"
    return named(kind, -1, what, the + "DistributedDataParallel's " + what.substr(4));
  if (what.rfind("DistributedDataParallel", 0) == 0) return named(kind, -1, what, the + what);
  return named(kind, -1, what, the + "DistributedDataParallel's " + what);  // "register_comm_hook"
}

Issuer DdpNames::bucket(int index) const {
  const std::string b = std::to_string(index);
  return named(kBucket, index, "DDP bucket " + b + "'s backward",
               "the " + ordinal_of(model_) + " DDP's bucket " + b + "'s backward");
}

std::string library_advice(const std::vector<Whereabouts>& where) {
  auto any = [&](auto pred) { return std::any_of(where.begin(), where.end(), pred); };
  auto all = [&](auto pred) { return std::all_of(where.begin(), where.end(), pred); };
  auto kind = [](int k) { return [k](const Whereabouts& w) { return !w.ended && w.issuer.kind == k; }; };
  // A sampling forward names itself, whatever the others do: join() cannot help it.
  if (any(kind(kSyncBnSampling))) return kSyncBnAdvice;
  // A rank whose data ran out serves only the DDP that joined: the others did not call join() alike.
  if (any(kind(kJoined)) && !all(kind(kJoined)))
    return "every rank must call ddp.join() around its training loop, and a rank whose data ran out serves only "
           "the DistributedDataParallel it joined";
  if (any(training) && !all(training)) {
    // One rank in a collective of the program's own where the others train:
    // an extra collective on some ranks, or a rank whose steps ran out.
    if (any(kind(kProgram)))
      return "every rank must issue the program's own collectives at the same point of its loop (here some ranks "
             "issue one where the others train); if the ranks ran different numbers of steps (uneven inputs), give "
             "every rank as many batches, or wrap each rank's training loop in ddp.join()";
    return kUnevenAdvice;
  }
  // A step's count of the ranks with data where another rank trains on: join() around some ranks' loops only.
  if (any(kind(kJoinVote)) && !all(kind(kJoinVote)))
    return "every rank must call ddp.join() around its training loop, on the same DistributedDataParallel";
  if (any(kind(kSyncBnForward))) return kSyncBnAdvice;
  if (all([](const Whereabouts& w) { return !w.ended && (w.issuer.kind == kBucket || w.issuer.kind == kHookAgreement); }))
    return "every rank must build the same model and register the same communication hook";
  return generic_advice();
}

void use_library_advice() {
  static std::once_flag once;
  std::call_once(once, [] { set_advice(&library_advice); });
}

}  // namespace mnist_ddp
