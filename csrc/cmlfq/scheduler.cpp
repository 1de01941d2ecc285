// C-MLFQ routing.
//
// The idea: a trajectory's remaining work is best predicted not from its length so far but from
// what its tools have returned (a failing test, a timeout, a huge traceback are causes of more
// turns). Every trajectory is admitted to the smallest bucket, as an MLFQ starts every job at top
// priority. At each tool return we append the tool-return state to the trajectory's causal path,
// find the deepest node of the prefix tree matching that path (the prompt's own tree once one of its
// trajectories completed after a tool call, else the global tree) and map both the node's mean and its P90 remaining
// tokens to buckets: the smallest bucket whose threshold is at least the value, the last bucket
// above all thresholds. Only when the two agree, and differ from the current bucket, does the
// trajectory move, up or down; disagreement means the node's history is too spread out to act on.
// With `demote` off it only moves up: a trajectory predicted to need less is near its end with its
// longest context, which a smaller instance (the least KV) would have to take in to save little.
// A trajectory that stays keeps its instance (and its prefix cache) while that instance is ready;
// so does one whose target bucket is full (a fallback placement elsewhere would pay the move and
// gain nothing). One that moves is placed by the instance table (least loaded, capped, with
// fallbacks), as are admissions and trajectories whose instance is gone. An instance is full at
// its cap of live trajectories; unless the pool drains, at `fair_share_headroom` times its share
// (by weight) of what the pool holds -- else admission to the smallest bucket would fill the
// small instances to their caps and leave the large ones what is left; or, where its engine
// reports its KV, once that KV is nearly all in use: on long contexts the small instances' KV
// fills (and their queues grow) well before their trajectory count reaches the cap. Where the
// buckets' speeds are known, a move must also pay: the predicted remaining tokens, decoded at the
// target's step with its load plus this trajectory instead of at the current instance's step,
// must save more time than re-prefilling (or transferring) the context on the target costs it
// and the trajectories the prefill holds up there; a promotion that does not pay is not made.
// While the pool drains (its live trajectories at most `draining_fraction` of the caps: a
// synchronous step's tail, the end of a run), a trajectory whose prediction keeps it in its
// bucket also moves to a larger bucket with room whenever that pays.
#include "cmlfq/scheduler.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace libra::cmlfq {
namespace {

int32_t clamp_tokens(int64_t tokens) {
  return static_cast<int32_t>(std::clamp<int64_t>(tokens, 0, std::numeric_limits<int32_t>::max()));
}

Config check_speeds(Config config) {
  if (!config.bucket_speeds.empty() && config.bucket_speeds.size() != config.bucket_thresholds.size()) {
    throw std::invalid_argument("the scheduler needs no bucket speeds or one per threshold");
  }
  return config;
}

}  // namespace

Scheduler::Scheduler(Config config)
    : config_(check_speeds(std::move(config))),
      thresholds_(config_.bucket_thresholds),
      speeds_(config_.bucket_speeds),
      model_(config_.p90_window, config_.rebuild_window),
      instances_(static_cast<uint32_t>(config_.bucket_thresholds.size()), config_.max_queue_length,
                 config_.kv_full_fraction, config_.fair_share_headroom, config_.draining_fraction) {}

Scheduler::Trajectory& Scheduler::find(const TrajectoryId& trajectory) {
  const auto it = live_.find(trajectory);
  if (it == live_.end()) throw UnknownId("unknown trajectory " + trajectory);
  return it->second;
}

Decision Scheduler::admit(const TrajectoryId& id, const std::string& prompt) {
  std::lock_guard lock(mutex_);
  if (live_.count(id) != 0) throw std::invalid_argument("trajectory " + id + " is already live");
  Trajectory& trajectory = live_[id];
  trajectory.prompt = model_.acquire_prompt(prompt);
  // Room for a typical number of turns, so that tool returns do not allocate.
  trajectory.path.reserve(16);
  trajectory.generated_at_state.reserve(16);
  trajectory.generation = model_.generation();
  return move_to(trajectory, 0, Reason::kAdmitted);
}

