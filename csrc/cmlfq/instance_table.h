// The rollout instances C-MLFQ places trajectories on: which bucket each belongs to, whether it is
// ready, how many live trajectories it serves (its load) and, where its engine reports it, how
// much of its KV is in use.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "cmlfq/cmlfq.h"

namespace libra::cmlfq {

struct InstanceLoad {
  InstanceId id;
  uint32_t bucket;
  uint32_t active;
  bool ready;
  uint32_t weight;  // its capacity relative to the smallest instance's (1 for equal instances)
  int64_t kv_used = 0;      // KV tokens held or reserved by its running and queued sequences
  int64_t kv_capacity = 0;  // 0: never reported; judged by its trajectory cap only
  int64_t kv_full_at = 0;   // ceil(kv_full_fraction * kv_capacity), so the check is one integer compare
  bool loading = false;     // added not ready and not ready since: it will serve (one set not ready
                            // after serving is leaving: a drain)
};

struct Placement {
  uint32_t bucket;
  InstanceId instance;             // kNoInstance when nothing is ready
  std::optional<Reason> fallback;  // set when the placement is not in the wanted bucket's rules
};

class InstanceTable {
 public:
  // fair_share_headroom: 0, or >= 1 (see `room`); draining_fraction in [0, 1] (see `draining`).
  InstanceTable(uint32_t num_buckets, uint32_t max_queue_length, double kv_full_fraction,
                double fair_share_headroom, double draining_fraction);

  // weight >= 1: loads compare as active / weight, and the cap is max_queue_length * weight, so a
  // TP-8 instance that holds ten times the sequences of a TP-1 one takes ten times the load.
  void add(InstanceId id, uint32_t bucket, bool ready, uint32_t weight = 1);
  void remove(InstanceId id);
  void set_ready(InstanceId id, bool ready);
  // A new cap per unit of weight (>= 1; the pool it is derived from changed). Throws
  // std::invalid_argument for 0.
  void set_max_queue_length(uint32_t max_queue_length);
  // What its engine reports (both >= 0; capacity 0 forgets an earlier report). While
  // kv_used >= kv_full_fraction * kv_capacity it has no room, whatever its trajectory count.
  void set_kv(InstanceId id, int64_t used, int64_t capacity);
  bool is_ready(InstanceId id) const;  // false for kNoInstance
  // A ready instance of the bucket has room (see `room`) for a trajectory that `holder` (a move
  // decided before the trajectory leaves it) still counts: the pool's load is taken without it,
  // as `place` takes it once the trajectory is released.
  bool has_room(uint32_t bucket, InstanceId holder = kNoInstance) const;
  uint32_t bucket_of(InstanceId id) const { return at(id).bucket; }
  uint32_t active_of(InstanceId id) const { return at(id).active; }
  // The ready instances' live trajectories are at most draining_fraction of their caps
  // (max_queue_length x weight; compared in doubles, as the Python reference does).
  bool draining() const;
  // A new bucket count, and the new bucket of every instance (each named exactly once). Throws
  // std::invalid_argument, changing nothing, when the mapping is not exactly that.
  void rebucket(uint32_t num_buckets, const std::vector<std::pair<InstanceId, uint32_t>>& buckets);

  // Where a trajectory that wants `bucket` goes: the least-loaded (active / weight) ready instance
  // of that bucket with room (see has_room); else the same in the nearest other bucket
  // (at equal distance the larger one: a long trajectory on too small a bucket costs more than
  // the reverse); else, unless an instance is still `loading` (it will have room: the trajectory
  // waits for it, kNoInstance, rather than queue behind a full one and stay there after it serves),
  // the least-loaded ready instance anywhere, full or not. Ties go to
  // `previous` (its prefix cache is warm), then to the lowest id. previous_holds_it: the
  // trajectory is still counted on `previous` (see `has_room`).
  Placement place(uint32_t bucket, InstanceId previous, bool previous_holds_it = false) const;

  void acquire(InstanceId id) { at(id).active += 1; }
  void release(InstanceId id) { at(id).active -= 1; }

  const std::vector<InstanceLoad>& loads() const { return instances_; }

 private:
  static constexpr uint32_t kNone = UINT32_MAX;

  // What the ready instances hold together, taken once per placement.
  struct PoolLoad {
    uint64_t active = 0;
    uint64_t weight = 0;
    uint64_t cap = 0;  // sum of max_queue_length x weight
    bool draining = false;
  };

  InstanceLoad& at(InstanceId id);
  const InstanceLoad& at(InstanceId id) const;
  PoolLoad pool_load(InstanceId holder) const;
  // Under its cap of live trajectories (max_queue_length x weight); unless the pool drains, fewer
  // than fair_share_headroom times its fair share (weight / pool weight) of the trajectories the
  // pool holds, the one being placed counted; if it reported its KV, less than kv_full_fraction
  // of it in use.
  bool room(const InstanceLoad& load, const PoolLoad& pool) const;
  // capped: only instances with room.
  uint32_t least_loaded(const std::vector<uint32_t>& candidates, InstanceId previous,
                        const PoolLoad* capped) const;
  void index_buckets();

  uint32_t max_queue_length_;
  double kv_full_fraction_;
  double fair_share_headroom_;
  double draining_fraction_;
  std::vector<InstanceLoad> instances_;             // sorted by id
  std::vector<std::vector<uint32_t>> by_bucket_;    // indices into instances_, ascending id
  std::vector<uint32_t> all_;                       // every index, ascending id
};

}  // namespace libra::cmlfq
