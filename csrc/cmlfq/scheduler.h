// The C-MLFQ scheduler: routes live trajectories across TP buckets from what the causal model
// predicts about their remaining work. Thread-safe: every public method takes one mutex, and the
// work under it is a few hash lookups and array scans (rebuild and checkpoints excepted).
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cmlfq/causal_model.h"
#include "cmlfq/cmlfq.h"
#include "cmlfq/instance_table.h"

namespace libra::cmlfq {

// The node a prediction came from.
struct Prediction {
  bool from_prompt_tree;  // else from the global tree
  uint32_t depth;         // tool-return states matched
  NodeStats stats;
};

class Scheduler {
 public:
  explicit Scheduler(Config config);

  Decision admit(const TrajectoryId& trajectory, const std::string& prompt);
  // generated_tokens: output tokens the policy has generated so far (tool tokens excluded).
  // context_tokens: the tokens a move would re-prefill (prompt, turns and tool returns up to its last turn).
  Decision on_tool_return(const TrajectoryId& trajectory, StateKey state, int64_t generated_tokens,
                          int64_t context_tokens = 0);
  void on_finish(const TrajectoryId& trajectory, int64_t total_output_tokens);
  void on_abort(const TrajectoryId& trajectory);
  Decision reroute(const TrajectoryId& trajectory);

  void add_instance(InstanceId instance, uint32_t bucket, bool ready, uint32_t weight = 1);
  // A new plan changed the buckets: `thresholds` replace the bucket thresholds (their count may
  // change) and `instance_buckets` gives every instance of the table its new bucket (each exactly
  // once; nothing changes if it does not). Every live trajectory is then decided again under the
  // new thresholds, in ascending id order: its bucket is where its instance now is (unplaced: its
  // old bucket, clamped), unless its causal path's mean and P90 agree on another bucket, in which
  // case it is moved there now (its next turn runs on the new instance) unless, as at a tool
  // return, the target is full or the promotion does not pay. `speeds` replace the buckets'
  // speeds (empty, or one per threshold). Returns the decisions of the trajectories that moved,
  // ascending id.
  std::vector<std::pair<TrajectoryId, Decision>> update_buckets(
      std::vector<int64_t> thresholds, const std::vector<std::pair<InstanceId, uint32_t>>& instance_buckets,
      std::vector<BucketSpeed> speeds = {});
  // The buckets' speeds alone (empty, or one per bucket): nobody is decided again; they apply
  // from each trajectory's next tool return.
  void set_speeds(std::vector<BucketSpeed> speeds);
  // The cap of live trajectories per unit of instance weight (>= 1), e.g. re-derived for a pool
  // whose weight a plan changed: nobody is decided again; it applies from the next placement.
  void set_max_queue_length(uint32_t max_queue_length);
  std::vector<int64_t> thresholds() const;
  // Returns the trajectories that ran there, ascending; they stay live, unplaced, until rerouted.
  std::vector<TrajectoryId> remove_instance(InstanceId instance);
  void set_instance_ready(InstanceId instance, bool ready);
  // KV tokens the instance's engine holds or reserves, and its capacity (0: no report).
  void set_instance_kv(InstanceId instance, int64_t used, int64_t capacity);
  std::vector<InstanceLoad> instance_loads() const;
  size_t num_live() const;

  std::optional<Prediction> predict(const std::string& prompt, const std::vector<StateKey>& path) const;
  void rebuild();
  std::string serialize() const;
  void restore(std::string_view bytes);
  void merge(std::string_view bytes);

 private:
  // A deepest match saved per trajectory and tree, so each tool return resumes the walk.
  struct Match {
    uint32_t node = PrefixTree::kRoot;
    uint32_t depth = 0;
  };
  struct Trajectory {
    CausalModel::PromptHandle prompt;
    uint32_t bucket = 0;
    InstanceId instance = kNoInstance;
    std::vector<StateKey> path;
    std::vector<int32_t> generated_at_state;  // output tokens generated when each state arrived
    int64_t context = 0;                      // tokens a move re-prefills, as of its last tool return
    uint64_t generation = 0;                  // of the causal model the matches belong to
    Match prompt_match;
    Match global_match;
  };
  struct BucketChoice {
    Reason reason;
    uint32_t bucket;
    double mean_remaining = 0;  // the prediction's, where there is one
  };

  // The prompt's own tree once that prompt has history, else the global tree (the fallback for
  // prompts not seen before); nullopt while both are empty.
  static std::optional<Prediction> predict_from(const PrefixTree& prompt_tree, const PrefixTree& global_tree,
                                                const std::vector<StateKey>& path, Match& prompt_match,
                                                Match& global_match);
  Trajectory& find(const TrajectoryId& trajectory);
  BucketChoice choose_bucket(Trajectory& trajectory);
  uint32_t bucket_for_tokens(int64_t tokens) const;
  uint32_t bucket_for_mean(const NodeStats& stats) const;
  // By the speeds: the decode time a move of a placed trajectory to `bucket` (which has room)
  // saves on its predicted remaining tokens, less what the move costs it and the trajectories
  // its re-prefill holds up on the target. Positive: it pays.
  double move_gain(const Trajectory& trajectory, uint32_t bucket, double mean_remaining) const;
  // While the pool drains, the larger bucket with room where a move gains the most, if any.
  std::optional<uint32_t> faster_bucket(const Trajectory& trajectory, double mean_remaining) const;
  // A placed trajectory's decision when its choice is another bucket: stay if the target is full
  // or the move does not pay, else move.
  Decision decide_move(Trajectory& trajectory, const BucketChoice& choice);
  Decision move_to(Trajectory& trajectory, uint32_t bucket, Reason reason);
  void release(const TrajectoryId& id, Trajectory& trajectory);

  const Config config_;  // its max_queue_length is the launch cap: instances_ holds the current one
  std::vector<int64_t> thresholds_;  // config_'s until update_buckets replaces them
  std::vector<BucketSpeed> speeds_;  // likewise
  mutable std::mutex mutex_;
  CausalModel model_;
  InstanceTable instances_;
  std::unordered_map<TrajectoryId, Trajectory> live_;
  uint32_t completions_since_rebuild_ = 0;
};

}  // namespace libra::cmlfq
