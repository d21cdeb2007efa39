#include "comm/secrets.hpp"

#include <c10/util/hash.h>

#include <cctype>

#include "comm/store.hpp"

namespace mnist_ddp {

SecretKeys::SecretKeys(int start)
    : check("secret/" + std::to_string(start) + "/check"),
      differs("secret/" + std::to_string(start) + "/differs"),
      ended("secret/" + std::to_string(start) + "/ended") {}

std::string secret_check(const std::string& secret, const std::string& salt) {
  return salt + ":" + (secret.empty() ? "none" : c10::sha1("mnist_ddp secret check\n" + salt + "\n" + secret).str());
}

std::optional<SecretStand> stand_against(const std::string& secret, const std::string& check) {
  if (check == kFirstCannotUseItsFile) return SecretStand::unusable_file;
  if (secret_check(secret, check.substr(0, check.find(':'))) == check) return std::nullopt;
  return secret.empty() ? SecretStand::none_here
         : check.size() >= 5 && check.compare(check.size() - 5, 5, ":none") == 0 ? SecretStand::none_there
                                                                                 : SecretStand::differs;
}

std::string secret_difference(const std::string& who, const std::string& first, SecretStand how) {
  switch (how) {
    case SecretStand::none_here: return who + " has no secret and " + first + " has one";
    case SecretStand::none_there: return who + " has a secret and " + first + " has none";
    case SecretStand::differs: return who + "'s secret differs from " + first + "'s";
    case SecretStand::unusable_file: break;
  }
  return who + " cannot use its MNIST_DDP_SECRET_FILE (missing, empty, unreadable or a directory there)";
}

int secret_difference_of(const std::string& said, const std::string& noun, const std::string& first,
                         SecretStand* how) {
  const std::string start = noun + " ";
  if (said.rfind(start, 0) != 0) return -1;
  size_t end = start.size();
  while (end < said.size() && std::isdigit(static_cast<unsigned char>(said[end]))) ++end;
  if (end == start.size() || end - start.size() > 7) return -1;
  const std::string who = said.substr(0, end);
  for (const SecretStand stand :
       {SecretStand::none_here, SecretStand::none_there, SecretStand::differs, SecretStand::unusable_file})
    if (said == secret_difference(who, first, stand)) {
      if (how) *how = stand;
      return std::stoi(said.substr(start.size(), end - start.size()));
    }
  return -1;
}

std::string secret_advice(const std::string& noun, SecretStand how) {
  return "give every " + noun + " the same " +
         (how == SecretStand::unusable_file ? "file" : "MNIST_DDP_SECRET or MNIST_DDP_SECRET_FILE") +
         " (docs/clusters.md)";
}

void tell_the_first(const std::string& addr, int port, const SecretKeys& keys, const std::string& why) {
  leave_word(addr, port, [&](const StoreClient& store) {
    store.set(keys.differs, why);
    store.add(keys.ended, 1);
  });
}

}  // namespace mnist_ddp