Decision Scheduler::on_tool_return(const TrajectoryId& id, StateKey state, int64_t generated_tokens,
                                   int64_t context_tokens) {
  std::lock_guard lock(mutex_);
  Trajectory& trajectory = find(id);
  trajectory.path.push_back(state);
  trajectory.generated_at_state.push_back(clamp_tokens(generated_tokens));
  trajectory.context = std::max<int64_t>(context_tokens, 0);
  const BucketChoice choice = choose_bucket(trajectory);
  if (!instances_.is_ready(trajectory.instance)) return move_to(trajectory, choice.bucket, choice.reason);
  if (choice.bucket == trajectory.bucket) {
    if (choice.reason != Reason::kNoHistory) {
      if (const auto faster = faster_bucket(trajectory, choice.mean_remaining)) {
        return move_to(trajectory, *faster, Reason::kMigrateFaster);
      }
    }
    return {trajectory.bucket, trajectory.instance, choice.reason, false};
  }
  return decide_move(trajectory, choice);
}

Decision Scheduler::decide_move(Trajectory& trajectory, const BucketChoice& choice) {
  // A move pays only on the bucket it is for: falling back elsewhere would re-prefill (or
  // transfer) the context for nothing, so a trajectory whose target is full stays.
  if (!instances_.has_room(choice.bucket, trajectory.instance)) {
    return {trajectory.bucket, trajectory.instance, Reason::kTargetFullStay, false};
  }
  // Promotions are priced; a demotion (`demote`) is about priority, not speed, and is not.
  if (!speeds_.empty() && choice.bucket > trajectory.bucket &&
      move_gain(trajectory, choice.bucket, choice.mean_remaining) <= 0) {
    return {trajectory.bucket, trajectory.instance, Reason::kMoveNotWorthIt, false};
  }
  return move_to(trajectory, choice.bucket, choice.reason);
}

double Scheduler::move_gain(const Trajectory& trajectory, uint32_t bucket, double mean_remaining) const {
  const InstanceId target = instances_.place(bucket, trajectory.instance, /*previous_holds_it=*/true).instance;
  // The current instance's load counts this trajectory; the target's gains it.
  const double step_here = speeds_[trajectory.bucket].step_with(instances_.active_of(trajectory.instance));
  const double saving = mean_remaining * (step_here - speeds_[bucket].step_with(instances_.active_of(target) + 1));
  // A re-prefill holds up every trajectory decoding on the target: the move costs its time once
  // for each of them and once for this one.
  return saving - speeds_[bucket].move_s(trajectory.context) * (1.0 + instances_.active_of(target));
}

std::optional<uint32_t> Scheduler::faster_bucket(const Trajectory& trajectory, double mean_remaining) const {
  if (speeds_.empty() || !instances_.draining()) return std::nullopt;
  std::optional<uint32_t> best;
  double best_gain = 0;
  for (uint32_t b = trajectory.bucket + 1; b < thresholds_.size(); ++b) {
    if (!instances_.has_room(b, trajectory.instance)) continue;
    if (const double gain = move_gain(trajectory, b, mean_remaining); gain > best_gain) {
      best = b;
      best_gain = gain;
    }
  }
  return best;
}

std::optional<Prediction> Scheduler::predict_from(const PrefixTree& prompt_tree, const PrefixTree& global_tree,
                                                  const std::vector<StateKey>& path, Match& prompt_match,
                                                  Match& global_match) {
  if (!prompt_tree.empty()) {
    prompt_tree.extend_match(path, prompt_match.node, prompt_match.depth);
    return Prediction{true, prompt_match.depth, prompt_tree.stats(prompt_match.node)};
  }
  if (global_tree.empty()) return std::nullopt;
  global_tree.extend_match(path, global_match.node, global_match.depth);
  return Prediction{false, global_match.depth, global_tree.stats(global_match.node)};
}

Scheduler::BucketChoice Scheduler::choose_bucket(Trajectory& trajectory) {
  if (trajectory.generation != model_.generation()) {
    trajectory.generation = model_.generation();
    trajectory.prompt_match = Match{};
    trajectory.global_match = Match{};
  }
  const std::optional<Prediction> prediction =
      predict_from(trajectory.prompt->second.tree, model_.global_tree(), trajectory.path,
                   trajectory.prompt_match, trajectory.global_match);
  if (!prediction) return {Reason::kNoHistory, trajectory.bucket};
  const double mean = static_cast<double>(prediction->stats.sum) / static_cast<double>(prediction->stats.count);
  const uint32_t by_mean = bucket_for_mean(prediction->stats);
  if (by_mean != bucket_for_tokens(prediction->stats.p90)) return {Reason::kMeanP90Disagree, trajectory.bucket, mean};
  if (by_mean == trajectory.bucket) return {Reason::kStaySameBucket, by_mean, mean};
  if (by_mean < trajectory.bucket && !config_.demote) return {Reason::kDemotionHeld, trajectory.bucket, mean};
  return {by_mean > trajectory.bucket ? Reason::kMigrateUp : Reason::kMigrateDown, by_mean, mean};
}

