#include "cmlfq/instance_table.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace libra::cmlfq {
namespace {

bool id_less(const InstanceLoad& load, InstanceId id) { return load.id < id; }

}  // namespace

InstanceTable::InstanceTable(uint32_t num_buckets, uint32_t max_queue_length, double kv_full_fraction,
                             double fair_share_headroom, double draining_fraction)
    : max_queue_length_(max_queue_length),
      kv_full_fraction_(kv_full_fraction),
      fair_share_headroom_(fair_share_headroom),
      draining_fraction_(draining_fraction),
      by_bucket_(num_buckets) {}

void InstanceTable::add(InstanceId id, uint32_t bucket, bool ready, uint32_t weight) {
  if (id < 0) throw std::invalid_argument("instance ids must be non-negative");
  if (weight == 0) throw std::invalid_argument("instance weights must be >= 1");
  if (bucket >= by_bucket_.size()) throw std::invalid_argument("no bucket " + std::to_string(bucket));
  const auto it = std::lower_bound(instances_.begin(), instances_.end(), id, id_less);
  if (it != instances_.end() && it->id == id) {
    throw std::invalid_argument("instance " + std::to_string(id) + " already exists");
  }
  InstanceLoad load{id, bucket, 0, ready, weight};
  load.loading = !ready;
  instances_.insert(it, load);
  index_buckets();
}

void InstanceTable::remove(InstanceId id) {
  instances_.erase(instances_.begin() + (&at(id) - instances_.data()));
  index_buckets();
}

void InstanceTable::rebucket(uint32_t num_buckets, const std::vector<std::pair<InstanceId, uint32_t>>& buckets) {
  if (num_buckets == 0) throw std::invalid_argument("rebucket needs at least one bucket");
  std::vector<uint32_t> assigned(instances_.size(), kNone);
  for (const auto& [id, bucket] : buckets) {
    const auto it = std::lower_bound(instances_.begin(), instances_.end(), id, id_less);
    if (it == instances_.end() || it->id != id) {
      throw std::invalid_argument("rebucket names unknown instance " + std::to_string(id));
    }
    if (bucket >= num_buckets) {
      throw std::invalid_argument("instance " + std::to_string(id) + ": no bucket " + std::to_string(bucket));
    }
    uint32_t& slot = assigned[it - instances_.begin()];
    if (slot != kNone) throw std::invalid_argument("rebucket names instance " + std::to_string(id) + " twice");
    slot = bucket;
  }
  for (size_t i = 0; i < instances_.size(); ++i) {
    if (assigned[i] == kNone) {
      throw std::invalid_argument("rebucket leaves instance " + std::to_string(instances_[i].id) + " without a bucket");
    }
  }
  for (size_t i = 0; i < instances_.size(); ++i) instances_[i].bucket = assigned[i];
  by_bucket_.assign(num_buckets, {});
  index_buckets();
}

void InstanceTable::set_ready(InstanceId id, bool ready) {
  InstanceLoad& load = at(id);
  load.ready = ready;
  if (ready) load.loading = false;
}

void InstanceTable::set_max_queue_length(uint32_t max_queue_length) {
  if (max_queue_length == 0) throw std::invalid_argument("max_queue_length must be >= 1");
  max_queue_length_ = max_queue_length;
}

void InstanceTable::set_kv(InstanceId id, int64_t used, int64_t capacity) {
  if (used < 0 || capacity < 0) throw std::invalid_argument("KV tokens must be non-negative");
  InstanceLoad& load = at(id);
  load.kv_used = used;
  load.kv_capacity = capacity;
  // The product rounded once, as the Python reference computes it, and its ceiling exact: both
  // sides agree on every report.
  // (Capacities are at most 2**53, checked by the Python layer: the product stays an exact bound.)
  load.kv_full_at = std::min<int64_t>(
      capacity, static_cast<int64_t>(std::ceil(kv_full_fraction_ * static_cast<double>(capacity))));
}

bool InstanceTable::is_ready(InstanceId id) const { return id != kNoInstance && at(id).ready; }

InstanceTable::PoolLoad InstanceTable::pool_load(InstanceId holder) const {
  PoolLoad pool;
  for (const InstanceLoad& load : instances_) {
    if (!load.ready) continue;
    pool.active += load.id == holder && load.active > 0 ? load.active - 1 : load.active;
    pool.weight += load.weight;
    pool.cap += uint64_t{max_queue_length_} * load.weight;
  }
  pool.draining =
      pool.cap > 0 && static_cast<double>(pool.active) <= draining_fraction_ * static_cast<double>(pool.cap);
  return pool;
}

