// Python surface of the C-MLFQ core (libra/scheduler/cmlfq.py wraps it in typed dataclasses).
// Every call releases the GIL around the core's work; results are converted after the GIL is back.
#include <pybind11/stl.h>

#include <string_view>
#include <tuple>

#include "cmlfq/scheduler.h"
#include "native.h"

namespace py = pybind11;

namespace libra {
namespace {

using cmlfq::Decision;
using cmlfq::Scheduler;
using DecisionTuple = std::tuple<uint32_t, cmlfq::InstanceId, int, bool>;  // bucket, instance, reason, migrated

DecisionTuple as_tuple(const Decision& d) { return {d.bucket, d.instance, static_cast<int>(d.reason), d.migrated}; }

using SpeedTuple = std::tuple<double, double, double, double>;  // cmlfq::BucketSpeed's fields, in order

std::vector<cmlfq::BucketSpeed> as_speeds(const std::vector<SpeedTuple>& speeds) {
  std::vector<cmlfq::BucketSpeed> out;
  for (const auto& [step, per_sequence, move_linear, move_quadratic] : speeds) {
    out.push_back({step, per_sequence, move_linear, move_quadratic});
  }
  return out;
}

}  // namespace

void bind_cmlfq(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const cmlfq::UnknownId& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });

  m.def("cmlfq_reason_names", [] {
    std::vector<std::string> names;
    for (int r = 0; r < cmlfq::kNumReasons; ++r) names.emplace_back(cmlfq::reason_name(static_cast<cmlfq::Reason>(r)));
    return names;
  }, "Reason codes in the order of their integer values.");

  using release_gil = py::call_guard<py::gil_scoped_release>;
  py::class_<Scheduler>(m, "CmlfqScheduler", "The C-MLFQ core; arguments are validated by CmlfqConfig.")
      .def(py::init([](std::vector<int64_t> thresholds, uint32_t max_queue_length, uint32_t p90_window,
                       uint32_t rebuild_window, uint32_t rebuild_interval, bool demote, double kv_full_fraction,
                       const std::vector<SpeedTuple>& speeds, double draining_fraction,
                       double fair_share_headroom) {
             return std::make_unique<Scheduler>(cmlfq::Config{std::move(thresholds), max_queue_length,
                                                              kv_full_fraction, p90_window, rebuild_window,
                                                              rebuild_interval, demote, as_speeds(speeds),
                                                              draining_fraction, fair_share_headroom});
           }),
           py::arg("bucket_thresholds"), py::arg("max_queue_length"), py::arg("p90_window"),
           py::arg("rebuild_window"), py::arg("rebuild_interval"), py::arg("demote") = false,
           py::arg("kv_full_fraction") = 0.85, py::arg("bucket_speeds") = std::vector<SpeedTuple>{},
           py::arg("draining_fraction") = 0.25, py::arg("fair_share_headroom") = 1.2,
           "bucket_speeds: empty, or (step_s, per_sequence_s, move_linear_s, move_quadratic_s) per bucket.")
      .def("admit", [](Scheduler& s, const std::string& t, const std::string& prompt) { return as_tuple(s.admit(t, prompt)); },
           release_gil())
      .def("on_tool_return",
           [](Scheduler& s, const std::string& t, uint64_t state, int64_t generated, int64_t context) {
             return as_tuple(s.on_tool_return(t, state, generated, context));
           },
           release_gil(), py::arg("trajectory"), py::arg("state"), py::arg("generated"), py::arg("context") = 0)
      .def("on_finish", &Scheduler::on_finish, release_gil())
      .def("on_abort", &Scheduler::on_abort, release_gil())
      .def("reroute", [](Scheduler& s, const std::string& t) { return as_tuple(s.reroute(t)); }, release_gil())
      .def("add_instance", &Scheduler::add_instance, release_gil(), py::arg("instance"), py::arg("bucket"),
           py::arg("ready"), py::arg("weight") = 1)
      .def("remove_instance", &Scheduler::remove_instance, release_gil())
      .def("update_buckets",
           [](Scheduler& s, std::vector<int64_t> thresholds,
              const std::vector<std::pair<cmlfq::InstanceId, uint32_t>>& instance_buckets,
              const std::vector<SpeedTuple>& speeds) {
             std::vector<std::pair<std::string, DecisionTuple>> moved;
             for (const auto& [id, d] : s.update_buckets(std::move(thresholds), instance_buckets, as_speeds(speeds))) {
               moved.emplace_back(id, as_tuple(d));
             }
             return moved;
           },
           release_gil(), py::arg("thresholds"), py::arg("instance_buckets"),
           py::arg("bucket_speeds") = std::vector<SpeedTuple>{},
           "(trajectory id, (bucket, instance, reason, migrated)) of each trajectory moved, ascending id.")
      .def("set_speeds",
           [](Scheduler& s, const std::vector<SpeedTuple>& speeds) { s.set_speeds(as_speeds(speeds)); },
           release_gil(), py::arg("bucket_speeds"))
      .def("set_max_queue_length", &Scheduler::set_max_queue_length, release_gil(), py::arg("max_queue_length"))
      .def("thresholds", &Scheduler::thresholds, release_gil())
      .def("set_instance_ready", &Scheduler::set_instance_ready, release_gil())
      .def("set_instance_kv", &Scheduler::set_instance_kv, release_gil(), py::arg("instance"), py::arg("used"),
           py::arg("capacity"))
      .def("instance_loads",
           [](const Scheduler& s) {
             std::vector<std::tuple<cmlfq::InstanceId, uint32_t, uint32_t, bool, int64_t, int64_t>> loads;
             for (const auto& l : s.instance_loads()) {
               loads.emplace_back(l.id, l.bucket, l.active, l.ready, l.kv_used, l.kv_capacity);
             }
             return loads;
           },
           release_gil(), "(id, bucket, active trajectories, ready, KV used, KV capacity) per instance, ascending id.")
      .def("num_live", &Scheduler::num_live, release_gil())
      .def("predict",
           [](const Scheduler& s, const std::string& prompt, const std::vector<uint64_t>& path)
               -> std::optional<std::tuple<bool, uint32_t, int64_t, int64_t, int32_t>> {
             const auto p = s.predict(prompt, path);
             if (!p) return std::nullopt;
             return std::make_tuple(p->from_prompt_tree, p->depth, p->stats.count, p->stats.sum, p->stats.p90);
           },
           release_gil(), "(from prompt tree, depth, count, sum, p90) of the node routing would use, or None.")
      .def("rebuild", &Scheduler::rebuild, release_gil())
      .def("serialize",
           [](const Scheduler& s) {
             std::string bytes;
             {
               py::gil_scoped_release released;
               bytes = s.serialize();
             }
             return py::bytes(bytes);
           })
      .def("restore",
           [](Scheduler& s, const py::bytes& bytes) {
             const std::string_view view = bytes;
             py::gil_scoped_release released;
             s.restore(view);
           })
      .def("merge", [](Scheduler& s, const py::bytes& bytes) {
        const std::string_view view = bytes;
        py::gil_scoped_release released;
        s.merge(view);
      });
}

}  // namespace libra
