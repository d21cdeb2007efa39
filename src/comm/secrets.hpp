// What the members of one job say to each other about the secret they
// share (docs/clusters.md, "The store, and who else can reach it"): the
// launchers of its nodes, or the ranks another launcher started (rank 0
// hosting the store, or torchrun's agent's). The first member (node 0,
// rank 0) leaves a salted digest of its secret, or that it cannot use its
// file; another compares its own, and says where it differs or cannot be
// used. The words live at the store's root, outside every job's prefix,
// where a neighbour can write too: a member believes only the lines
// secret_difference() makes, of a member of its job.
#pragma once

#include <optional>
#include <string>

namespace mnist_ddp {

// How a member's secret stands against the first member's.
enum class SecretStand { none_here, none_there, differs, unusable_file };

// The words' keys at the store's root, for start `start` of the job (a
// store that outlives the starts, torchrun's agent's, keeps each start's
// words apart): the first member's digest, a member's word that its secret
// differs, and how many members have ended over the secret since.
struct SecretKeys {
  explicit SecretKeys(int start);
  std::string check, differs, ended;
};

// What the first member leaves at `check` when its own file cannot be used.
inline const char* const kFirstCannotUseItsFile = "the first member cannot use its file";

// "salt:digest" of `secret` ("salt:none" without one): what another member
// compares its own with, which tells nobody the secret.
std::string secret_check(const std::string& secret, const std::string& salt);
// How `secret` stands against the first member's `check`: nullopt where
// they agree.
std::optional<SecretStand> stand_against(const std::string& secret, const std::string& check);

// "node 1's secret differs from node 0's": how member `who`'s secret stands
// against member `first`'s.
std::string secret_difference(const std::string& who, const std::string& first, SecretStand how);
// The member (`noun` and a number) a line of secret_difference() about
// `first` names, or -1 where `said` is no such line; `how`, where given,
// gets how it stands.
int secret_difference_of(const std::string& said, const std::string& noun, const std::string& first,
                         SecretStand* how = nullptr);
// What to do about it, for a job of `noun`s ("node", "rank").
std::string secret_advice(const std::string& noun, SecretStand how);

// Leaves `why` at keys.differs and counts this member at keys.ended, in the
// store at `addr`:`port`, if it answers within 5 s (the members of a job
// start together), so that nobody waits its --timeout for this member.
// Gives up silently otherwise.
void tell_the_first(const std::string& addr, int port, const SecretKeys& keys, const std::string& why);

}  // namespace mnist_ddp