bool InstanceTable::room(const InstanceLoad& load, const PoolLoad& pool) const {
  if (uint64_t{load.active} >= uint64_t{max_queue_length_} * load.weight) return false;
  if (load.kv_capacity != 0 && load.kv_used >= load.kv_full_at) return false;
  // The fair-share bound, active / weight < headroom * (pool active + 1) / pool weight: without it
  // admission to the smallest bucket fills the small instances to their static caps, and a static
  // cap cannot know how many trajectories the pool will hold. Strict, with the trajectory being
  // placed counted, so that where every instance holds its share one still takes the next. While
  // the pool drains the tail should reach the fastest instances: only the static caps apply.
  if (fair_share_headroom_ == 0 || pool.draining) return true;
  return static_cast<double>(uint64_t{load.active} * pool.weight) <
         fair_share_headroom_ * static_cast<double>(pool.active + 1) * static_cast<double>(load.weight);
}

bool InstanceTable::draining() const { return pool_load(kNoInstance).draining; }

bool InstanceTable::has_room(uint32_t bucket, InstanceId holder) const {
  if (bucket >= by_bucket_.size()) return false;
  const PoolLoad pool = pool_load(holder);
  return least_loaded(by_bucket_[bucket], kNoInstance, &pool) != kNone;
}

// Adding and removing instances is rare (the planner does it), so the bucket index is rebuilt whole.
void InstanceTable::index_buckets() {
  for (auto& indices : by_bucket_) indices.clear();
  all_.clear();
  for (uint32_t i = 0; i < instances_.size(); ++i) {
    by_bucket_[instances_[i].bucket].push_back(i);
    all_.push_back(i);
  }
}

InstanceLoad& InstanceTable::at(InstanceId id) {
  return const_cast<InstanceLoad&>(std::as_const(*this).at(id));
}

const InstanceLoad& InstanceTable::at(InstanceId id) const {
  const auto it = std::lower_bound(instances_.begin(), instances_.end(), id, id_less);
  if (it == instances_.end() || it->id != id) throw UnknownId("unknown instance " + std::to_string(id));
  return *it;
}

uint32_t InstanceTable::least_loaded(const std::vector<uint32_t>& candidates, InstanceId previous,
                                     const PoolLoad* capped) const {
  uint32_t best = kNone;
  for (const uint32_t i : candidates) {
    const InstanceLoad& load = instances_[i];
    if (!load.ready || (capped != nullptr && !room(load, *capped))) continue;
    if (best == kNone) {
      best = i;
      continue;
    }
    // active / weight compared exactly, by cross-multiplication.
    const uint64_t mine = uint64_t{load.active} * instances_[best].weight;
    const uint64_t theirs = uint64_t{instances_[best].active} * load.weight;
    if (mine < theirs || (mine == theirs && load.id == previous)) best = i;
  }
  return best;
}

Placement InstanceTable::place(uint32_t bucket, InstanceId previous, bool previous_holds_it) const {
  const PoolLoad pool = pool_load(previous_holds_it ? previous : kNoInstance);
  if (const uint32_t i = least_loaded(by_bucket_[bucket], previous, &pool); i != kNone) {
    return {bucket, instances_[i].id, std::nullopt};
  }
  const auto num_buckets = static_cast<int64_t>(by_bucket_.size());
  for (int64_t distance = 1; distance < num_buckets; ++distance) {
    for (const int64_t other : {bucket + distance, bucket - distance}) {
      if (other < 0 || other >= num_buckets) continue;
      if (const uint32_t i = least_loaded(by_bucket_[other], previous, &pool); i != kNone) {
        return {static_cast<uint32_t>(other), instances_[i].id, Reason::kBucketSaturatedFallback};
      }
    }
  }
  const bool loading = std::any_of(instances_.begin(), instances_.end(),
                                   [](const InstanceLoad& load) { return load.loading; });
  if (const uint32_t i = loading ? kNone : least_loaded(all_, previous, nullptr); i != kNone) {
    return {instances_[i].bucket, instances_[i].id, Reason::kAnyInstanceFallback};
  }
  return {bucket, kNoInstance, Reason::kNoInstance};
}

}  // namespace libra::cmlfq
