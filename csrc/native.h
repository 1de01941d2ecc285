// Declarations shared by the bindings and the native cores of `libra._native`.
// Each core registers its Python bindings through one bind_* function called from bindings.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace libra {

// Compiler and build facts, so `libra status` and bug reports can say which build is running.
pybind11::dict build_info();

// C-MLFQ: prefix trees, bucket routing and the instance load table (csrc/cmlfq/).
void bind_cmlfq(pybind11::module_& m);

// Resharding: transfer plans between TP layouts and their multi-threaded executor (csrc/reshard/).
void bind_reshard(pybind11::module_& m);

}  // namespace libra
