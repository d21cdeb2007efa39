// The check before each collective, and ddp.join()'s serving of the
// others' collectives (collectives.hpp, "Note on the check").
#include "comm/collectives.hpp"

#include <algorithm>
#include <cmath>

#include "comm/shared_memory.hpp"

namespace mnist_ddp {

namespace {

// A check is one float64 sum: [the inlined sum's elements | the fields | a
// bitmap of the active ranks]. Every field is summed over the ranks that
// are active (not joined), and every value stays an integer far below 2^53,
// so the sums are exact.
enum Field : int64_t { kActive, kOp, kDtype, kNumel, kRoot, kInlined, kStop, kPrint, kSquare = kPrint + 3, kFields = kSquare + 3 };
constexpr int kPieces = 3;        // a description's fingerprint: 3 pieces of 16 bits
constexpr int kBitsPerWord = 48;  // active ranks, 48 to a float64
constexpr size_t kMaxPending = 64;  // Check::alongside: checks in flight before the lane waits for the oldest
const char* const kJoinedWords = "ddp.join(): its data ran out";

const char* op_name(Op op) {
  switch (op) {
    case Op::allreduce: return "allreduce";
    case Op::broadcast: return "broadcast";
    case Op::gather: return "gather";
    case Op::allgather: return "allgather";
    case Op::barrier: return "barrier";
  }
  return "?";
}

int64_t bitmap_words(int world) { return (world + kBitsPerWord - 1) / kBitsPerWord; }

}  // namespace

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "float32";
    case c10::kDouble: return "float64";
    case c10::kHalf: return "float16";
    case c10::kBFloat16: return "bfloat16";
    case c10::kLong: return "int64";
    case c10::kInt: return "int32";
    case c10::kByte: return "uint8";
    case c10::kBool: return "bool";
    default: return c10::toString(t);
  }
}

namespace {

// "DDP bucket 0's backward (allreduce, 1181066 float32)": what a rank's
// messages say it was in. A broadcast from kAuthority is "from rank 0",
// which it is unless ranks have joined.
std::string describe(const std::string& issuer, Op op, const torch::Tensor& tensor, int root) {
  std::string d = issuer + " (" + op_name(op);
  if (tensor.defined())
    d += ", " + std::to_string(tensor.numel()) + (tensor.is_sparse() ? " sparse " : " ") + dtype_name(tensor.scalar_type());
  if (op == Op::broadcast) d += ", from rank " + std::to_string(root == kAuthority ? 0 : root);
  return d + ")";
}

// Whether the active ranks of summed check `s` (its fields, from kActive)
// all gave the fingerprint `pieces`, or, for a joined rank (`pieces`
// nullptr), all gave one fingerprint. By Cauchy-Schwarz, n values whose sum
// is n a and whose squares sum to n a^2 are all a; the sums are exact.
bool all_agree(const double* s, const int64_t* pieces) {
  const double n = s[kActive];
  for (int i = 0; i < kPieces; ++i) {
    const double a = pieces ? static_cast<double>(pieces[i]) : s[kPrint + i] / n;
    if (a != std::floor(a) || s[kPrint + i] != n * a || s[kSquare + i] != n * a * a) return false;
  }
  return true;
}

}  // namespace

torch::Tensor Channel::check_tensor(const Described* mine) const {
  const int64_t words = bitmap_words(world_size());
  auto sums = torch::zeros({inline_ + kFields + words}, torch::kFloat64);
  if (!mine) return sums;
  double* f = sums.data_ptr<double>() + inline_;
  f[kActive] = 1;
  f[kOp] = static_cast<double>(static_cast<int64_t>(mine->op));
  f[kDtype] = static_cast<double>(mine->dtype);
  f[kNumel] = static_cast<double>(mine->numel);
  f[kRoot] = mine->root;
  f[kInlined] = mine->inlined ? 1 : 0;
  for (int i = 0; i < kPieces; ++i) {
    f[kPrint + i] = static_cast<double>(mine->pieces[i]);
    f[kSquare + i] = static_cast<double>(mine->pieces[i]) * static_cast<double>(mine->pieces[i]);
  }
  f[kFields + rank() / kBitsPerWord] = std::ldexp(1.0, rank() % kBitsPerWord);
  return sums;
}

