// The check before each collective, and ddp.join()'s serving of the
// others' collectives (collectives.hpp, "Note on the check").
#include "comm/collectives.hpp"

#include <algorithm>

#include "comm/shared_memory.hpp"

namespace mnist_ddp {

namespace {

// The check's row: one per rank (see "the check" in collectives.hpp).
enum Field : int64_t { kState, kFingerprint, kOp, kDtype, kNumel, kRoot, kStamp, kFields };
enum State : int64_t { kActive = 1, kJoined = 2 };
constexpr size_t kText = 240;  // characters of a rank's "what" exchanged on a mismatch

const char* op_name(int64_t op) {
  switch (static_cast<Op>(op)) {
    case Op::allreduce: return "allreduce";
    case Op::broadcast: return "broadcast";
    case Op::gather: return "gather";
    case Op::allgather: return "allgather";
    case Op::barrier: return "barrier";
  }
  return "?";
}

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

// "DDP bucket 0's backward (allreduce, 1181066 float32)"
std::string describe(const std::string& issuer, Op op, const torch::Tensor& tensor, int root) {
  std::string d = issuer + " (" + op_name(static_cast<int64_t>(op));
  if (tensor.defined()) d += ", " + std::to_string(tensor.numel()) + " " + dtype_name(tensor.scalar_type());
  if (op == Op::broadcast) d += root == kAuthority ? ", from the authority" : ", from rank " + std::to_string(root);
  return d + ")";
}

// 52 bits of FNV-1a over the description: exact in the int64 (and float64) sums.
int64_t fingerprint(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return static_cast<int64_t>(h & ((1ull << 52) - 1)) + 1;
}

}  // namespace

torch::Tensor Channel::exchange_rows(const std::vector<int64_t>& row, const std::string& what) {
  const int world = world_size(), fields = static_cast<int>(row.size());
  auto rows = torch::zeros({world * fields}, torch::kInt64);
  auto* data = rows.data_ptr<int64_t>();
  for (int f = 0; f < fields; ++f) data[rank() * fields + f] = row[f];
  {
    std::lock_guard<std::mutex> lock(lane_->mutex);
    lane_->waiting = true;
    lane_->what = what;
  }
  CollectiveWatch::Wait wait;
  auto stalled = [&] {
    if (watch_) watch_->stalled(*lane_, wait);
  };
  if (shared_) {
    shared_->allreduce_sum(rows, stalled);
  } else {
    std::vector<at::Tensor> tensors{rows};
    auto work = check_group_->allreduce(tensors);
    for (;;) {
      try {
        work->wait(std::chrono::milliseconds(500));
        break;
      } catch (...) {
        if (work->isCompleted()) throw;  // the sum failed; not the slice's timeout
      }
      stalled();
    }
  }
  std::lock_guard<std::mutex> lock(lane_->mutex);
  lane_->waiting = false;
  return rows.view({world, fields});
}

void Channel::mismatch(const torch::Tensor& rows, const std::string& what) {
  // Every rank saw the same rows, so every rank is here: one more sum
  // brings every rank's own words.
  std::vector<int64_t> text(kText, 0);
  for (size_t i = 0; i < std::min(kText, what.size()); ++i) text[i] = static_cast<unsigned char>(what[i]);
  const torch::Tensor all = exchange_rows(text, what);
  std::string line;
  std::vector<std::string> whats;
  for (int r = 0; r < world_size(); ++r) {
    std::string theirs;
    for (size_t i = 0; i < kText && all[r][static_cast<int64_t>(i)].item<int64_t>() != 0; ++i)
      theirs += static_cast<char>(all[r][static_cast<int64_t>(i)].item<int64_t>());
    if (rows[r][kState].item<int64_t>() == kJoined) theirs = "ddp.join(), its data run out";
    whats.push_back(theirs);
    line += (line.empty() ? "rank " : "; rank ") + std::to_string(r) + " is in " + theirs;
  }
  const CollectiveMismatch error(line + ": " + mismatch_advice(whats));
  if (watch_) watch_->mismatched(std::make_exception_ptr(error));  // this rank's other lanes end with it too
  throw error;
}

Channel::Checked Channel::check(Op op, const torch::Tensor& tensor, int root) {
  Checked checked;
  checked.root = root == kAuthority ? 0 : root;
  checked.active = world_size();
  if (world_size() == 1) return checked;
  const std::string what = describe(issuer_, op, tensor, root);
  const int64_t print = fingerprint(what);
  const torch::Tensor rows = exchange_rows(
      {kActive, print, static_cast<int64_t>(op), tensor.defined() ? static_cast<int64_t>(tensor.scalar_type()) : -1,
       tensor.defined() ? tensor.numel() : 0, root, 0},
      what);
  const auto row = rows.accessor<int64_t, 2>();  // every collective passes here: no tensor per field
  int highest_active = -1;
  checked.active = 0;
  for (int r = 0; r < world_size(); ++r) {
    if (row[r][kState] == kJoined) continue;
    if (row[r][kFingerprint] != print) mismatch(rows, what);
    ++checked.active;
    highest_active = r;
  }
  if (root == kAuthority && row[0][kState] == kJoined) checked.root = highest_active;
  std::lock_guard<std::mutex> lock(lane_->mutex);
  ++lane_->passed;
  return checked;
}

int Channel::serve_until_all_joined() {
  if (world_size() == 1) return 0;
  int64_t stamp;
  {
    std::lock_guard<std::mutex> lock(lane_->mutex);
    stamp = static_cast<int64_t>(lane_->passed);
  }
  const std::string what = "ddp.join(), its data run out";
  for (;;) {
    const torch::Tensor rows = exchange_rows({kJoined, 0, 0, 0, 0, 0, stamp}, what);
    int active = -1, last = 0;
    int64_t latest = -1;
    for (int r = 0; r < world_size(); ++r) {
      if (rows[r][kState].item<int64_t>() != kJoined) {
        if (active >= 0 && rows[r][kFingerprint].item<int64_t>() != rows[active][kFingerprint].item<int64_t>())
          mismatch(rows, what);
        if (active < 0) active = r;
      } else if (rows[r][kStamp].item<int64_t>() > latest) {
        latest = rows[r][kStamp].item<int64_t>();
        last = r;
      }
    }
    if (active < 0) return last;  // every rank has joined
    // What the active ranks issue, with nothing of this rank's in it.
    const auto row = rows[active];
    const auto op = static_cast<Op>(row[kOp].item<int64_t>());
    torch::Tensor zeros;
    if (row[kDtype].item<int64_t>() >= 0)
      zeros = torch::zeros({row[kNumel].item<int64_t>()},
                           torch::TensorOptions(static_cast<c10::ScalarType>(row[kDtype].item<int64_t>())).device(device_));
    int root = static_cast<int>(row[kRoot].item<int64_t>());
    if (root == kAuthority) {
      root = 0;
      if (rows[0][kState].item<int64_t>() == kJoined)
        for (int r = 0; r < world_size(); ++r)
          if (rows[r][kState].item<int64_t>() != kJoined) root = r;
    }
    switch (op) {
      case Op::allreduce: sum_unchecked(zeros)->waitAndThrow(); break;
      case Op::broadcast: broadcast_unchecked(zeros, root); break;
      case Op::gather: gather_unchecked(zeros); break;
      case Op::allgather: allgather_unchecked(zeros); break;
      case Op::barrier: issue("barrier", torch::Tensor()); group_->barrier()->wait(); break;
    }
    std::lock_guard<std::mutex> lock(lane_->mutex);
    ++lane_->passed;
  }
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

// How rank `r`'s items first differ from rank 0's ("" where they do not).
std::string first_difference(const std::vector<std::pair<std::string, std::string>>& zero,
                             const std::vector<std::pair<std::string, std::string>>& theirs, int r) {
  const std::string who = "rank " + std::to_string(r);
  for (size_t i = 0; i < std::max(zero.size(), theirs.size()); ++i) {
    if (i < zero.size() && i < theirs.size() && zero[i] == theirs[i]) continue;
    if (i < zero.size() && i < theirs.size() && zero[i].first == theirs[i].first)
      return who + "'s " + zero[i].first + " is " + theirs[i].second + ", rank 0's is " + zero[i].second;
    if (i < theirs.size()) {
      const bool zero_has = std::any_of(zero.begin(), zero.end(), [&](const auto& z) { return z.first == theirs[i].first; });
      if (!zero_has) return who + " has " + theirs[i].first + " (" + theirs[i].second + "), rank 0 has none";
    }
    if (i < zero.size()) return who + " has no " + zero[i].first + ", rank 0's is " + zero[i].second;
    return who + " has " + theirs[i].first + " (" + theirs[i].second + "), rank 0 has none";
  }
  return "";
}

}  // namespace

void Channel::agree(const std::vector<std::pair<std::string, std::string>>& items, const std::string& subject,
                    const std::string& advice) {
  if (world_size() == 1) return;
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
  const auto zero = items_of(text_of_rank(0));
  for (int r = 1; r < world_size(); ++r) {
    const std::string difference = first_difference(zero, items_of(text_of_rank(r)), r);
    if (!difference.empty()) throw UsageError(subject + ": " + difference + ": " + advice);
  }
}

}  // namespace mnist_ddp
