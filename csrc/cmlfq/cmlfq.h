// Shared vocabulary of the C-MLFQ core: ids, tool-return state keys, reason codes, decisions and
// the configuration the Python facade hands down (already validated there).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace libra::cmlfq {

using TrajectoryId = std::string;  // libra.trajectory.Trajectory.trajectory_id
using InstanceId = int64_t;
// A tool-return state packed by libra/scheduler/tool_state.py: a stable hash of the tool type, the
// payload size class and the execution status. The core only compares keys for equality.
using StateKey = uint64_t;

constexpr InstanceId kNoInstance = -1;

// Why a decision came out as it did. The order is part of the Python contract
// (libra/scheduler/interface.py mirrors it; a test checks the two agree).
enum class Reason : uint8_t {
  kAdmitted,                 // new trajectory placed in the smallest bucket
  kNoHistory,                // no tree has seen any trajectory yet: stay
  kMeanP90Disagree,          // mean and P90 point to different buckets: stay
  kStaySameBucket,           // mean and P90 agree on the current bucket
  kMigrateUp,                // both agree on a larger bucket
  kMigrateDown,              // both agree on a smaller bucket
  kBucketSaturatedFallback,  // wanted bucket full: placed in the nearest bucket with room
  kAnyInstanceFallback,      // every bucket full: least-loaded ready instance anywhere
  kNoInstance,               // no ready instance at all: the trajectory waits unplaced
  kRerouted,                 // placed again on request (after its instance was lost)
  kDemotionHeld,             // both agree on a smaller bucket, but demotion is off: stay
  kTargetFullStay,           // the bucket it should move to has no room: it stays on its instance
  kMoveNotWorthIt,           // both agree on a larger bucket, but the move costs more than it saves
  kMigrateFaster,            // a larger bucket with room decodes its remaining work sooner, move included
};
constexpr int kNumReasons = 14;
const char* reason_name(Reason reason);

struct Decision {
  uint32_t bucket;
  InstanceId instance;  // kNoInstance when reason is kNoInstance
  Reason reason;
  bool migrated;  // the next turn runs on another instance than the previous one
};

// How fast one instance of a bucket runs, priced by the planner's cost model, so that a promotion
// is made only when it pays: a decode step with n live trajectories takes
// step_s + per_sequence_s * n, and moving a context of c tokens there costs
// move_linear_s * c + move_quadratic_s * c^2 (its re-prefill; less where the KV is transferred).
struct BucketSpeed {
  double step_s;
  double per_sequence_s;
  double move_linear_s;
  double move_quadratic_s;

  double step_with(uint32_t live) const { return step_s + per_sequence_s * live; }
  double move_s(int64_t context) const {
    const auto c = static_cast<double>(context);
    return move_linear_s * c + move_quadratic_s * c * c;
  }
};

struct Config {
  std::vector<int64_t> bucket_thresholds;  // max remaining tokens per bucket, strictly increasing
  uint32_t max_queue_length;               // active trajectories per instance before it counts as full
  // An instance that reported its KV is also full once kv_used >= kv_full_fraction * kv_capacity.
  double kv_full_fraction = 0.85;
  uint32_t p90_window;                     // samples kept per tree node for the P90
  uint32_t rebuild_window;                 // completed trajectories kept to rebuild the trees from
  uint32_t rebuild_interval;               // completions between automatic rebuilds; 0 = manual only
  bool demote = false;                     // true: also move to smaller buckets (the original's rule)
  // Empty, or one per bucket: then a promotion must save more decode time than its move costs,
  // and while the pool drains a trajectory may move to a faster bucket outside its band.
  std::vector<BucketSpeed> bucket_speeds;
  // The pool drains while its ready instances' live trajectories are at most this share of their caps.
  double draining_fraction = 0.25;
  // 0 (off), or >= 1: the fair-share bound of `InstanceTable::room`.
  double fair_share_headroom = 1.2;
};

// An id the core does not know (a finished trajectory, a removed instance). Python sees KeyError.
class UnknownId : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

}  // namespace libra::cmlfq
