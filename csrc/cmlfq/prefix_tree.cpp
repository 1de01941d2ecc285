#include "cmlfq/prefix_tree.h"

#include <algorithm>
#include <stdexcept>

namespace libra::cmlfq {

void SampleWindow::add(int32_t sample, uint32_t capacity) {
  if (ring_.size() < capacity) {
    ring_.push_back(sample);
  } else {
    const int32_t evicted = ring_[oldest_];
    ring_[oldest_] = sample;
    oldest_ = (oldest_ + 1) % capacity;
    sorted_.erase(std::lower_bound(sorted_.begin(), sorted_.end(), evicted));
  }
  sorted_.insert(std::upper_bound(sorted_.begin(), sorted_.end(), sample), sample);
}

void SampleWindow::clear() {
  ring_.clear();
  sorted_.clear();
  oldest_ = 0;
}

std::vector<int32_t> SampleWindow::chronological() const {
  std::vector<int32_t> samples(ring_.begin() + oldest_, ring_.end());
  samples.insert(samples.end(), ring_.begin(), ring_.begin() + oldest_);
  return samples;
}

PrefixTree::PrefixTree(uint32_t p90_window) : p90_window_(p90_window) { clear(); }

void PrefixTree::Node::reset(uint32_t new_parent, StateKey new_key) {
  parent = new_parent;
  key = new_key;
  p90 = 0;
  count = 0;
  sum = 0;
  children.clear();
  window.clear();
}

void PrefixTree::clear() {
  if (nodes_.empty()) nodes_.emplace_back(kNone, 0);
  nodes_[kRoot].reset(kNone, 0);
  num_nodes_ = 1;  // the others are reset when child_or_create reuses them
}

uint32_t PrefixTree::child(uint32_t node, StateKey key) const {
  for (const auto& [child_key, child_index] : nodes_[node].children) {
    if (child_key == key) return child_index;
  }
  return kNone;
}

uint32_t PrefixTree::child_or_create(uint32_t node, StateKey key) {
  if (const uint32_t found = child(node, key); found != kNone) return found;
  const uint32_t created = num_nodes_++;
  if (created < nodes_.size()) {
    nodes_[created].reset(node, key);
  } else {
    nodes_.emplace_back(node, key);  // may reallocate: index nodes_ again below
  }
  nodes_[node].children.emplace_back(key, created);
  return created;
}

void PrefixTree::record(uint32_t node, int32_t remaining) {
  Node& n = nodes_[node];
  n.count += 1;
  n.sum += remaining;
  n.window.add(remaining, p90_window_);
  n.p90 = n.window.p90();
}

void PrefixTree::insert(const std::vector<StateKey>& path, const std::vector<int32_t>& remaining) {
  uint32_t node = kRoot;
  record(node, remaining[0]);
  for (size_t i = 0; i < path.size(); ++i) {
    node = child_or_create(node, path[i]);
    record(node, remaining[i + 1]);
  }
}

void PrefixTree::extend_match(const std::vector<StateKey>& path, uint32_t& node, uint32_t& depth) const {
  while (depth < path.size()) {
    const uint32_t next = child(node, path[depth]);
    if (next == kNone) return;
    node = next;
    ++depth;
  }
}

NodeStats PrefixTree::stats(uint32_t node) const {
  const Node& n = nodes_[node];
  return {n.count, n.sum, n.p90};
}

void PrefixTree::merge(const PrefixTree& other) {
  // other's nodes come parents first, so each one's counterpart here exists by the time we reach it.
  std::vector<uint32_t> counterpart(other.num_nodes_, kRoot);
  for (uint32_t i = 0; i < other.num_nodes_; ++i) {
    const Node& theirs = other.nodes_[i];
    if (i != kRoot) counterpart[i] = child_or_create(counterpart[theirs.parent], theirs.key);
    Node& ours = nodes_[counterpart[i]];
    ours.count += theirs.count;
    ours.sum += theirs.sum;
    for (const int32_t sample : theirs.window.chronological()) ours.window.add(sample, p90_window_);
    if (!ours.window.empty()) ours.p90 = ours.window.p90();
  }
}

void PrefixTree::write(ByteWriter& out) const {
  out.put<uint32_t>(num_nodes_);
  for (uint32_t i = 0; i < num_nodes_; ++i) {
    const Node& n = nodes_[i];
    out.put<uint32_t>(n.parent);
    out.put<uint64_t>(n.key);
    out.put<int64_t>(n.count);
    out.put<int64_t>(n.sum);
    const std::vector<int32_t> samples = n.window.chronological();
    out.put<uint32_t>(static_cast<uint32_t>(samples.size()));
    for (const int32_t sample : samples) out.put<int32_t>(sample);
  }
}

PrefixTree PrefixTree::read(ByteReader& in, uint32_t p90_window) {
  PrefixTree tree(p90_window);
  const auto num_nodes = in.get<uint32_t>();
  if (num_nodes == 0) throw std::invalid_argument("C-MLFQ checkpoint: a tree without a root");
  for (uint32_t i = 0; i < num_nodes; ++i) {
    const auto parent = in.get<uint32_t>();
    const auto key = in.get<uint64_t>();
    if (i != kRoot && parent >= i) throw std::invalid_argument("C-MLFQ checkpoint: node before its parent");
    const uint32_t node = i == kRoot ? kRoot : tree.child_or_create(parent, key);
    if (node != i) throw std::invalid_argument("C-MLFQ checkpoint: duplicate child");
    Node& n = tree.nodes_[node];
    n.count = in.get<int64_t>();
    n.sum = in.get<int64_t>();
    const auto num_samples = in.get<uint32_t>();
    // A node with visits always has samples: the P90 reads the window without checking.
    if ((i != kRoot && n.count <= 0) || (n.count > 0) != (num_samples > 0)) {
      throw std::invalid_argument("C-MLFQ checkpoint: bad node statistics");
    }
    for (uint32_t s = 0; s < num_samples; ++s) n.window.add(in.get<int32_t>(), p90_window);
    if (num_samples > 0) n.p90 = n.window.p90();
  }
  return tree;
}

}  // namespace libra::cmlfq