uint32_t Scheduler::bucket_for_tokens(int64_t tokens) const {
  const auto& thresholds = thresholds_;
  for (uint32_t b = 0; b < thresholds.size(); ++b) {
    if (tokens <= thresholds[b]) return b;
  }
  return static_cast<uint32_t>(thresholds.size() - 1);
}

// mean <= threshold compared as sum <= threshold * count: exact, with no floating point rounding.
uint32_t Scheduler::bucket_for_mean(const NodeStats& stats) const {
  const auto& thresholds = thresholds_;
  for (uint32_t b = 0; b < thresholds.size(); ++b) {
    if (stats.sum <= thresholds[b] * stats.count) return b;
  }
  return static_cast<uint32_t>(thresholds.size() - 1);
}

Decision Scheduler::move_to(Trajectory& trajectory, uint32_t bucket, Reason reason) {
  const InstanceId previous = trajectory.instance;
  if (previous != kNoInstance) instances_.release(previous);
  const Placement placement = instances_.place(bucket, previous);
  if (placement.instance != kNoInstance) instances_.acquire(placement.instance);
  trajectory.bucket = placement.bucket;
  trajectory.instance = placement.instance;
  const bool migrated =
      previous != kNoInstance && placement.instance != kNoInstance && placement.instance != previous;
  return {placement.bucket, placement.instance, placement.fallback.value_or(reason), migrated};
}

Decision Scheduler::reroute(const TrajectoryId& id) {
  std::lock_guard lock(mutex_);
  Trajectory& trajectory = find(id);
  return move_to(trajectory, trajectory.bucket, Reason::kRerouted);
}

void Scheduler::on_finish(const TrajectoryId& id, int64_t total_output_tokens) {
  std::lock_guard lock(mutex_);
  Trajectory& trajectory = find(id);
  CompletedTrajectory completed{trajectory.prompt->first, std::move(trajectory.path), {}};
  completed.remaining.reserve(trajectory.generated_at_state.size() + 1);
  completed.remaining.push_back(clamp_tokens(total_output_tokens));
  for (const int32_t generated : trajectory.generated_at_state) {
    completed.remaining.push_back(clamp_tokens(total_output_tokens - generated));
  }
  model_.learn(std::move(completed));
  release(id, trajectory);
  completions_since_rebuild_ += 1;
  if (config_.rebuild_interval != 0 && completions_since_rebuild_ >= config_.rebuild_interval) {
    model_.rebuild();
    completions_since_rebuild_ = 0;
  }
}

void Scheduler::on_abort(const TrajectoryId& id) {
  std::lock_guard lock(mutex_);
  release(id, find(id));
}

void Scheduler::release(const TrajectoryId& id, Trajectory& trajectory) {
  if (trajectory.instance != kNoInstance) instances_.release(trajectory.instance);
  model_.release_prompt(trajectory.prompt);
  live_.erase(id);
}

void Scheduler::add_instance(InstanceId instance, uint32_t bucket, bool ready, uint32_t weight) {
  std::lock_guard lock(mutex_);
  instances_.add(instance, bucket, ready, weight);
}

