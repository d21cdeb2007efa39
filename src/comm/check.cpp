// The Channel: the check before each collective, and what it offers a rank
// with nothing to issue (collectives.hpp).
//
// Note on the check. A program can issue different collectives on
// different ranks (a model or hook that differs, a SyncBatchNorm forward on
// one rank, a rank whose data ran out). So each collective is preceded by a
// check: every rank says what it is about to issue (its issuer, "DDP bucket
// 0's backward", the operation, dtype, element count and root) as a
// fingerprint in a fixed-size sum over the ranks, the same size whatever the
// collective, so a mismatch can never put anything of a size another rank
// does not expect on the wire (Gloo aborts the process then). A rank whose
// fingerprint's pieces, times the number of ranks that gave one, equal the
// sums (and likewise the squares) knows every rank gave its own
// (Cauchy-Schwarz; every sum stays an exact integer in float64). A verdict
// rests on nothing else: two ranks' descriptions of the same position of
// the same lane. Ranks that differ then leave their own words in the store
// and throw the same CollectiveMismatch.
//
// What it costs (docs/design.md, "The check"): a small float sum (up to
// kInline elements: SyncBatchNorm's statistics, votes, metrics) travels in
// its own check, so it costs nothing more; a larger collective's check goes
// over a group of its own (through shared memory on one host), so it never
// queues behind a bucket still on the wire. Under NCCL the check travels
// on a Gloo group beside the collective, which is issued at once, and is
// verified when it completes: no host synchronisation per collective.
//
// The same sum carries what a rank that abstains needs (abstain(): a rank
// whose data ran out, under ddp.join()): it adds zeros, and learns from the
// sums what the others issue (their operation, dtype, count, root and tag)
// and, where every rank abstained, that none issues anything.
#include "comm/collectives.hpp"

#include <algorithm>
#include <cmath>

