// What a rank says of itself in its heartbeat, and reads back of the
// others' (watchdog.hpp); who issues a collective, as the store carries it
// (issuer.hpp); the advice the library registers.
#include "comm/watchdog.hpp"

#include <algorithm>
#include <optional>

namespace mnist_ddp {
namespace watching {

std::vector<std::string> split_on(const std::string& s, char by) {
  std::vector<std::string> parts;
  size_t at = 0;
  for (size_t next; (next = s.find(by, at)) != std::string::npos; at = next + 1) parts.push_back(s.substr(at, next - at));
  parts.push_back(s.substr(at));
  return parts;
}


std::string lane_text(LaneState& lane) {
  std::lock_guard<std::mutex> lock(lane.mutex);
  return lane.name + kField + std::to_string(lane.passed) + kField + (lane.busy ? "1" : "0") +
         (lane.waiting ? "1" : "0") + (lane.checking ? "1" : "0") + kField + std::to_string(lane.in_flight) + kField +
         encode_issuer(lane.issuer) + kField + lane.what;
}

namespace {

std::optional<LaneView> lane_view(const std::string& text, std::string& name) {
  const auto f = split_on(text, kField);
  if (f.size() != 6 || f[2].size() != 3) return std::nullopt;
  LaneView v;
  try {
    v.passed = std::stoull(f[1]);
    v.in_flight = std::stoi(f[3]);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  v.busy = f[2][0] == '1';
  v.waiting = f[2][1] == '1';
  v.checking = f[2][2] == '1';
  v.issuer = decode_issuer(f[4]).value_or(Issuer(f[5]));
  v.what = f[5];
  name = f[0];
  return v;
}

}  // namespace

std::string said_of(const RankView& view, bool written, const std::string& lane) {
  std::vector<std::string> waits;
  for (const auto& [name, v] : view.lanes)  // said once where two lanes wait in the same (ddp.join()'s serving)
    if ((v.waiting || v.in_flight > 0) && std::find(waits.begin(), waits.end(), v.what) == waits.end())
      waits.push_back(v.what);
  if (!waits.empty()) {
    std::string out = "waits in " + waits[0];
    for (size_t i = 1; i < waits.size(); ++i) out += " and in " + waits[i];
    return out;
  }
  const auto here = view.lanes.find(lane);
  if (here != view.lanes.end()) return here->second.what.empty() ? "has issued nothing there yet" : "last passed " + here->second.what;
  return written ? "said nothing of this stream in its last heartbeat" : "has written no heartbeat";
}

Whereabouts whereabouts_of(const RankView& view) {
  for (const auto& [name, v] : view.lanes)
    if (v.waiting || v.in_flight > 0) return {v.issuer, false};
  for (const auto& [name, v] : view.lanes)
    if (!v.what.empty()) return {v.issuer, false};
  return {};
}

}  // namespace watching

using namespace watching;

std::string RankNames::rank(int r) const {
  return "rank " + std::to_string(global.empty() ? r : global.at(static_cast<size_t>(r)));
}

std::string RankNames::list(const std::vector<int>& ranks) const {
  std::string who;
  for (int r : ranks) who += (who.empty() ? "" : ", ") + rank(r).substr(5);
  return (ranks.size() > 1 ? "ranks " : "rank ") + who;
}

std::string RankNames::line(const std::string& text) const { return group.empty() ? text : "in " + group + ": " + text; }

std::string RankNames::ended(size_t ranks) const {
  if (group.empty()) return ranks > 1 ? "ended their programs" : "ended its program";
  return ranks > 1 ? "let go of the group (their programs ended, or their last handles to it went)"
                   : "let go of the group (its program ended, or its last handle to it went)";
}

RankView rank_view(const std::string& heartbeat) {
  RankView view;
  const auto parts = split_on(heartbeat, kBeatEnd);
  if (parts.size() != 3) return view;
  try {
    view.count = parts[0] == "clean" || parts[0] == "error" || parts[0] == "echo" ? 0 : std::stoll(parts[0]);
    const auto threads = split_on(parts[1], kField);
    if (threads.size() == 2) {
      view.posters = std::stoi(threads[0]);
      view.blocked = std::stoi(threads[1]);
    }
  } catch (const std::exception&) {
    return RankView{};
  }
  if (parts[2].empty()) return view;
  for (const auto& text : split_on(parts[2], kLaneEnd)) {
    std::string name;
    if (auto v = lane_view(text, name)) view.lanes[name] = *v;
  }
  return view;
}

std::string CollectiveWatch::Watchdog::status() {
  std::vector<std::shared_ptr<LaneState>> live;
  int posting = 0, blocked = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    live = lanes;
    posting = static_cast<int>(posters.size());
    for (const auto& [thread, depth] : posters) blocked += depth > 0 ? 1 : 0;
  }
  std::string out = std::to_string(posting) + kField + std::to_string(blocked) + kBeatEnd;
  for (size_t i = 0; i < live.size(); ++i) out += (i ? std::string(1, kLaneEnd) : "") + lane_text(*live[i]);
  return out;
}

void CollectiveWatch::Watchdog::publish(Clock::time_point now) {
  if (now < next_beat) return;
  next_beat = now + std::chrono::seconds(1);
  try {
    client.set("heartbeat/" + std::to_string(rank), std::to_string(++beats) + kBeatEnd + status());
  } catch (const std::exception&) {
    // Refused (busy, or stalled for a while): tried again the next second.
  }
}

std::map<int, std::string> CollectiveWatch::Watchdog::read_heartbeats() {
  std::map<int, std::string> all;
  for (int r = 0; r < world; ++r) {
    const std::string key = "heartbeat/" + std::to_string(r);
    if (client.check({key})) all[r] = client.get(key);
  }
  return all;
}

std::map<int, std::string> CollectiveWatch::Watchdog::read_ended() {
  std::map<int, std::string> ended;
  for (int r = 0; r < world; ++r) {
    const std::string key = kEnded + "/" + std::to_string(r);
    if (r != rank && client.check({key})) ended[r] = client.get(key);
  }
  return ended;
}

std::exception_ptr CollectiveWatch::Watchdog::deadlock_found(bool look) {
  if (!look || !client.check({kDeadlock})) return nullptr;
  return std::make_exception_ptr(CollectiveMismatch(client.get(kDeadlock)));
}

std::string encode_issuer(const Issuer& issuer) {
  return std::to_string(issuer.kind) + " " + std::to_string(issuer.model) + " " + std::to_string(issuer.index) + " " +
         issuer.text;
}

std::optional<Issuer> decode_issuer(const std::string& value) {
  const auto parts = split_on(value, ' ');
  if (parts.size() < 4) return std::nullopt;
  Issuer issuer;
  try {
    issuer.kind = std::stoi(parts[0]);
    issuer.model = std::stoi(parts[1]);
    issuer.index = std::stoi(parts[2]);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  const size_t text = parts[0].size() + parts[1].size() + parts[2].size() + 3;
  issuer.text = value.substr(std::min(text, value.size()));
  return issuer;
}

namespace {
std::atomic<AdviceTable> g_advice{nullptr};
}  // namespace

void set_advice(AdviceTable table) { g_advice = table; }

std::string generic_advice() {
  return "every rank must issue the same collectives in the same order (docs/library.md, \"What is checked\")";
}

std::string advice_for(const std::vector<Whereabouts>& where) {
  if (const AdviceTable table = g_advice.load()) return table(where);
  return generic_advice();
}

}  // namespace mnist_ddp