// Re-planning is rare, so every live trajectory is visited; sorting the ids makes the placements
// (which depend on the loads the earlier moves left) independent of the hash map's order.
std::vector<std::pair<TrajectoryId, Decision>> Scheduler::update_buckets(
    std::vector<int64_t> thresholds, const std::vector<std::pair<InstanceId, uint32_t>>& instance_buckets,
    std::vector<BucketSpeed> speeds) {
  std::lock_guard lock(mutex_);
  if (thresholds.empty()) throw std::invalid_argument("update_buckets needs at least one threshold");
  if (!speeds.empty() && speeds.size() != thresholds.size()) {
    throw std::invalid_argument("update_buckets needs no bucket speeds or one per threshold");
  }
  instances_.rebucket(static_cast<uint32_t>(thresholds.size()), instance_buckets);
  thresholds_ = std::move(thresholds);
  speeds_ = std::move(speeds);
  const auto last = static_cast<uint32_t>(thresholds_.size() - 1);
  std::vector<TrajectoryId> ids;
  ids.reserve(live_.size());
  for (const auto& entry : live_) ids.push_back(entry.first);
  std::sort(ids.begin(), ids.end());
  std::vector<std::pair<TrajectoryId, Decision>> moved;
  for (const TrajectoryId& id : ids) {
    Trajectory& trajectory = live_.at(id);
    const bool placed = trajectory.instance != kNoInstance;
    trajectory.bucket = placed ? instances_.bucket_of(trajectory.instance) : std::min(trajectory.bucket, last);
    if (trajectory.path.empty()) continue;  // nothing learned about it yet: it stays where it runs
    const BucketChoice choice = choose_bucket(trajectory);
    if (choice.bucket == trajectory.bucket) continue;
    if (!placed) {
      trajectory.bucket = choice.bucket;  // placed there when rerouted
      continue;
    }
    // As at a tool return: it stays while its instance is ready and the target is full or the
    // move does not pay.
    if (!instances_.is_ready(trajectory.instance)) {
      moved.emplace_back(id, move_to(trajectory, choice.bucket, choice.reason));
      continue;
    }
    const InstanceId before = trajectory.instance;
    const Decision decision = decide_move(trajectory, choice);
    if (decision.instance != before) moved.emplace_back(id, decision);
  }
  return moved;
}

void Scheduler::set_speeds(std::vector<BucketSpeed> speeds) {
  std::lock_guard lock(mutex_);
  if (!speeds.empty() && speeds.size() != thresholds_.size()) {
    throw std::invalid_argument("set_speeds needs no bucket speeds or one per bucket");
  }
  speeds_ = std::move(speeds);
}

void Scheduler::set_max_queue_length(uint32_t max_queue_length) {
  std::lock_guard lock(mutex_);
  instances_.set_max_queue_length(max_queue_length);
}

std::vector<int64_t> Scheduler::thresholds() const {
  std::lock_guard lock(mutex_);
  return thresholds_;
}

std::vector<TrajectoryId> Scheduler::remove_instance(InstanceId instance) {
  std::lock_guard lock(mutex_);
  instances_.remove(instance);
  std::vector<TrajectoryId> displaced;
  for (auto& [id, trajectory] : live_) {
    if (trajectory.instance != instance) continue;
    trajectory.instance = kNoInstance;
    displaced.push_back(id);
  }
  std::sort(displaced.begin(), displaced.end());
  return displaced;
}

void Scheduler::set_instance_ready(InstanceId instance, bool ready) {
  std::lock_guard lock(mutex_);
  instances_.set_ready(instance, ready);
}

void Scheduler::set_instance_kv(InstanceId instance, int64_t used, int64_t capacity) {
  std::lock_guard lock(mutex_);
  instances_.set_kv(instance, used, capacity);
}

std::vector<InstanceLoad> Scheduler::instance_loads() const {
  std::lock_guard lock(mutex_);
  return instances_.loads();
}

size_t Scheduler::num_live() const {
  std::lock_guard lock(mutex_);
  return live_.size();
}

std::optional<Prediction> Scheduler::predict(const std::string& prompt, const std::vector<StateKey>& path) const {
  std::lock_guard lock(mutex_);
  static const PrefixTree kNoTree(1);
  const PrefixTree* prompt_tree = model_.find_prompt_tree(prompt);
  Match prompt_match, global_match;
  return predict_from(prompt_tree ? *prompt_tree : kNoTree, model_.global_tree(), path, prompt_match,
                      global_match);
}

void Scheduler::rebuild() {
  std::lock_guard lock(mutex_);
  model_.rebuild();
  completions_since_rebuild_ = 0;
}

std::string Scheduler::serialize() const {
  std::lock_guard lock(mutex_);
  return model_.serialize();
}

void Scheduler::restore(std::string_view bytes) {
  std::lock_guard lock(mutex_);
  model_.restore(bytes);
}

void Scheduler::merge(std::string_view bytes) {
  std::lock_guard lock(mutex_);
  model_.merge(bytes);
}

const char* reason_name(Reason reason) {
  static constexpr const char* kNames[kNumReasons] = {
      "admitted",         "no_history",           "mean_p90_disagree",
      "stay_same_bucket", "migrate_up",           "migrate_down",
      "bucket_saturated_fallback", "any_instance_fallback", "no_instance",
      "rerouted",         "demotion_held",        "target_full_stay",
      "move_not_worth_it", "migrate_faster",
  };
  return kNames[static_cast<int>(reason)];
}

}  // namespace libra::cmlfq
