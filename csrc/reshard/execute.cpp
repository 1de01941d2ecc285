// Executes one destination rank's plan (or one bucket of it) with memcpy/memset on std::threads.
//
// The runs of the range are seen as one byte stream (run_end_bytes is its prefix sum); thread i
// takes bytes [i*B/n, (i+1)*B/n) of it, cut on 64-byte boundaries, so threads get equal bytes no
// matter how runs are sized (one 500 MB embedding run or thousands of 2 KB rows).
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "reshard/plan.h"

namespace libra::reshard {
namespace {

constexpr int64_t kMinBytesPerThread = 1 << 20;  // below this, a thread costs more than it copies
constexpr int64_t kCutAlignment = 64;

// Copies the bytes [lo, hi) of the stream made by runs [first, last) (stream offset base at first).
// dst points at destination element dst_origin (0 for the rank's whole flat buffer).
void copy_window(const RankPlan& rank, int64_t first, int64_t last, int64_t base, int64_t lo, int64_t hi,
                 int64_t elem_size, const std::vector<uintptr_t>& src_ptrs, char* dst, int64_t dst_origin) {
  const auto ends_begin = rank.run_end_bytes.begin();
  // First run whose end lies past lo.
  int64_t r = std::upper_bound(ends_begin + first, ends_begin + last, base + lo) - ends_begin;
  for (; r < last; ++r) {
    const Run& run = rank.runs[r];
    const int64_t run_bytes = run.length * elem_size;
    const int64_t run_start = rank.run_end_bytes[r] - run_bytes - base;
    if (run_start >= hi) break;
    const int64_t from = std::max(lo, run_start) - run_start;
    const int64_t to = std::min(hi, run_start + run_bytes) - run_start;
    char* out = dst + (run.dst_offset - dst_origin) * elem_size + from;
    if (run.src < 0) {
      std::memset(out, 0, to - from);
    } else {
      const char* in = reinterpret_cast<const char*>(src_ptrs[run.src]) + run.src_offset * elem_size + from;
      std::memcpy(out, in, to - from);
    }
  }
}

}  // namespace

void execute_plan(const TransferPlan& plan, int64_t rank_index, const std::vector<uintptr_t>& src_ptrs,
                  uintptr_t dst_ptr, int num_threads, int64_t bucket, bool dst_is_bucket) {
  if (rank_index < 0 || rank_index >= static_cast<int64_t>(plan.ranks.size()))
    throw std::out_of_range("destination rank " + std::to_string(rank_index) + " is not in the plan");
  const RankPlan& rank = plan.ranks[rank_index];
  if (bucket >= static_cast<int64_t>(rank.buckets.size()))
    throw std::out_of_range("bucket " + std::to_string(bucket) + " is not in the plan of rank " +
                            std::to_string(rank_index));
  if (src_ptrs.size() != plan.src_numels.size())
    throw std::invalid_argument("expected one source pointer per source param");

  const int64_t first = bucket < 0 ? 0 : rank.buckets[bucket].first_run;
  const int64_t last = bucket < 0 ? static_cast<int64_t>(rank.runs.size()) : rank.buckets[bucket].last_run;
  if (first == last) return;
  const int64_t base = first == 0 ? 0 : rank.run_end_bytes[first - 1];
  const int64_t total = rank.run_end_bytes[last - 1] - base;
  char* dst = reinterpret_cast<char*>(dst_ptr);
  const int64_t origin = bucket >= 0 && dst_is_bucket ? rank.buckets[bucket].dst_start : 0;

  const int64_t by_size = std::max<int64_t>(1, total / kMinBytesPerThread);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, by_size)));
  if (threads == 1) {
    copy_window(rank, first, last, base, 0, total, plan.elem_size, src_ptrs, dst, origin);
    return;
  }
  auto cut = [&](int i) {
    if (i == threads) return total;
    return (total / threads * i) / kCutAlignment * kCutAlignment;
  };
  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  for (int i = 1; i < threads; ++i)
    workers.emplace_back(copy_window, std::cref(rank), first, last, base, cut(i), cut(i + 1), plan.elem_size,
                         std::cref(src_ptrs), dst, origin);
  copy_window(rank, first, last, base, 0, cut(1), plan.elem_size, src_ptrs, dst, origin);
  for (std::thread& w : workers) w.join();
}

}  // namespace libra::reshard
