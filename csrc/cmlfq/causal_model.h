// What C-MLFQ has learned: a global prefix tree, one prefix tree per prompt, and the most recent
// completed trajectories, from which the trees are periodically rebuilt to follow policy drift.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cmlfq/prefix_tree.h"

namespace libra::cmlfq {

struct CompletedTrajectory {
  std::string prompt;
  std::vector<StateKey> path;      // its tool-return states, in order
  std::vector<int32_t> remaining;  // remaining output tokens at admission and after each state
};

class CausalModel {
 public:
  struct PromptEntry {
    PrefixTree tree;
    uint32_t num_live = 0;  // live trajectories of this prompt: their entry must outlive a rebuild
  };
  // Stable while the entry exists (unordered_map never moves its elements).
  using PromptHandle = std::pair<const std::string, PromptEntry>*;

  CausalModel(uint32_t p90_window, uint32_t rebuild_window);

  PromptHandle acquire_prompt(const std::string& prompt);
  void release_prompt(PromptHandle handle);
  const PrefixTree* find_prompt_tree(const std::string& prompt) const;
  const PrefixTree& global_tree() const { return global_; }

  void learn(CompletedTrajectory completed);
  // Forgets everything but the last rebuild_window completed trajectories.
  void rebuild();

  std::string serialize() const;
  // Replaces the learned state by a checkpoint's.
  void restore(std::string_view bytes);
  // Adds another controller's learned state: trees merge node by node, histories concatenate.
  void merge(std::string_view bytes);

  // Changes whenever tree nodes are renumbered (rebuild, restore), which voids saved matches.
  uint64_t generation() const { return generation_; }

 private:
  struct Snapshot;
  Snapshot parse(std::string_view bytes) const;
  PromptHandle prompt_entry(const std::string& prompt);
  PrefixTree& prompt_tree(const std::string& prompt);
  void append_history(CompletedTrajectory completed);
  void insert(const CompletedTrajectory& completed);
  void drop_unused_prompts();

  uint32_t p90_window_;
  uint32_t rebuild_window_;
  PrefixTree global_;
  std::unordered_map<std::string, PromptEntry> prompts_;
  std::deque<CompletedTrajectory> history_;
  uint64_t generation_ = 0;
};

}  // namespace libra::cmlfq
