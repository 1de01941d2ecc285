// Builds transfer plans by intersecting destination blocks with source blocks (see plan.h).
#include "reshard/plan.h"

#include <algorithm>
#include <string>

namespace libra::reshard {
namespace {

// A source block placed in its param: where its first row starts inside the param.
struct PlacedBlock {
  Block block;
  int64_t param;
  int64_t param_row_offset;  // elements from the param start to the block's first element
};

std::string describe(const std::vector<std::string>& names, int64_t tensor) {
  if (tensor >= 0 && tensor < static_cast<int64_t>(names.size())) return "'" + names[tensor] + "'";
  return "#" + std::to_string(tensor);
}

int64_t param_numel(const ParamBlocks& blocks) {
  int64_t numel = 0;
  for (const Block& b : blocks) numel += b.num_rows * b.num_cols;
  return numel;
}

void check_block(const Block& b, const std::vector<TensorInfo>& tensors, const std::vector<std::string>& names,
                 int64_t param_cols) {
  if (b.tensor < 0 || b.tensor >= static_cast<int64_t>(tensors.size()))
    throw PlanError("block refers to unknown tensor " + describe(names, b.tensor));
  const TensorInfo& t = tensors[b.tensor];
  if (b.row_start < 0 || b.num_rows < 0 || b.col_start < 0 || b.num_cols <= 0 ||
      b.col_start + b.num_cols > t.num_cols)
    throw PlanError("block of tensor " + describe(names, b.tensor) + " lies outside its columns");
  if (b.num_cols != param_cols)
    throw PlanError("blocks of one param must have equal widths (tensor " + describe(names, b.tensor) + ")");
}

// Source blocks grouped by logical tensor, so each destination block scans only its own tensor.
std::vector<std::vector<PlacedBlock>> index_sources(const std::vector<TensorInfo>& tensors,
                                                    const std::vector<std::string>& names,
                                                    const std::vector<ParamBlocks>& src_params,
                                                    const std::vector<bool>& src_readable) {
  std::vector<std::vector<PlacedBlock>> by_tensor(tensors.size());
  for (size_t p = 0; p < src_params.size(); ++p) {
    int64_t offset = 0;
    for (const Block& b : src_params[p]) {
      check_block(b, tensors, names, src_params[p].front().num_cols);
      if (src_readable[p]) by_tensor[b.tensor].push_back({b, static_cast<int64_t>(p), offset});
      offset += b.num_rows * b.num_cols;
    }
  }
  return by_tensor;
}

// Appends the runs that fill one destination block whose first element is at dst_base.
void plan_block(const Block& dst, int64_t dst_base, const TensorInfo& tensor, const std::vector<PlacedBlock>& sources,
                const std::string& tensor_name, std::vector<Run>& runs) {
  const int64_t real_end = std::min(dst.row_start + dst.num_rows, std::max(dst.row_start, tensor.num_rows));
  const int64_t real_rows = real_end - dst.row_start;
  if (real_rows < dst.num_rows)  // padding rows: no source has them
    runs.push_back({-1, 0, dst_base + real_rows * dst.num_cols, (dst.num_rows - real_rows) * dst.num_cols});

  int64_t covered = 0;
  for (const PlacedBlock& s : sources) {
    const Block& src = s.block;
    const int64_t r0 = std::max(dst.row_start, src.row_start);
    const int64_t r1 = std::min(real_end, src.row_start + src.num_rows);
    const int64_t c0 = std::max(dst.col_start, src.col_start);
    const int64_t c1 = std::min(dst.col_start + dst.num_cols, src.col_start + src.num_cols);
    if (r0 >= r1 || c0 >= c1) continue;
    covered += (r1 - r0) * (c1 - c0);
    const int64_t src_first = s.param_row_offset + (r0 - src.row_start) * src.num_cols + (c0 - src.col_start);
    const int64_t dst_first = dst_base + (r0 - dst.row_start) * dst.num_cols + (c0 - dst.col_start);
    const bool full_width = c0 == src.col_start && c1 - c0 == src.num_cols && c0 == dst.col_start &&
                            c1 - c0 == dst.num_cols;
    if (full_width) {
      runs.push_back({s.param, src_first, dst_first, (r1 - r0) * (c1 - c0)});
      continue;
    }
    for (int64_t r = 0; r < r1 - r0; ++r)
      runs.push_back({s.param, src_first + r * src.num_cols, dst_first + r * dst.num_cols, c1 - c0});
  }
  if (covered != real_rows * dst.num_cols)
    throw PlanError("tensor '" + tensor_name + "' rows [" + std::to_string(dst.row_start) + ", " +
                    std::to_string(real_end) + ") x cols [" + std::to_string(dst.col_start) + ", " +
                    std::to_string(dst.col_start + dst.num_cols) + ") are covered by " + std::to_string(covered) +
                    " source elements, expected " + std::to_string(real_rows * dst.num_cols) +
                    " (missing or overlapping source shards)");
}

// Sorts the runs of one param by destination and merges neighbours contiguous on both sides.
void sort_and_merge(std::vector<Run>& param_runs, std::vector<Run>& out) {
  std::sort(param_runs.begin(), param_runs.end(),
            [](const Run& a, const Run& b) { return a.dst_offset < b.dst_offset; });
  for (const Run& r : param_runs) {
    if (r.length == 0) continue;
    if (!out.empty()) {
      Run& last = out.back();
      const bool dst_adjacent = last.dst_offset + last.length == r.dst_offset;
      const bool same_fill = last.src < 0 && r.src < 0;
      const bool src_adjacent = last.src >= 0 && last.src == r.src && last.src_offset + last.length == r.src_offset;
      if (dst_adjacent && (same_fill || src_adjacent)) {
        last.length += r.length;
        continue;
      }
    }
    out.push_back(r);
  }
}

// Splits the rank's flat buffer into buckets of at most bucket_bytes on param boundaries; a param
// larger than a bucket gets a bucket of its own.
void make_buckets(RankPlan& rank, int64_t elem_size, int64_t bucket_bytes) {
  size_t run = 0;
  size_t p = 0;
  while (p < rank.param_offsets.size()) {
    const int64_t start = rank.param_offsets[p];
    int64_t end = start + rank.param_numels[p];
    for (++p; p < rank.param_offsets.size(); ++p) {
      const int64_t next_end = rank.param_offsets[p] + rank.param_numels[p];
      if ((next_end - start) * elem_size > bucket_bytes) break;
      end = next_end;
    }
    const size_t first = run;
    while (run < rank.runs.size() && rank.runs[run].dst_offset < end) ++run;
    rank.buckets.push_back({start, end, static_cast<int64_t>(first), static_cast<int64_t>(run)});
  }
}

}  // namespace

TransferPlan build_plan(const std::vector<TensorInfo>& tensors, const std::vector<std::string>& tensor_names,
                        const std::vector<ParamBlocks>& src_params, const std::vector<bool>& src_readable,
                        const std::vector<std::vector<ParamBlocks>>& dst_ranks, int64_t elem_size,
                        int64_t bucket_bytes) {
  if (elem_size <= 0) throw PlanError("elem_size must be positive");
  if (bucket_bytes <= 0) throw PlanError("bucket_bytes must be positive");
  if (tensor_names.size() != tensors.size()) throw PlanError("tensor_names must name every tensor");
  if (src_readable.size() != src_params.size()) throw PlanError("src_readable must have one flag per source param");
  for (const ParamBlocks& p : src_params)
    if (p.empty()) throw PlanError("a source param has no blocks");
  const auto sources = index_sources(tensors, tensor_names, src_params, src_readable);

  TransferPlan plan;
  plan.elem_size = elem_size;
  for (const ParamBlocks& p : src_params) plan.src_numels.push_back(param_numel(p));

  for (const auto& dst_params : dst_ranks) {
    RankPlan rank;
    std::vector<Run> param_runs;
    for (const ParamBlocks& param : dst_params) {
      if (param.empty()) throw PlanError("a destination param has no blocks");
      rank.param_offsets.push_back(rank.numel);
      param_runs.clear();
      int64_t offset = rank.numel;
      for (const Block& b : param) {
        check_block(b, tensors, tensor_names, param.front().num_cols);
        plan_block(b, offset, tensors[b.tensor], sources[b.tensor], tensor_names[b.tensor], param_runs);
        offset += b.num_rows * b.num_cols;
      }
      rank.param_numels.push_back(offset - rank.numel);
      rank.numel = offset;
      sort_and_merge(param_runs, rank.runs);
    }
    int64_t bytes = 0;
    for (const Run& r : rank.runs) {
      bytes += r.length * elem_size;
      rank.run_end_bytes.push_back(bytes);
    }
    make_buckets(rank, elem_size, bucket_bytes);
    plan.ranks.push_back(std::move(rank));
  }
  return plan;
}

}  // namespace libra::reshard
