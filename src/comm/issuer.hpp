// Who issues a collective, as a value: the check and the watch carry it,
// the messages print its text, and the advice reads its kind. Not installed.
//
// The comm layer knows no kinds but its own two (a program's, and a rank
// that ended); parallel/advice.hpp names the library's (a DDP bucket, a
// SyncBatchNorm forward, ...) and registers the table that turns where
// each rank waits into what to do (set_advice()). So renaming an issuer's
// text never changes the advice.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mnist_ddp {

struct Issuer {
  // What it is, as parallel/advice.hpp numbers it; kProgram for a program's
  // own collectives (and any the advice does not tell apart).
  int kind = 0;
  // Which DistributedDataParallel of its group (0: the first).
  int model = 0;
  // Its bucket (or layer), where it has one; -1 otherwise.
  int index = -1;
  // "DDP bucket 0's backward", "the program's own barrier".
  std::string text;
  // What every rank's issuer of this collective must agree on where its
  // text may differ between ranks ("the first DDP's" once a rank has built
  // a second, while another has not yet); empty: the text.
  std::string key;

  Issuer() = default;
  // A collective of the program's own, named by `text`.
  Issuer(std::string t) : text(std::move(t)) {}  // NOLINT: implicit, as a name is enough for a program's
  Issuer(const char* t) : text(t) {}             // NOLINT
  Issuer(int k, int m, int i, std::string t) : kind(k), model(m), index(i), text(std::move(t)) {}
};

// The comm layer's own kinds; parallel/advice.hpp's start above them.
constexpr int kProgram = 0;      // a program's own collective
constexpr int kEndedKind = -1;   // not a collective: a rank whose program ended

// An issuer as the store carries it ("kind model index text"), and back;
// nullopt for a value no rank wrote.
std::string encode_issuer(const Issuer& issuer);
std::optional<Issuer> decode_issuer(const std::string& value);

// Where one rank waits (or that it ended), as the advice reads it.
struct Whereabouts {
  Issuer issuer;
  bool ended = false;  // its program ended: it will never come
};

// The advice for ranks found where `where` says: what to do about it, one
// clause ("a train-mode forward through SyncBatchNorm must run on every
// rank ..."). parallel/ registers the library's table once, before its
// first collective; without one, the generic advice.
using AdviceTable = std::string (*)(const std::vector<Whereabouts>& where);
void set_advice(AdviceTable table);
std::string advice_for(const std::vector<Whereabouts>& where);
// What the generic advice says: every rank must issue the same collectives.
std::string generic_advice();

}  // namespace mnist_ddp