void Channel::exchange_check(torch::Tensor& sums) {
  CollectiveWatch::Wait wait;
  auto stalled = [&] {
    if (watch_) watch_->stalled(*lane_, wait);
  };
  if (!shared_) {
    std::vector<at::Tensor> tensors{sums};
    return await(check_group_->allreduce(tensors));
  }
  try {
    shared_->allreduce_sum(sums, stalled);
  } catch (const PeerLost&) {
    explained(std::current_exception());
  }
}

Channel::Outcome Channel::verify(const torch::Tensor& sums, const Described* mine, uint64_t position) {
  const double* s = sums.data_ptr<double>() + inline_;
  const auto n = s[kActive];
  auto active = [&](int r) { return ((static_cast<uint64_t>(s[kFields + r / kBitsPerWord]) >> (r % kBitsPerWord)) & 1u) != 0; };
  if (s[kStop] > 0) {  // a rank ran out of data under join()'s throw_on_early_termination
    std::vector<int> joined;
    for (int r = 0; r < world_size(); ++r)
      if (!active(r)) joined.push_back(r);
    std::string who;
    for (int r : joined) who += (who.empty() ? "" : ", ") + std::to_string(r);
    const Error error("ddp.join(): rank" + std::string(joined.size() > 1 ? "s " : " ") + who +
                      " ran out of inputs, and throw_on_early_termination stops every rank there");
    if (watch_) watch_->mismatched(std::make_exception_ptr(error));  // every lane of this rank stops with it
    throw error;
  }
  if (n > 0 && !all_agree(s, mine ? mine->pieces : nullptr)) mismatch(position, mine ? mine->what : kJoinedWords);
  active_ = static_cast<int>(n);
  Outcome out;
  const int root = static_cast<int>(std::lround(s[kRoot] / n));
  out.root = root;
  out.served = s[kInlined] > 0;
  if (root != kAuthority) return out;
  // The authority: rank 0 while it is active, else the highest active rank.
  out.root = 0;
  if (!active(0))
    for (int r = world_size() - 1; r > 0 && out.root == 0; --r)
      if (active(r)) out.root = r;
  return out;
}

void Channel::mismatch(uint64_t position, const std::string& mine) {
  const std::string line = watch_ ? watch_->mismatch_line(lane_->name, position, mine) : mine;
  const CollectiveMismatch error(line);
  if (watch_) watch_->mismatched(std::make_exception_ptr(error));  // this rank's other lanes end with it too
  throw error;
}

Channel::Outcome Channel::check(Op op, const torch::Tensor& tensor, int root, torch::Tensor* inlined) {
  Outcome out;
  out.root = root == kAuthority ? 0 : root;
  if (world_size() == 1 || check_ == Check::off || follows_checked()) return out;
  if (run_ == Run::first) run_ = Run::following;
  if (probe) probe->checked();
  if (watch_)
    if (auto error = watch_->mismatch()) std::rethrow_exception(error);
  Described d;
  d.op = op;
  d.dtype = tensor.defined() ? static_cast<int64_t>(tensor.scalar_type()) : -1;
  d.numel = tensor.defined() ? tensor.numel() : 0;
  d.root = root;
  d.inlined = inlined != nullptr;
  d.what = describe(issuer_, op, tensor, root);
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (const unsigned char c : d.what) h = (h ^ c) * 0x100000001b3ull;
  for (int i = 0; i < kPieces; ++i) d.pieces[i] = static_cast<int64_t>((h >> (16 * i)) & 0xffff);
  uint64_t position;
  {
    std::lock_guard<std::mutex> lock(lane_->mutex);
    position = lane_->passed;
    lane_->what = d.what;
  }
  auto sums = check_tensor(&d);
  if (check_ == Check::alongside && root != kAuthority) {
    // Issued at once; the check is held to it when it completes.
    while (!pending_.empty() && settle_oldest(pending_.size() >= kMaxPending)) {
    }
    auto pending = std::make_unique<Pending>();
    pending->position = position;
    pending->described = d;
    pending->sums = sums;
    std::vector<at::Tensor> tensors{sums};
    pending->done = check_group_->allreduce(tensors)->getFuture();
    if (watch_) {
      // Said at once, so that a rank whose collective hangs (NCCL, on a
      // mismatch of sizes) is woken by its waits (CollectiveStream::wait).
      pending->done->addCallback([watch = watch_, lane = lane_->name, position, d, sums, offset = inline_](
                                     c10::ivalue::Future& done) {
        if (done.hasError() || all_agree(sums.data_ptr<double>() + offset, d.pieces)) return;
        watch->mismatched(std::make_exception_ptr(CollectiveMismatch(watch->mismatch_line(lane, position, d.what))));
      });
    }
    pending_.push_back(std::move(pending));
    std::lock_guard<std::mutex> lock(lane_->mutex);
    ++lane_->passed;
    return out;
  }
  settle();  // a broadcast from the authority needs every earlier check's word on who has joined
  if (inlined) sums.slice(0, 0, d.numel).copy_(inlined->reshape(-1));
  {
    std::lock_guard<std::mutex> lock(lane_->mutex);
    lane_->waiting = lane_->checking = true;
  }
  exchange_check(sums);
  {
    std::lock_guard<std::mutex> lock(lane_->mutex);
    lane_->waiting = lane_->checking = false;
  }
  out = verify(sums, &d, position);
  if (inlined) inlined->copy_(sums.slice(0, 0, d.numel).view(inlined->sizes()));
  std::lock_guard<std::mutex> lock(lane_->mutex);
  ++lane_->passed;
  return out;
}

