#include "cmlfq/causal_model.h"

namespace libra::cmlfq {

CausalModel::CausalModel(uint32_t p90_window, uint32_t rebuild_window)
    : p90_window_(p90_window), rebuild_window_(rebuild_window), global_(p90_window) {}

CausalModel::PromptHandle CausalModel::prompt_entry(const std::string& prompt) {
  auto it = prompts_.find(prompt);
  if (it == prompts_.end()) it = prompts_.emplace(prompt, PromptEntry{PrefixTree(p90_window_)}).first;
  return &*it;
}

CausalModel::PromptHandle CausalModel::acquire_prompt(const std::string& prompt) {
  const PromptHandle handle = prompt_entry(prompt);
  handle->second.num_live += 1;
  return handle;
}

void CausalModel::release_prompt(PromptHandle handle) {
  handle->second.num_live -= 1;
  // A prompt that never completed a trajectory (all aborted) would otherwise leave an empty entry.
  if (handle->second.num_live == 0 && handle->second.tree.empty()) prompts_.erase(handle->first);
}

const PrefixTree* CausalModel::find_prompt_tree(const std::string& prompt) const {
  const auto it = prompts_.find(prompt);
  return it == prompts_.end() ? nullptr : &it->second.tree;
}

PrefixTree& CausalModel::prompt_tree(const std::string& prompt) { return prompt_entry(prompt)->second.tree; }

void CausalModel::learn(CompletedTrajectory completed) {
  insert(completed);
  append_history(std::move(completed));
}

// A completion that never called a tool teaches nothing about tool returns: in its prompt's tree it
// would be a root-only history that shadows the global tree's deeper matches for that prompt's
// next trajectories, so it goes to the global tree only.
void CausalModel::insert(const CompletedTrajectory& completed) {
  if (!completed.path.empty()) prompt_tree(completed.prompt).insert(completed.path, completed.remaining);
  global_.insert(completed.path, completed.remaining);
}

void CausalModel::append_history(CompletedTrajectory completed) {
  history_.push_back(std::move(completed));
  while (history_.size() > rebuild_window_) history_.pop_front();
}

void CausalModel::rebuild() {
  global_.clear();
  for (auto& [prompt, entry] : prompts_) entry.tree.clear();
  for (const CompletedTrajectory& completed : history_) insert(completed);
  drop_unused_prompts();
  generation_ += 1;
}

void CausalModel::drop_unused_prompts() {
  for (auto it = prompts_.begin(); it != prompts_.end();) {
    it = it->second.num_live == 0 && it->second.tree.empty() ? prompts_.erase(it) : std::next(it);
  }
}

}  // namespace libra::cmlfq
