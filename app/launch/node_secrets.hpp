// What the nodes of one job say to each other about the secret they share
// (docs/clusters.md, "The store, and who else can reach it"): node 0's
// salted digest of its secret, and a node's word to node 0 that its own
// differs or cannot be used. Both live at the store's root, outside every
// job's prefix, where a neighbour can write too: node 0 believes, and
// prints, only the lines secret_difference() makes, of one of its nodes.
#pragma once

#include <string>

namespace mnist_ddp {

// The keys, at the store's root.
inline const char* const kSecretCheck = "secret/check";
inline const char* const kSecretDiffers = "secret/differs";
// What node 0 leaves at kSecretCheck when its own MNIST_DDP_SECRET_FILE
// cannot be used, and how many other nodes have ended over the secret since
// (each adds 1), which node 0 waits for before its store goes.
inline const char* const kNode0CannotUseItsFile = "node 0 cannot use its file";
inline const char* const kSecretEnded = "secret/ended";

// "salt:digest" of `secret` ("salt:none" without one): what another node
// compares its own with, which tells nobody the secret.
std::string secret_check(const std::string& secret, const std::string& salt);

// How node `node`'s secret stands against node 0's, as it tells node 0:
// `how` 0, it has none; 1, node 0 has none; 2, they differ;
// kUnusableSecretFile, its MNIST_DDP_SECRET_FILE cannot be used there.
constexpr int kUnusableSecretFile = 3;
std::string secret_difference(int node, int how);
// Whether `said` is one of those lines, of a node of a job of `nnodes`.
bool is_secret_difference(const std::string& said, int nnodes);

// Leaves `why` under kSecretDiffers in node 0's store at `addr`:`port`, and
// counts this node at kSecretEnded, if the store answers within 5 s (the
// nodes of a job start together), so that node 0 ends at once rather than
// wait --timeout for this node. Gives up silently otherwise.
void tell_node_0(const std::string& addr, int port, const std::string& why);

}  // namespace mnist_ddp