bool Channel::settle_oldest(bool block) {
  if (watch_)
    if (auto error = watch_->mismatch()) std::rethrow_exception(error);
  Pending& oldest = *pending_.front();
  if (!oldest.done->completed()) {
    if (!block) return false;
    oldest.done->wait();
  }
  if (oldest.done->hasError()) explained(oldest.done->exception_ptr());
  const auto position = oldest.position;
  const Described d = oldest.described;
  const torch::Tensor sums = oldest.sums;
  pending_.pop_front();
  verify(sums, &d, position);
  return true;
}

void Channel::settle() {
  while (!pending_.empty()) settle_oldest(true);
}

int Channel::serve_until_all_joined(bool stop_everyone) {
  if (world_size() == 1) return 0;
  TORCH_CHECK(check_ != Check::off, "serve_until_all_joined: the check is off");  // join() refuses that first
  settle();
  uint64_t stamp;
  {
    std::lock_guard<std::mutex> lock(lane_->mutex);
    stamp = lane_->passed;
  }
  for (;;) {
    uint64_t position;
    {
      std::lock_guard<std::mutex> lock(lane_->mutex);
      position = lane_->passed;
      lane_->what = kJoinedWords;
      lane_->waiting = lane_->checking = true;
    }
    torch::Tensor sums = check_tensor(nullptr);
    if (stop_everyone) sums[inline_ + kStop] = 1.0;
    exchange_check(sums);
    {
      std::lock_guard<std::mutex> lock(lane_->mutex);
      lane_->waiting = lane_->checking = false;
    }
    const double* s = sums.data_ptr<double>() + inline_;
    const double n = s[kActive];
    if (n == 0) break;  // every rank has joined
    const Outcome checked = verify(sums, nullptr, position);
    {
      std::lock_guard<std::mutex> lock(lane_->mutex);
      ++lane_->passed;
    }
    if (checked.served) continue;  // the sum travelled in the check, this rank's zeros with it
    // What the active ranks issue, with nothing of this rank's in it.
    const auto op = static_cast<Op>(std::lround(s[kOp] / n));
    const auto dtype = std::lround(s[kDtype] / n);
    torch::Tensor zeros;
    if (dtype >= 0)
      zeros = torch::zeros({static_cast<int64_t>(std::llround(s[kNumel] / n))},
                           torch::TensorOptions(static_cast<c10::ScalarType>(dtype)).device(device_));
    switch (op) {
      case Op::allreduce: sum_unchecked(zeros)->waitAndThrow(); break;
      case Op::broadcast: broadcast_unchecked(zeros, checked.root); break;
      case Op::gather: gather_unchecked(zeros); break;
      case Op::allgather: allgather_unchecked(zeros); break;
      case Op::barrier:
        if (check_ == Check::alongside) group_->barrier()->wait();
        break;
    }
  }
  // Every rank has joined: the one whose lane passed the most checks
  // before joining joined last.
  auto stamps = torch::zeros({world_size()}, torch::kFloat64);
  stamps[rank()] = static_cast<double>(stamp);
  exchange_check(stamps);
  return static_cast<int>(stamps.argmax().item<int64_t>());
}

