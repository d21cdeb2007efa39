// Channel::disagreement: every rank's items (name, value) compared with
// those of the first rank that gave any, in two allgathers; the line naming
// the first difference (collectives.hpp).
#include <algorithm>

#include "comm/collectives.hpp"

namespace mnist_ddp {

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

using Items = std::vector<std::pair<std::string, std::string>>;

Items::const_iterator holding(const Items& items, const std::string& name) {
  return std::find_if(items.begin(), items.end(), [&](const auto& item) { return item.first == name; });
}

// How item `i` of rank `who`'s items differs from rank `whom`'s, where it does.
std::string item_difference(const Items& zero, const Items& theirs, size_t i, const std::string& who,
                            const std::string& whom) {
  if (i < zero.size() && i < theirs.size() && zero[i].first == theirs[i].first)
    return who + "'s " + zero[i].first + " is " + theirs[i].second + ", " + whom + "'s is " + zero[i].second;
  if (i < theirs.size()) {
    const auto in_zero = holding(zero, theirs[i].first);
    if (in_zero == zero.end()) return who + " has " + theirs[i].first + " (" + theirs[i].second + "), " + whom + " has none";
    if (in_zero->second == theirs[i].second && i < zero.size() && holding(theirs, zero[i].first) != theirs.end())
      return who + " registers " + theirs[i].first + " where " + whom + " registers " + zero[i].first +
             ": the same tensors in another order";
  }
  if (i < zero.size() && holding(theirs, zero[i].first) == theirs.end())
    return who + " has no " + zero[i].first + ", " + whom + "'s is " + zero[i].second;
  if (i < zero.size() && i < theirs.size())
    return who + "'s " + theirs[i].first + " is " + theirs[i].second + " where " + whom + " has " + zero[i].first +
           " (" + zero[i].second + ")";
  return who + " has " + theirs[i].first + " (" + theirs[i].second + "), " + whom + " has none";
}

// How rank `r`'s items first differ from rank `first`'s ("" where they do not).
std::string first_difference(const Items& zero, const Items& theirs, int r, int first, const RankNames& names) {
  const std::string who = names.rank(r), whom = names.rank(first);
  for (size_t i = 0; i < std::max(zero.size(), theirs.size()); ++i)
    if (!(i < zero.size() && i < theirs.size() && zero[i] == theirs[i]))
      return item_difference(zero, theirs, i, who, whom);
  return "";
}

}  // namespace

std::string Channel::disagreement(const std::vector<std::pair<std::string, std::string>>& items,
                                  const std::string& subject, const std::string& advice) {
  if (world_size() == 1) return "";
  std::string text;
  for (const auto& [name, value] : items) text += name + kItemField + value + kItemEnd;
  const Issuer issuer = issuer_;
  issuer_ = Issuer(issuer.kind, issuer.model, issuer.index, subject + ": what every rank must share");
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
  // A rank that abstains serves the allgathers with zeros: it said nothing.
  int first = -1;
  for (int r = 0; r < world_size() && first < 0; ++r)
    if (lengths[r].item<int64_t>() > 0) first = r;
  if (first < 0) return "";
  const auto reference = items_of(text_of_rank(first));
  for (int r = first + 1; r < world_size(); ++r) {
    if (lengths[r].item<int64_t>() == 0) continue;
    const std::string difference = first_difference(reference, items_of(text_of_rank(r)), r, first, names());
    if (!difference.empty()) return names().line(subject + ": " + difference + ": " + advice);
  }
  return "";
}

}  // namespace mnist_ddp
