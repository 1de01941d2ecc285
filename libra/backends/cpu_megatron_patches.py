"""Patches that let megatron-core (0.16.1, local layer spec) train on the CPU.

Megatron-core assumes CUDA in a handful of places that a CPU-only torch cannot satisfy. Applied by
`CpuBackend.prepare_worker` only, in a worker process, before any Megatron model is built; other
backends never import this file. `apply()` is idempotent.

What is patched and why (line numbers from megatron-core 0.16.1; PLATFORM.md and
reference/megatron-cpu.md have the full inventory):

1. `torch.cuda.current_device` returns the CPU device. Megatron allocates buffers with
   `device=torch.cuda.current_device()`: the attention workspace in `utils.GlobalMemoryBuffer`
   (every forward), weights when `use_cpu_initialization=False` (tensor_parallel/layers.py), the
   Megatron DDP grad buffers and the pipeline p2p receive buffers.
2. The model-parallel RNG tracker runs over the CPU generator. `model_parallel_cuda_manual_seed`
   seeds named CUDA RNG states, `get_cuda_rng_tracker().fork()` swaps them in around weight init
   and attention dropout, and activation recompute saves and restores them. The module gets a
   tracker class whose states are CPU generator states, CPU versions of its two private state
   accessors, and `torch.cuda.manual_seed` seeds the CPU generator (on a CPU worker the CPU
   generator *is* the device generator). Model-parallel dropout stays decorrelated across TP
   ranks, unlike Megatron's `inference_rng_tracker=True` shortcut.
3. Hard-coded `device="cuda"`: the causal mask that `FusedScaleMaskSoftmax` builds when no
   `attention_mask` is passed (transformer/utils.py:35,40), and the small tensors that Megatron's
   optimizer, grad scaler, grad clipping, schedules and multi-tensor fallbacks create with a
   literal `device="cuda"` (optimizer.py:473-485,907; clip_grads.py:90-207; grad_scaler.py;
   schedules.py:596,983,2138; utils.py:1207). Those modules see a `torch` whose tensor factories
   put a "cuda" tensor on the CPU (a module-level proxy: no per-op cost). The optimizers' checks
   that parameters are `torch.cuda.*Tensor` (optimizer.py:671,690; distrib_optimizer.py:361,420,
   582; clip_grads.py:167) run under a thread-local `TorchFunctionMode` that reports CPU tensors
   with their CUDA type names, only inside the optimizer constructors and the clipping function.
4. `torch.cuda.synchronize` is a no-op (pipeline p2p with `batch_p2p_sync`, timers): there is
   nothing to wait for on the CPU.
5. Tied embeddings with PP > 1: `LanguageModule.setup_embeddings_and_output_layer`
   (models/common/language_module/language_module.py:244) moves the last stage's copy of the
   word embeddings with `weight.data.cuda()` before all-reducing it with the first stage. While
   that method runs, and only in the thread running it, `Tensor.cuda()` returns the CPU tensor
   itself (a `TorchFunctionMode`, which is thread-local and costs nothing outside model
   construction). Swapping `torch.Tensor.cuda` process-wide would also hit other threads.

This is what lets training run on the CPU through Megatron's own `DistributedDataParallel`,
`get_megatron_optimizer` and `get_forward_backward_func`, the path the accelerators run.

Patches 2, 3 and 5 change Megatron modules. Importing megatron.core costs ~4 s, which a rollout
worker that never trains should not pay, so modules not yet imported are patched by an import hook
right after they execute; that also means every later `from ... import name` sees the patched
names (fused_softmax imports the mask builders by name).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch

_CPU = torch.device("cpu")
_PATCHED_ATTR = "_libra_cpu_patch"


def apply() -> None:
    """Applies the patches (idempotent): torch.cuda now, Megatron modules now if imported,
    else when they are imported."""
    _patch_torch_cuda()
    for module_name, patch in _MODULE_PATCHES.items():
        module = sys.modules.get(module_name)
        if module is not None:
            patch(module)
    if not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())


def _mark(obj: Any) -> Any:
    setattr(obj, _PATCHED_ATTR, True)
    return obj


def _is_marked(obj: object) -> bool:
    return getattr(obj, _PATCHED_ATTR, False)


# -- patches 1 and 4 (and part of 2): torch.cuda entry points -----------------------------------


def _current_device() -> torch.device:
    return _CPU


def _synchronize(device: Any = None) -> None:
    return None


def _manual_seed(seed: int) -> None:
    # `model_parallel_cuda_manual_seed` seeds the default (data-parallel) state with this; without
    # a CUDA build the original is queued for a CUDA init that never comes.
    torch.manual_seed(seed)


def _patch_torch_cuda() -> None:
    for name, replacement in (
        ("current_device", _current_device),
        ("synchronize", _synchronize),
        ("manual_seed", _manual_seed),
    ):
        if not _is_marked(getattr(torch.cuda, name)):
            setattr(torch.cuda, name, _mark(replacement))


# -- patch 2: the model-parallel RNG tracker over the CPU generator -----------------------------


def _get_cpu_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _patch_rng_module(mp_random: ModuleType) -> None:
    """Patches `megatron.core.tensor_parallel.random`."""
    if _is_marked(mp_random.CudaRNGStatesTracker):
        return
    default_name = mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):  # type: ignore[misc, name-defined]
        """Megatron's tracker with CPU generator states. Subclassing keeps the `isinstance` checks
        (`get_all_rng_states`, cuda_graphs) and the bookkeeping of the original."""

        def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
            if use_cudagraphable_rng:
                raise ValueError("use_cudagraphable_rng needs CUDA graphs, which the CPU does not have")
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            outer_state = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)

        @contextlib.contextmanager
        def fork(self, name: str = default_name) -> Iterator[None]:
            # The CUDA tracker's protocol minus its "CPU RNG state changed" warning: the forked
            # generator is the CPU generator here, so it changes by design.
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            outer_state = torch.get_rng_state()
            outer_name = self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise RuntimeError(f"current rng state {self._current_state_name} is not {name}")
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    # `initialize_rng_tracker` looks the class up in the module at call time.
    mp_random.CudaRNGStatesTracker = _mark(CpuRNGStatesTracker)
    # Used outside the tracker: activation recompute (`CheckpointFunction`) and `_fork_rng`.
    mp_random._get_cuda_rng_state = _get_cpu_rng_state
    mp_random._set_cuda_rng_state = _set_cpu_rng_state
    # A tracker built before the patch would hold CUDA states: rebuild it with our class.
    if mp_random._CUDA_RNG_STATE_TRACKER is not None:
        mp_random.initialize_rng_tracker(force_reset=True)


# -- patch 3: causal masks built with device="cuda" ---------------------------------------------


def _default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, device=_CPU), diagonal=1).bool()


def _sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    ones = torch.ones(sq, skv, dtype=torch.bool, device=_CPU)
    upper = torch.triu(ones, diagonal=skv - sq - window_size[0])
    return ~torch.tril(upper, diagonal=skv - sq + window_size[1])


def _patch_mask_module(transformer_utils: ModuleType) -> None:
    """Patches `megatron.core.transformer.utils`, and fused_softmax's by-name copies when it was
    imported before us."""
    for module in (transformer_utils, sys.modules.get("megatron.core.fusions.fused_softmax")):
        if module is None or _is_marked(module.get_default_causal_mask):
            continue
        module.get_default_causal_mask = _mark(_default_causal_mask)
        module.get_sliding_window_causal_mask = _sliding_window_causal_mask


# -- patch 5: `.cuda()` while tying the embeddings of the first and last pipeline stages --------


class _CudaCallKeepsCpuTensor(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


def _patch_language_module(language_module: ModuleType) -> None:
    """Patches `megatron.core.models.common.language_module.language_module`."""
    cls = language_module.LanguageModule
    original = cls.setup_embeddings_and_output_layer
    if _is_marked(original):
        return

    def setup_embeddings_and_output_layer(self, *args: Any, **kwargs: Any) -> None:
        with _CudaCallKeepsCpuTensor():
            return original(self, *args, **kwargs)

    cls.setup_embeddings_and_output_layer = _mark(setup_embeddings_and_output_layer)


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _factory_on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    return make


class _TorchWithCpuFactories(ModuleType):
    """`torch` as a Megatron module with literal `device="cuda"` tensors sees it: the tensor
    factories of `_FACTORIES` put those on the CPU; every other name is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _factory_on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_TORCH_WITH_CPU_FACTORIES = _TorchWithCpuFactories()


