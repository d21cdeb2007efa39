#include "app/launch/node_secrets.hpp"

#include <c10/util/hash.h>

#include "comm/store.hpp"

namespace mnist_ddp {

std::string secret_check(const std::string& secret, const std::string& salt) {
  return salt + ":" + (secret.empty() ? "none" : c10::sha1("mnist_ddp secret check\n" + salt + "\n" + secret).str());
}

std::string secret_difference(int node, int how) {
  const std::string who = "node " + std::to_string(node);
  return how == 0   ? who + " has no secret and node 0 has one"
         : how == 1 ? who + " has a secret and node 0 has none"
         : how == 2 ? who + "'s secret differs from node 0's"
                    : who + " cannot use its MNIST_DDP_SECRET_FILE (missing, empty, unreadable or a directory there)";
}

bool is_secret_difference(const std::string& said, int nnodes) {
  for (int node = 1; node < nnodes; ++node)
    for (int how = 0; how <= kUnusableSecretFile; ++how)
      if (said == secret_difference(node, how)) return true;
  return false;
}

void tell_node_0(const std::string& addr, int port, const std::string& why) {
  leave_word(addr, port, [&](const StoreClient& store) {
    store.set(kSecretDiffers, why);
    store.add(kSecretEnded, 1);
  });
}

}  // namespace mnist_ddp
