// Python surface of the resharding core (libra/sync/plan.py and executor.py wrap it with typed,
// validating facades). Planning and copying release the GIL; results are converted once it is back.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <array>

#include "native.h"
#include "reshard/plan.h"

namespace py = pybind11;

namespace libra {
namespace {

using reshard::Block;
using reshard::ParamBlocks;
using reshard::TransferPlan;
using BlockTuple = std::array<int64_t, 5>;  // tensor, row_start, num_rows, col_start, num_cols

ParamBlocks to_blocks(const std::vector<BlockTuple>& tuples) {
  ParamBlocks blocks;
  blocks.reserve(tuples.size());
  for (const BlockTuple& t : tuples) blocks.push_back({t[0], t[1], t[2], t[3], t[4]});
  return blocks;
}

// Copies rows of int64 fields into a fresh (n, k) numpy array.
template <typename T, size_t K, typename F>
py::array_t<int64_t> table(const std::vector<T>& rows, F fields) {
  py::array_t<int64_t> out({static_cast<py::ssize_t>(rows.size()), static_cast<py::ssize_t>(K)});
  auto view = out.template mutable_unchecked<2>();
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::array<int64_t, K> values = fields(rows[i]);
    for (size_t j = 0; j < K; ++j) view(i, j) = values[j];
  }
  return out;
}

const reshard::RankPlan& rank_of(const TransferPlan& plan, int64_t rank) {
  if (rank < 0 || rank >= static_cast<int64_t>(plan.ranks.size()))
    throw py::index_error("destination rank " + std::to_string(rank) + " is not in the plan");
  return plan.ranks[rank];
}

}  // namespace

void bind_reshard(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const reshard::PlanError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  py::class_<TransferPlan>(m, "ReshardPlan", "A transfer plan built by reshard_build_plan; see csrc/reshard/plan.h.")
      .def_readonly("elem_size", &TransferPlan::elem_size)
      .def_readonly("src_numels", &TransferPlan::src_numels)
      .def_property_readonly("num_ranks", [](const TransferPlan& p) { return p.ranks.size(); })
      .def("rank_numel", [](const TransferPlan& p, int64_t r) { return rank_of(p, r).numel; })
      .def("param_offsets", [](const TransferPlan& p, int64_t r) { return rank_of(p, r).param_offsets; })
      .def("runs",
           [](const TransferPlan& p, int64_t r) {
             return table<reshard::Run, 4>(rank_of(p, r).runs, [](const reshard::Run& x) {
               return std::array<int64_t, 4>{x.src, x.src_offset, x.dst_offset, x.length};
             });
           },
           "(n, 4) int64: source param (-1 = zero fill), source offset, destination offset, length; elements.")
      .def("buckets",
           [](const TransferPlan& p, int64_t r) {
             return table<reshard::Bucket, 4>(rank_of(p, r).buckets, [](const reshard::Bucket& x) {
               return std::array<int64_t, 4>{x.dst_start, x.dst_end, x.first_run, x.last_run};
             });
           },
           "(n, 4) int64: destination start, end (elements), first run, end run.");

  m.def(
      "reshard_build_plan",
      [](const std::vector<std::pair<int64_t, int64_t>>& tensor_shapes, const std::vector<std::string>& tensor_names,
         const std::vector<std::vector<BlockTuple>>& src_params, const std::vector<bool>& src_readable,
         const std::vector<std::vector<std::vector<BlockTuple>>>& dst_ranks, int64_t elem_size,
         int64_t bucket_bytes) {
        py::gil_scoped_release release;
        std::vector<reshard::TensorInfo> tensors;
        for (const auto& [rows, cols] : tensor_shapes) tensors.push_back({rows, cols});
        std::vector<ParamBlocks> src;
        for (const auto& p : src_params) src.push_back(to_blocks(p));
        std::vector<std::vector<ParamBlocks>> dst(dst_ranks.size());
        for (size_t r = 0; r < dst_ranks.size(); ++r)
          for (const auto& p : dst_ranks[r]) dst[r].push_back(to_blocks(p));
        return reshard::build_plan(tensors, tensor_names, src, src_readable, dst, elem_size, bucket_bytes);
      },
      py::arg("tensor_shapes"), py::arg("tensor_names"), py::arg("src_params"), py::arg("src_readable"),
      py::arg("dst_ranks"), py::arg("elem_size"), py::arg("bucket_bytes"),
      "Plan copies from source params into every destination rank's flat buffer (blocks: tensor, row_start, "
      "num_rows, col_start, num_cols).");

  m.def("reshard_execute", &reshard::execute_plan, py::arg("plan"), py::arg("rank"), py::arg("src_ptrs"),
        py::arg("dst_ptr"), py::arg("num_threads"), py::arg("bucket"), py::arg("dst_is_bucket"),
        py::call_guard<py::gil_scoped_release>(),
        "Copy a rank's (or one bucket's) runs; buffers are raw addresses validated by libra.sync.executor.");
}

}  // namespace libra