def _patch_cuda_factories(module: ModuleType) -> None:
    if module.__dict__.get("torch") is torch:
        module.torch = _TORCH_WITH_CPU_FACTORIES


class _CudaTypeNames(torch.overrides.TorchFunctionMode):
    """`tensor.type()` answers `torch.cuda.FloatTensor` for a CPU float tensor, and so on."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            return result.replace("torch.", "torch.cuda.", 1) if ".cuda." not in result else result
        return result


def _with_cuda_type_names(function: Callable[..., Any]) -> Callable[..., Any]:
    if _is_marked(function):
        return function

    def call(*args: Any, **kwargs: Any) -> Any:
        with _CudaTypeNames():
            return function(*args, **kwargs)

    call.__name__, call.__doc__ = function.__name__, function.__doc__
    return _mark(call)


def _patch_optimizer_module(optimizer: ModuleType) -> None:
    """`megatron.core.optimizer.optimizer`: the mixed-precision optimizer checks its params' types."""
    _patch_cuda_factories(optimizer)
    cls = optimizer.Float16OptimizerWithFloat16Params
    cls.__init__ = _with_cuda_type_names(cls.__init__)
    # Imported by name: patched already unless apply() ran after megatron was imported.
    optimizer.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(optimizer.clip_grad_by_total_norm_fp32)


