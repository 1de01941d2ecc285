// The causality-aware prefix tree: a trie over the tool-return states of completed trajectories.
// A node is a causal path prefix; it keeps how many trajectories went through it and the remaining
// output tokens they still had there (exact sum for the mean, a bounded window for the P90).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "cmlfq/bytes.h"
#include "cmlfq/cmlfq.h"

namespace libra::cmlfq {

// The last `capacity` samples, kept twice: in arrival order (to know which one to evict) and
// sorted (so the P90 is one array read). Both updates are a memmove of at most `capacity` ints,
// which is cheaper at query time than any selection algorithm.
class SampleWindow {
 public:
  void add(int32_t sample, uint32_t capacity);
  void clear();  // keeps the buffers' capacity
  // Nearest-rank P90: the ceil(0.9 n)-th smallest sample. Requires a non-empty window.
  int32_t p90() const { return sorted_[(9 * sorted_.size() + 9) / 10 - 1]; }
  bool empty() const { return ring_.empty(); }
  std::vector<int32_t> chronological() const;

 private:
  std::vector<int32_t> ring_;
  uint32_t oldest_ = 0;  // index of the oldest sample once the ring is full
  std::vector<int32_t> sorted_;
};

struct NodeStats {
  int64_t count;
  int64_t sum;  // of remaining output tokens; the mean is sum / count
  int32_t p90;
};

class PrefixTree {
 public:
  static constexpr uint32_t kRoot = 0;
  static constexpr uint32_t kNone = UINT32_MAX;

  explicit PrefixTree(uint32_t p90_window);

  // Learns one completed trajectory. remaining[i] is the output tokens it still had to generate
  // after its first i tool returns (remaining[0]: at admission), so remaining.size() == path.size() + 1.
  void insert(const std::vector<StateKey>& path, const std::vector<int32_t>& remaining);

  // Deepest match of `path`, resumed from a previous match (node, depth) of a prefix of it. Nodes
  // are only ever appended, so a match stays valid until clear(); resuming makes the walk of a
  // trajectory that gains one state per tool return O(1) amortised.
  void extend_match(const std::vector<StateKey>& path, uint32_t& node, uint32_t& depth) const;

  bool empty() const { return nodes_[kRoot].count == 0; }
  NodeStats stats(uint32_t node) const;
  void clear();

  // Adds `other`'s knowledge node by node: counts and sums add up; each window receives the other's
  // samples after its own, and keeps the most recent p90_window of them.
  void merge(const PrefixTree& other);

  // Checkpoint form: nodes in creation order, so every parent precedes its children.
  void write(ByteWriter& out) const;
  static PrefixTree read(ByteReader& in, uint32_t p90_window);

 private:
  struct Node {
    Node(uint32_t parent, StateKey key) : parent(parent), key(key) {}
    void reset(uint32_t new_parent, StateKey new_key);  // keeps the buffers' capacity
    // What a routing decision reads comes first, to share the node's first cache line.
    uint32_t parent;
    int32_t p90 = 0;  // of the window, refreshed whenever it changes
    StateKey key;
    int64_t count = 0;
    int64_t sum = 0;
    // Few distinct states follow a prefix, so a flat vector scans faster than a hash map.
    std::vector<std::pair<StateKey, uint32_t>> children;
    SampleWindow window;
  };

  uint32_t child(uint32_t node, StateKey key) const;
  uint32_t child_or_create(uint32_t node, StateKey key);
  void record(uint32_t node, int32_t remaining);

  uint32_t p90_window_;
  // nodes_[0, num_nodes_) is the tree. clear() keeps the nodes beyond for reuse: a rebuild would
  // otherwise free and reallocate every node's buffers, which took 40% of its time in malloc.
  std::vector<Node> nodes_;
  uint32_t num_nodes_ = 0;
};

}  // namespace libra::cmlfq