void Channel::issue(const char* kind, const torch::Tensor& tensor) {
  if (!probe) return;
  std::ostringstream s;
  s << kind;
  if (tensor.defined()) s << " " << tensor.scalar_type() << " " << tensor.sizes();
  probe->issued(s.str());
}

namespace {

constexpr char kItemEnd = '\x1e', kItemField = '\x1f';

std::vector<std::pair<std::string, std::string>> items_of(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> items;
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = std::min(text.find(kItemEnd, at), text.size());
    const std::string item = text.substr(at, end - at);
    const size_t field = item.find(kItemField);
    if (field != std::string::npos) items.emplace_back(item.substr(0, field), item.substr(field + 1));
    at = end + 1;
  }
  return items;
}

// How rank `r`'s items first differ from rank `first`'s ("" where they do not).
std::string first_difference(const std::vector<std::pair<std::string, std::string>>& zero,
                             const std::vector<std::pair<std::string, std::string>>& theirs, int r, int first) {
  const std::string who = "rank " + std::to_string(r), whom = "rank " + std::to_string(first);
  for (size_t i = 0; i < std::max(zero.size(), theirs.size()); ++i) {
    if (i < zero.size() && i < theirs.size() && zero[i] == theirs[i]) continue;
    if (i < zero.size() && i < theirs.size() && zero[i].first == theirs[i].first)
      return who + "'s " + zero[i].first + " is " + theirs[i].second + ", " + whom + "'s is " + zero[i].second;
    const auto holds = [](const auto& items, const std::string& name) {
      return std::find_if(items.begin(), items.end(), [&](const auto& item) { return item.first == name; });
    };
    if (i < theirs.size()) {
      const auto in_zero = holds(zero, theirs[i].first);
      if (in_zero == zero.end())
        return who + " has " + theirs[i].first + " (" + theirs[i].second + "), " + whom + " has none";
      if (in_zero->second == theirs[i].second && i < zero.size() && holds(theirs, zero[i].first) != theirs.end())
        return who + " registers " + theirs[i].first + " where " + whom + " registers " + zero[i].first +
               ": the same tensors in another order";
    }
    if (i < zero.size() && holds(theirs, zero[i].first) == theirs.end())
      return who + " has no " + zero[i].first + ", " + whom + "'s is " + zero[i].second;
    if (i < zero.size() && i < theirs.size())
      return who + "'s " + theirs[i].first + " is " + theirs[i].second + " where " + whom + " has " + zero[i].first +
             " (" + zero[i].second + ")";
    return who + " has " + theirs[i].first + " (" + theirs[i].second + "), " + whom + " has none";
  }
  return "";
}

}  // namespace

std::string Channel::disagreement(const std::vector<std::pair<std::string, std::string>>& items,
                                  const std::string& subject, const std::string& advice) {
  if (world_size() == 1) return "";
  std::string text;
  for (const auto& [name, value] : items) text += name + kItemField + value + kItemEnd;
  const std::string issuer = issuer_;
  issuer_ = subject + ": what every rank must share";
  const torch::Device where = staging();
  const auto lengths = allgather(torch::tensor({static_cast<int64_t>(text.size())}, torch::kInt64).to(where)).cpu();
  const int64_t longest = lengths.max().item<int64_t>();
  auto mine = torch::zeros({longest}, torch::kUInt8);
  std::copy(text.begin(), text.end(), static_cast<char*>(mine.data_ptr()));
  const auto all = allgather(mine.to(where)).cpu().contiguous();
  issuer_ = issuer;
  auto text_of_rank = [&](int r) {
    const auto* bytes = static_cast<const char*>(all[r].data_ptr());
    return std::string(bytes, static_cast<size_t>(lengths[r].item<int64_t>()));
  };
  // A rank that has joined serves the allgathers with zeros: it said nothing.
  int first = -1;
  for (int r = 0; r < world_size() && first < 0; ++r)
    if (lengths[r].item<int64_t>() > 0) first = r;
  if (first < 0) return "";
  const auto reference = items_of(text_of_rank(first));
  for (int r = first + 1; r < world_size(); ++r) {
    if (lengths[r].item<int64_t>() == 0) continue;
    const std::string difference = first_difference(reference, items_of(text_of_rank(r)), r, first);
    if (!difference.empty()) return subject + ": " + difference + ": " + advice;
  }
  return "";
}

}  // namespace mnist_ddp
