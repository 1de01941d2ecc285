// The checkpoint format of the learned state (trees and history), used to save and restore a
// controller and to merge the knowledge of several controllers. Layout, little-endian:
//   "LCMQ" u32 version | global tree | u32 n, n x (name, tree) sorted by name | u32 m, m x trajectory
//   tree: u32 nodes, per node (u32 parent, u64 key, i64 count, i64 sum, u32 k, k x i32 samples)
//   trajectory: name, u32 n, n x u64 state, (n + 1) x i32 remaining
#include <algorithm>
#include <map>
#include <stdexcept>

#include "cmlfq/causal_model.h"

namespace libra::cmlfq {
namespace {

constexpr uint32_t kMagic = 0x514d434c;  // "LCMQ" read as a little-endian u32
constexpr uint32_t kVersion = 1;

void write_trajectory(ByteWriter& out, const CompletedTrajectory& completed) {
  out.put_string(completed.prompt);
  out.put<uint32_t>(static_cast<uint32_t>(completed.path.size()));
  for (const StateKey key : completed.path) out.put<uint64_t>(key);
  for (const int32_t remaining : completed.remaining) out.put<int32_t>(remaining);
}

CompletedTrajectory read_trajectory(ByteReader& in) {
  CompletedTrajectory completed;
  completed.prompt = in.get_string();
  const auto num_states = in.get<uint32_t>();
  for (uint32_t i = 0; i < num_states; ++i) completed.path.push_back(in.get<uint64_t>());
  for (uint32_t i = 0; i <= num_states; ++i) completed.remaining.push_back(in.get<int32_t>());
  return completed;
}

}  // namespace

struct CausalModel::Snapshot {
  PrefixTree global;
  std::map<std::string, PrefixTree> prompts;
  std::deque<CompletedTrajectory> history;
};

std::string CausalModel::serialize() const {
  ByteWriter out;
  out.put<uint32_t>(kMagic);
  out.put<uint32_t>(kVersion);
  global_.write(out);
  // Sorted by name so that equal states serialize to equal bytes.
  std::map<std::string_view, const PrefixTree*> learned;
  for (const auto& [prompt, entry] : prompts_) {
    if (!entry.tree.empty()) learned.emplace(prompt, &entry.tree);
  }
  out.put<uint32_t>(static_cast<uint32_t>(learned.size()));
  for (const auto& [prompt, tree] : learned) {
    out.put_string(prompt);
    tree->write(out);
  }
  out.put<uint32_t>(static_cast<uint32_t>(history_.size()));
  for (const CompletedTrajectory& completed : history_) write_trajectory(out, completed);
  return out.take();
}

CausalModel::Snapshot CausalModel::parse(std::string_view bytes) const {
  ByteReader in(bytes);
  if (in.get<uint32_t>() != kMagic) throw std::invalid_argument("not a C-MLFQ checkpoint");
  if (in.get<uint32_t>() != kVersion) throw std::invalid_argument("unsupported C-MLFQ checkpoint version");
  Snapshot snapshot{PrefixTree::read(in, p90_window_), {}, {}};
  const auto num_prompts = in.get<uint32_t>();
  for (uint32_t i = 0; i < num_prompts; ++i) {
    std::string prompt = in.get_string();
    snapshot.prompts.emplace(std::move(prompt), PrefixTree::read(in, p90_window_));
  }
  const auto num_history = in.get<uint32_t>();
  for (uint32_t i = 0; i < num_history; ++i) snapshot.history.push_back(read_trajectory(in));
  if (!in.done()) throw std::invalid_argument("C-MLFQ checkpoint has trailing bytes");
  return snapshot;
}

void CausalModel::restore(std::string_view bytes) {
  Snapshot snapshot = parse(bytes);  // parse fully first: a bad checkpoint leaves the state as it was
  global_ = std::move(snapshot.global);
  for (auto& [prompt, entry] : prompts_) entry.tree.clear();
  for (auto& [prompt, tree] : snapshot.prompts) prompt_tree(prompt) = std::move(tree);
  drop_unused_prompts();
  history_.clear();
  for (CompletedTrajectory& completed : snapshot.history) append_history(std::move(completed));
  generation_ += 1;
}

void CausalModel::merge(std::string_view bytes) {
  const Snapshot snapshot = parse(bytes);
  global_.merge(snapshot.global);
  for (const auto& [prompt, tree] : snapshot.prompts) prompt_tree(prompt).merge(tree);
  for (const CompletedTrajectory& completed : snapshot.history) append_history(completed);
  // Merging only appends nodes, so saved matches stay valid: no new generation.
}

}  // namespace libra::cmlfq