def _patch_distrib_optimizer_module(distrib_optimizer: ModuleType) -> None:
    _patch_cuda_factories(distrib_optimizer)
    cls = distrib_optimizer.DistributedOptimizer
    cls.__init__ = _with_cuda_type_names(cls.__init__)


def _patch_clip_grads_module(clip_grads: ModuleType) -> None:
    """`megatron.core.optimizer.clip_grads`; `optimizer.py` imports the clipping function by name
    after this module ran, so it gets the patched one."""
    _patch_cuda_factories(clip_grads)
    clip_grads.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)


_MODULE_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "megatron.core.tensor_parallel.random": _patch_rng_module,
    "megatron.core.transformer.utils": _patch_mask_module,
    "megatron.core.models.common.language_module.language_module": _patch_language_module,
    "megatron.core.utils": _patch_cuda_factories,
    "megatron.core.optimizer.grad_scaler": _patch_cuda_factories,
    "megatron.core.optimizer.clip_grads": _patch_clip_grads_module,
    "megatron.core.optimizer.optimizer": _patch_optimizer_module,
    "megatron.core.optimizer.distrib_optimizer": _patch_distrib_optimizer_module,
    "megatron.core.pipeline_parallel.schedules": _patch_cuda_factories,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the modules of `_MODULE_PATCHES` as the other finders would, and patches each right
    after it has executed. Every other import passes through untouched."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = _MODULE_PATCHES.get(fullname)
        if patch is None:
            return None
        # Ask the finders after us, so that any way megatron is installed (site-packages, an
        # editable checkout with its own finder) is found as it would be without us.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, get_resource_reader ... of the real loader (tracebacks, inspect).
        return getattr(self._loader, name)