namespace mnist_ddp {

namespace {

// A check is one float64 sum: [the inlined sum's elements | the fields | a
// bitmap of the ranks that issue]. Every field is summed over those ranks,
// and every value stays an integer far below 2^53, so the sums are exact.
enum Field : int64_t { kIssuers, kOp, kDtype, kNumel, kRoot, kInlined, kTag, kPrint, kSquare = kPrint + 3, kFields = kSquare + 3 };
constexpr int kPieces = 3;          // a description's fingerprint: 3 pieces of 16 bits
constexpr int kBitsPerWord = 48;    // issuing ranks, 48 to a float64
constexpr size_t kMaxPending = 64;  // Check::alongside: checks in flight before the lane waits for the oldest

const char* op_name(Op op) {
  switch (op) {
    case Op::allreduce: return "allreduce";
    case Op::broadcast: return "broadcast";
    case Op::gather: return "gather";
    case Op::allgather: return "allgather";
    case Op::barrier: return "barrier";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::announce: return "announced";
  }
  return "?";
}

int64_t bitmap_words(int world) { return (world + kBitsPerWord - 1) / kBitsPerWord; }

// Whether the issuing ranks of summed check `s` (its fields, from
// kIssuers) all gave the fingerprint `pieces`, or, for a rank that
// abstains (`pieces` nullptr), all gave one fingerprint.
bool all_agree(const double* s, const int64_t* pieces) {
  const double n = s[kIssuers];
  for (int i = 0; i < kPieces; ++i) {
    const double a = pieces ? static_cast<double>(pieces[i]) : s[kPrint + i] / n;
    if (a != std::floor(a) || s[kPrint + i] != n * a || s[kSquare + i] != n * a * a) return false;
  }
  return true;
}

// Moves an inlined sum (a CPU float32 or float64 tensor) into the check's
// first elements (`in`), or back out of them: element by element where it
// is contiguous, since two torch copies cost more than the rest of a
// check's own work.
void carry(torch::Tensor& sum, const torch::Tensor& sums, bool in) {
  const int64_t n = sum.numel();
  if (!sum.is_contiguous()) {
    if (in) sums.slice(0, 0, n).copy_(sum.reshape(-1));
    else sum.copy_(sums.slice(0, 0, n).view(sum.sizes()));
    return;
  }
  double* s = sums.data_ptr<double>();
  if (sum.scalar_type() == torch::kDouble) {
    double* p = sum.data_ptr<double>();
    std::copy(in ? p : s, (in ? p : s) + n, in ? s : p);
    return;
  }
  float* p = sum.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    if (in) s[i] = p[i];
    else p[i] = static_cast<float>(s[i]);
  }
}

bool issued_by(const double* s, int r) {
  return ((static_cast<uint64_t>(s[kFields + r / kBitsPerWord]) >> (r % kBitsPerWord)) & 1u) != 0;
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

Channel::Channel(Link link, Check check, GroupPtr check_group)
    : link_(std::move(link)),
      check_(check),
      check_group_(check_group ? std::move(check_group) : link_.group()),
      inline_(check == Check::before ? kInline : 0),
      active_(link_.world_size()) {}

Channel::~Channel() = default;

void Channel::set_issuer(Issuer issuer) {
  issuer_ = std::move(issuer);
  tag_ = 0;
}

FuturePtr Channel::allreduce_sum(torch::Tensor tensor) {
  const bool small_float = tensor.numel() <= inline_ && tensor.is_cpu() && !tensor.is_sparse() &&
                           (tensor.scalar_type() == torch::kFloat || tensor.scalar_type() == torch::kDouble);
  if (small_float && world_size() > 1 && !follows_checked()) {
    link_.issue("allreduce", tensor);
    check(Op::allreduce, tensor, 0, &tensor);
    return completed_future(tensor);
  }
  check(Op::allreduce, tensor, 0);
  return link_.allreduce_sum(std::move(tensor));
}

void Channel::broadcast(torch::Tensor& tensor, int root) { link_.broadcast(tensor, check(Op::broadcast, tensor, root).root); }

std::vector<torch::Tensor> Channel::gather_to_rank0(const torch::Tensor& tensor) {
  check(Op::gather, tensor, 0);
  return link_.gather_to_rank0(tensor);
}

torch::Tensor Channel::allgather(const torch::Tensor& tensor) {
  check(Op::allgather, tensor, 0);
  return link_.allgather(tensor);
}

void Channel::reduce_scatter_sum(const torch::Tensor& output, const torch::Tensor& input) {
  check(Op::reduce_scatter, input, 0);
  link_.reduce_scatter_sum(output, input);
}

bool Channel::announce(const torch::Tensor& first) {
  // A check of its own group only: one through shared memory or the transfers' group could meet a peer's
  // transfer (a rank whose backward threw after it issues something else next).
  if (check_ != Check::before || check_group_ == link_.group()) return false;
  if (active_ == world_size()) check(Op::announce, first, 0);
  return true;
}

void Channel::barrier() {
  // Checked before its transfer, the check is itself the barrier.
  if (world_size() > 1 && check_ == Check::before) return void(check(Op::barrier, torch::Tensor(), 0));
  check(Op::barrier, torch::Tensor(), 0);
  link_.barrier();
}

// "DDP bucket 0's backward (allreduce, 1181066 float32)": what a rank's
// messages say it was in. A broadcast from kAuthority is "from rank 0",
// which it is unless ranks have joined.
Channel::Described Channel::describe(Op op, const torch::Tensor& tensor, int root, bool inlined) const {
  Described d;
  d.op = op;
  d.dtype = tensor.defined() ? static_cast<int64_t>(tensor.scalar_type()) : -1;
  d.numel = tensor.defined() ? tensor.numel() : 0;
  d.root = root;
  d.tag = tag_;
  d.inlined = inlined;
  std::string operation = std::string(" (") + op_name(op);
  if (tensor.defined())
    operation += ", " + std::to_string(tensor.numel()) + (tensor.is_sparse() ? " sparse " : " ") +
                 dtype_name(tensor.scalar_type());
  if (op == Op::broadcast) operation += ", from " + names().rank(root == kAuthority ? 0 : root);
  operation += ")";
  d.what = issuer_.text + operation;
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, over the issuer's key, the operation and the tag
  const std::string& key = issuer_.key.empty() ? issuer_.text : issuer_.key;
  for (const unsigned char c : key + operation + "#" + std::to_string(d.tag)) h = (h ^ c) * 0x100000001b3ull;
  for (int i = 0; i < kPieces; ++i) d.pieces[i] = static_cast<int64_t>((h >> (16 * i)) & 0xffff);
  return d;
}

torch::Tensor Channel::check_tensor(const Described* mine) const {
  auto sums = torch::zeros({inline_ + kFields + bitmap_words(world_size())}, torch::kFloat64);
  if (!mine) return sums;
  double* f = sums.data_ptr<double>() + inline_;
  f[kIssuers] = 1;
  f[kOp] = static_cast<double>(static_cast<int64_t>(mine->op));
  f[kDtype] = static_cast<double>(mine->dtype);
  f[kNumel] = static_cast<double>(mine->numel);
  f[kRoot] = mine->root;
  f[kInlined] = mine->inlined ? 1 : 0;
  f[kTag] = mine->tag;
  for (int i = 0; i < kPieces; ++i) {
    f[kPrint + i] = static_cast<double>(mine->pieces[i]);
    f[kSquare + i] = static_cast<double>(mine->pieces[i]) * static_cast<double>(mine->pieces[i]);
  }
  f[kFields + rank() / kBitsPerWord] = std::ldexp(1.0, rank() % kBitsPerWord);
  return sums;
}

uint64_t Channel::enter_check(const std::string& what) {
  LaneState& lane = *link_.lane();
  std::lock_guard<std::mutex> lock(lane.mutex);
  lane.issuer = issuer_;
  lane.what = what;
  return lane.passed;
}

void Channel::pass_check() {
  LaneState& lane = *link_.lane();
  std::lock_guard<std::mutex> lock(lane.mutex);
  ++lane.passed;
}

void Channel::exchange_check(torch::Tensor& sums) {
  if (const auto& watch = link_.watch())
    if (auto error = watch->mismatch()) std::rethrow_exception(error);
  link_.sum_check(sums, check_group_);
}

Channel::Outcome Channel::verify(const torch::Tensor& sums, const Described* mine, uint64_t position) {
  const double* s = sums.data_ptr<double>() + inline_;
  const auto n = s[kIssuers];
  if (n > 0 && !all_agree(s, mine ? mine->pieces : nullptr)) mismatch(position, mine ? mine->what : issuer_.text);
  active_ = static_cast<int>(n);
  Outcome out;
  out.served = s[kInlined] > 0;
  const int root = n > 0 ? static_cast<int>(std::lround(s[kRoot] / n)) : 0;
  out.root = root;
  if (root == kAuthority) {  // rank 0 while it issues, else the highest rank that does
    out.root = 0;
    if (!issued_by(s, 0))
      for (int r = world_size() - 1; r > 0 && out.root == 0; --r)
        if (issued_by(s, r)) out.root = r;
  }
  const bool broadcast = n > 0 && std::lround(s[kOp] / n) == static_cast<long>(Op::broadcast);
  if (broadcast && !issued_by(s, out.root)) refuse_broadcast(s, mine, out.root);
  return out;
}

// A broadcast from `root`, a rank that has joined (ddp.join()): it has
// nothing to send, and every rank says so, from what it knows.
void Channel::refuse_broadcast(const double* s, const Described* mine, int root) {
  const std::string tail = names().rank(root) +
                           " has joined (ddp.join(): its data ran out) and has nothing to send; broadcast from a rank "
                           "that still has data, or after join() returns on every rank";
  if (mine) throw RefusedEverywhere(names().line(mine->what + ": " + tail));
  const double n = s[kIssuers];
  throw RefusedEverywhere(names().line("ddp.join(): the other ranks broadcast " +
                                      std::to_string(std::llround(s[kNumel] / n)) + " " +
                                      dtype_name(static_cast<c10::ScalarType>(std::lround(s[kDtype] / n))) +
                                      " from " + names().rank(root) + ", and " + tail));
}

void Channel::mismatch(uint64_t position, const std::string& mine) {
  const auto& watch = link_.watch();
  const std::string line = watch ? watch->mismatch_line(link_.lane()->name, position, issuer_, mine) : mine;
  const CollectiveMismatch error(line);
  if (watch) watch->mismatched(std::make_exception_ptr(error));  // this rank's other lanes end with it too
  throw error;
}

Channel::Outcome Channel::check(Op op, const torch::Tensor& tensor, int root, torch::Tensor* inlined) {
  Outcome out;
  out.root = root == kAuthority ? 0 : root;
  if (world_size() == 1 || check_ == Check::off || follows_checked()) return out;
  if (run_ == Run::first) run_ = Run::following;
  if (link_.probe) link_.probe->checked();
  const Described d = describe(op, tensor, root, inlined != nullptr);
  tag_ = 0;
  const uint64_t position = enter_check(d.what);
  auto sums = check_tensor(&d);
  if (check_ == Check::alongside && root != kAuthority) {
    check_alongside(d, position, sums);
    return out;
  }
  settle();  // a broadcast from the authority needs every earlier check's word on who issues
  if (inlined) carry(*inlined, sums, true);
  exchange_check(sums);
  out = verify(sums, &d, position);
  if (inlined) carry(*inlined, sums, false);
  pass_check();
  return out;
}

// Issued at once, the collective's check is held to it when it completes.
void Channel::check_alongside(const Described& d, uint64_t position, torch::Tensor sums) {
  while (!pending_.empty() && settle_oldest(pending_.size() >= kMaxPending)) {
  }
  auto pending = std::make_unique<Pending>();
  pending->position = position;
  pending->described = d;
  pending->sums = sums;
  pending->done = link_.sum_check_async(pending->sums, check_group_);
  if (const auto& watch = link_.watch()) {
    // Said at once, so that a rank whose collective hangs (NCCL, on a
    // mismatch of sizes) is woken by its waits (CollectiveStream::wait).
    pending->done->addCallback([watch, lane = link_.lane()->name, position, d, sums, offset = inline_,
                                issuer = issuer_](c10::ivalue::Future& done) {
      if (done.hasError() || all_agree(sums.data_ptr<double>() + offset, d.pieces)) return;
      watch->mismatched(std::make_exception_ptr(CollectiveMismatch(watch->mismatch_line(lane, position, issuer, d.what))));
    });
  }
  pending_.push_back(std::move(pending));
  pass_check();
}

bool Channel::settle_oldest(bool block) {
  if (const auto& watch = link_.watch())
    if (auto error = watch->mismatch()) std::rethrow_exception(error);
  Pending& oldest = *pending_.front();
  if (!oldest.done->completed()) {
    if (!block) return false;
    oldest.done->wait();
  }
  if (oldest.done->hasError()) std::rethrow_exception(link_.explained(oldest.done->exception_ptr()));
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

Channel::DeterminedRun::DeterminedRun(Channel& channel, uint64_t id, bool continues) : channel_(channel), id_(id) {
  const bool goes_on = continues && channel_.run_id_ == id && channel_.run_ended_ + 1 == channel_.tasks_;
  channel_.run_ = goes_on ? Run::following : Run::first;
}

Channel::DeterminedRun::~DeterminedRun() {
  // Checked (its first collective, or the run it went on from): the next task may go on from it.
  channel_.run_ended_ = channel_.run_ == Run::following ? channel_.tasks_ : 0;
  channel_.run_id_ = id_;
  channel_.run_ = Run::none;
}

std::optional<Channel::Issued> Channel::abstain(const Issuer& as) {
  TORCH_CHECK(check_ != Check::off && world_size() > 1, "abstain: needs the check and another rank");
  settle();
  const Issuer own = issuer_;
  issuer_ = as;
  const uint64_t position = enter_check(as.text);
  torch::Tensor sums = check_tensor(nullptr);
  exchange_check(sums);
  const double* s = sums.data_ptr<double>() + inline_;
  const double n = s[kIssuers];
  Issued issued;
  if (n > 0) {
    const Outcome outcome = verify(sums, nullptr, position);
    issued.op = static_cast<Op>(std::lround(s[kOp] / n));
    issued.dtype = std::lround(s[kDtype] / n);
    issued.numel = std::llround(s[kNumel] / n);
    issued.root = outcome.root;
    issued.tag = static_cast<int>(std::lround(s[kTag] / n));
    issued.inlined = outcome.served;
    issued.issuers = static_cast<int>(n);
    if (issued.inlined) issued.sum = sums.slice(0, 0, issued.numel).clone();
  }
  issuer_ = own;
  pass_check();
  if (n == 0) return std::nullopt;
  return issued;
}

torch::Tensor Channel::serve(const Issued& issued) {
  if (issued.inlined) return issued.sum;  // the sum travelled in the check, this rank's zeros with it
  if (issued.op == Op::announce) return torch::Tensor();  // the collectives follow, each checked
  torch::Tensor zeros;
  if (issued.dtype >= 0)
    zeros = torch::zeros({issued.numel}, torch::TensorOptions(static_cast<c10::ScalarType>(issued.dtype)).device(device()));
  switch (issued.op) {
    case Op::allreduce: link_.allreduce_sum(zeros)->waitAndThrow(); break;
    case Op::broadcast: link_.broadcast(zeros, issued.root); break;
    case Op::gather: link_.gather_to_rank0(zeros); break;
    case Op::allgather: zeros = link_.allgather(zeros); break;
    case Op::reduce_scatter: link_.reduce_scatter_sum(torch::empty({issued.numel / world_size()}, zeros.options()), zeros); break;
    case Op::barrier:
      if (check_ == Check::alongside) link_.barrier();
      break;
    case Op::announce: break;
  }
  return zeros;
}

const RankNames& Channel::names() const {
  static const RankNames plain;
  return link_.watch() ? link_.watch()->names() : plain;
}

}  // namespace mnist_ddp
