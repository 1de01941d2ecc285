// The one bindings file of `libra._native`: every core's Python surface is registered here.
#include "native.h"

namespace py = pybind11;

namespace libra {

py::dict build_info() {
  py::dict info;
  info["compiler"] = __VERSION__;
  info["cplusplus"] = static_cast<long>(__cplusplus);
#ifdef NDEBUG
  info["optimized"] = true;
#else
  info["optimized"] = false;
#endif
  return info;
}

}  // namespace libra

PYBIND11_MODULE(_native, m) {
  m.doc() = "Libra's native cores: C-MLFQ routing and weight resharding.";
  m.def("build_info", &libra::build_info, "Compiler and build flags of this extension.");
  libra::bind_cmlfq(m);
  libra::bind_reshard(m);
}
