// Transfer plans between two shardings of the same set of logical (HF-shaped) 2-D tensors.
//
// The idea: every sharded parameter, on either side, is a vertical stack of *blocks*; a block is a
// rectangle [row_start, row_start + num_rows) x [col_start, col_start + num_cols) of one logical
// tensor, stored row-major. A Megatron TP shard of the fused QKV is e.g. the stack
// [q rows of group g; k rows of g; v rows of g; ...]; a row-parallel shard (o_proj, down_proj) is one
// block with a column window. The layout rules that produce these blocks live in Python
// (libra/sync/layouts.py); this core only intersects rectangles, so it stays small and exact:
//
//   for each destination rank, for each destination param, for each of its blocks:
//     rows at or past the tensor's real row count (vocab padding) -> a fill run (zeros);
//     every source block of the same tensor that overlaps the rectangle -> copy runs: one run for
//     the whole overlap when it spans the full width of both blocks (contiguous rows), else one
//     run per row;
//   the overlaps must cover the real part of the rectangle exactly once, otherwise the layouts do
//   not describe the same tensors and planning fails naming the tensor.
//   Runs of a param are sorted by destination offset and adjacent runs that are contiguous in both
//   source and destination (same source param) are merged.
//
// All offsets and lengths are in elements; the element size only scales them into bytes.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace libra::reshard {

struct Block {
  int64_t tensor;     // index into the logical tensor table
  int64_t row_start;  // may run past the tensor's real rows: those rows are padding
  int64_t num_rows;
  int64_t col_start;
  int64_t num_cols;
};

struct TensorInfo {
  int64_t num_rows;  // real rows (without any padding)
  int64_t num_cols;
};

// One param = its blocks stacked along rows; every block has the same num_cols.
using ParamBlocks = std::vector<Block>;

// A contiguous copy (or a zero fill when src < 0) into a destination rank's flat buffer.
struct Run {
  int64_t src;         // source param index, -1 for a zero fill
  int64_t src_offset;  // elements into the source param
  int64_t dst_offset;  // elements into the destination rank's flat buffer
  int64_t length;      // elements
};

// A piece of a destination flat buffer on param boundaries, with the runs that write it.
struct Bucket {
  int64_t dst_start;  // elements
  int64_t dst_end;
  int64_t first_run;  // runs [first_run, last_run) write exactly [dst_start, dst_end)
  int64_t last_run;
};

struct RankPlan {
  std::vector<Run> runs;                // sorted by dst_offset, covering [0, numel) exactly once
  std::vector<int64_t> run_end_bytes;   // prefix sums of run bytes (for splitting work over threads)
  std::vector<int64_t> param_offsets;   // elements; params concatenated in the order given
  std::vector<int64_t> param_numels;
  std::vector<Bucket> buckets;
  int64_t numel = 0;
};

struct TransferPlan {
  int64_t elem_size = 0;
  std::vector<int64_t> src_numels;  // expected element count of every source param
  std::vector<RankPlan> ranks;
};

// Thrown for layouts that cannot be planned (mapped to ValueError in Python).
struct PlanError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// src_readable[i] == false: param i is a replica the plan must not read (it is still a valid source
// buffer, so its size is recorded). Tensor names are only used in error messages.
TransferPlan build_plan(const std::vector<TensorInfo>& tensors, const std::vector<std::string>& tensor_names,
                        const std::vector<ParamBlocks>& src_params, const std::vector<bool>& src_readable,
                        const std::vector<std::vector<ParamBlocks>>& dst_ranks, int64_t elem_size,
                        int64_t bucket_bytes);

// Copies every run of `bucket` (or of the whole rank when bucket < 0) from the source params into
// dst with up to num_threads std::threads; src_ptrs[i] is the base address of source param i.
// dst is the rank's whole flat buffer, or only the bucket's piece of it when dst_is_bucket.
// The caller has validated every buffer size; this does no checking beyond the rank/bucket index.
void execute_plan(const TransferPlan& plan, int64_t rank, const std::vector<uintptr_t>& src_ptrs, uintptr_t dst_ptr,
                  int num_threads, int64_t bucket, bool dst_is_bucket);

}  // namespace libra::reshard
