"""The vLLM worker extension that loads published weights into a running engine.

Start the engine with `worker_extension_cls=WORKER_EXTENSION` and every worker (one per TP rank)
gains the `libra_*` methods below, called through `collective_rpc` (see `instance_update` for the
driver). A load is two-phase so that no TP rank ever runs a version its peers do not have:

  1. `libra_stage(request)`: each rank fetches its own rank's buffer through the transport named
     in its handle and verifies it against the manifest (size, every bucket's checksum) and the
     model (every param name and shape). Nothing in the model changes.
  2. `libra_commit(version)`, only when every rank staged: each rank copies the staged buffer into
     its live parameters. The buffer is in the transfer plan's order, which is exactly vLLM's
     per-rank layout (fused qkv_proj / gate_up_proj, vocab-parallel rows), so each param is one
     contiguous slice: no intermediate full tensors, no name mapping at load time.
     If a copy fails midway the rank restores its previous version and reports the failure; the
     driver then calls `libra_rollback` on all ranks.

On the CPU, vLLM repacks linear weights for oneDNN after loading and leaves an empty `weight`
parameter (`dispatch_cpu_unquantized_gemm`); the packed handle owns its own copy. For such a layer
the commit puts the staged slice back as its weight and re-runs the layer's
`process_weights_after_loading`, which packs it again; vocab embeddings keep their weight but also
hold a packed copy for the LM head, so they are re-packed too. On GPUs the same code is a plain
`copy_` per param.

The committed staged buffer is kept as the restore source (for the shm transport it is a private
mapping of the publisher's file, so keeping it costs no copy). Before the first publication the
restore source is the checkpoint on disk (`reload_weights()`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from libra.sync.transport import BufferManifest, TransferError, WeightReceiver, verify_staged

WORKER_EXTENSION = "libra.sync.vllm_loader.LibraWeightLoader"


def make_receiver(handle: Mapping[str, Any]) -> WeightReceiver:
    """The receiver for a handle's transport kind (imported lazily: each pulls its own deps)."""
    kind = handle.get("kind")
    if kind == "shm":
        from libra.sync.shm import ShmReceiver

        return ShmReceiver()
    if kind == "grpc":
        from libra.sync.grpc_stream import GrpcReceiver

        return GrpcReceiver()
    if kind == "collective":
        from libra.sync.collective import CollectiveReceiver

        return CollectiveReceiver.for_handle(handle)
    raise TransferError(f"unknown weight transport kind {kind!r} in handle {dict(handle)}")


@dataclass
class _Target:
    name: str
    module: torch.nn.Module
    attr: str
    offset: int
    shape: tuple[int, ...]
    repack: bool
    """The layer's weight was consumed by a CPU GEMM packing: reinstall it, then re-pack."""


def _is_cpu_packed(module: torch.nn.Module) -> bool:
    return hasattr(module, "cpu_linear") and hasattr(module, "quant_method")


def resolve_targets(model: torch.nn.Module, manifest: BufferManifest) -> list[_Target]:
    """Every manifest param matched to the live model, checked before anything is written."""
    targets = []
    for entry in manifest.params:
        module_name, _, attr = entry.name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise TransferError(f"{manifest.key}: param {entry.name!r} has no module in the model") from None
        param = getattr(module, attr, None)
        if not isinstance(param, torch.Tensor):
            raise TransferError(f"{manifest.key}: param {entry.name!r} is not in the model")
        if tuple(param.shape) == entry.shape:
            repack = False
        elif param.numel() == 0 and attr == "weight" and _is_cpu_packed(module):
            repack = True
        else:
            raise TransferError(
                f"{manifest.key}: param {entry.name!r} is {tuple(param.shape)} in the model, "
                f"{entry.shape} in the published layout"
            )
        targets.append(_Target(entry.name, module, attr, entry.offset, entry.shape, repack))
    end = max((t.offset + int(torch.Size(t.shape).numel()) for t in targets), default=0)
    if end * manifest.torch_dtype.itemsize > manifest.num_bytes:
        raise TransferError(f"{manifest.key}: params end at element {end}, past the buffer")
    return targets


def write_params(
    model: torch.nn.Module,
    targets: list[_Target],
    staged: torch.Tensor,
    dtype: torch.dtype,
    fail_after: int = -1,
) -> None:
    """Copies each target's slice of the staged buffer into the live model, then re-packs every
    CPU GEMM layer whose weight it wrote, including layers that only share a written weight (a
    tied LM head packs the embedding's weight for itself). `fail_after` >= 0 raises after that
    many params (fault injection)."""
    flat = staged.view(dtype)
    repack: dict[int, torch.nn.Module] = {}
    written: set[int] = set()
    with torch.no_grad():
        for i, target in enumerate(targets):
            if i == fail_after:
                raise RuntimeError(f"injected failure after {i} params")
            source = flat[target.offset : target.offset + torch.Size(target.shape).numel()].view(target.shape)
            if target.repack:
                # Packing copies it (the oneDNN / sgl handle owns its memory); the slice is not kept.
                setattr(target.module, target.attr, torch.nn.Parameter(source, requires_grad=False))
                repack[id(target.module)] = target.module
            else:
                param = getattr(target.module, target.attr)
                param.copy_(source)
                written.add(param.data_ptr())
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if _is_cpu_packed(module) and isinstance(weight, torch.Tensor) and weight.data_ptr() in written:
                repack[id(module)] = module
        for module in repack.values():
            module.quant_method.process_weights_after_loading(module)


def read_param(model: torch.nn.Module, name: str) -> torch.Tensor:
    """A param as the engine computes with it. CPU-packed linear weights are read back through the
    layer's own GEMM with an identity input: each output is one weight times 1 plus zeros, exact
    in fp32 and bf16."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    param = getattr(module, attr)
    if param.numel() == 0 and attr == "weight" and _is_cpu_packed(module):
        cols = module.input_size_per_partition
        dtype = param.dtype
        return module.cpu_linear(torch.eye(cols, dtype=dtype), None, None).t().contiguous()
    return param.detach().clone()


@dataclass
class _Version:
    version: int
    manifest: BufferManifest | None
    staged: torch.Tensor | None
    """The bytes of this version (None: the checkpoint the engine started from)."""


class LibraWeightLoader:
    """Mixed into vLLM's worker class (`worker_extension_cls`); `self` is the worker."""

    def _libra(self) -> dict[str, Any]:
        if not hasattr(self, "_libra_state"):
            self._libra_state = {"current": _Version(0, None, None), "previous": None, "pending": None}
        return self._libra_state

    def _libra_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def libra_join_collective(self, host: str, port: int, first_group_rank: int, world_size: int) -> int:
        """Joins the publisher's collective group as rank `first_group_rank` + this worker's TP rank
        (once per engine, before collective transfers); returns the group rank."""
        from libra.sync.collective import CollectiveReceiver

        group_rank = first_group_rank + self._libra_rank()
        CollectiveReceiver.join(host, port, group_rank, world_size)
        return group_rank

    def libra_leave_collective(self) -> None:
        from libra.sync.collective import CollectiveReceiver

        CollectiveReceiver.leave()

    def libra_weight_version(self) -> int:
        return self._libra()["current"].version

    def libra_stage(self, request: dict[str, Any]) -> dict[str, Any]:
        """Phase 1: fetch and verify this rank's buffer of `request["version"]`. Returns
        {"ok", "rank", "seconds", "error"}; never raises, so the driver sees every rank."""
        start = time.perf_counter()
        state, rank = self._libra(), self._libra_rank()
        state["pending"] = None
        try:
            version = int(request["version"])
            if version <= state["current"].version:
                raise TransferError(
                    f"version {version} is not newer than the loaded {state['current'].version}"
                )
            ranks = request["ranks"]
            if len(ranks) != self.parallel_config.tensor_parallel_size:
                raise TransferError(
                    f"request has {len(ranks)} ranks, engine TP={self.parallel_config.tensor_parallel_size}"
                )
            manifest = BufferManifest.from_dict(ranks[rank]["manifest"])
            if manifest.version != version:
                raise TransferError(f"manifest is of version {manifest.version}, request of {version}")
            targets = resolve_targets(self.model_runner.get_model(), manifest)
            staged = make_receiver(ranks[rank]["handle"]).fetch(manifest, ranks[rank]["handle"])
            verify_staged(staged, manifest)
        except Exception as error:  # noqa: BLE001 - reported to the driver, the model is untouched
            return {
                "ok": False,
                "rank": rank,
                "seconds": time.perf_counter() - start,
                "error": f"{type(error).__name__}: {error}",
            }
        state["pending"] = (_Version(version, manifest, staged), targets)
        return {"ok": True, "rank": rank, "seconds": time.perf_counter() - start, "error": ""}

    def libra_commit(self, version: int, fail_after: int = -1) -> dict[str, Any]:
        """Phase 2: copy the staged buffer into the live params. On failure this rank restores its
        previous version before answering ok=False."""
        start = time.perf_counter()
        state, rank = self._libra(), self._libra_rank()
        pending = state["pending"]
        if pending is None or pending[0].version != version:
            return {"ok": False, "rank": rank, "seconds": 0.0, "error": f"version {version} is not staged"}
        staged_version, targets = pending
        state["pending"] = None
        try:
            write_params(
                self.model_runner.get_model(),
                targets,
                staged_version.staged,
                staged_version.manifest.torch_dtype,
                fail_after,
            )
        except Exception as error:  # noqa: BLE001
            self._libra_restore(state["current"])
            return {
                "ok": False,
                "rank": rank,
                "seconds": time.perf_counter() - start,
                "error": f"{type(error).__name__}: {error}",
            }
        state["previous"], state["current"] = state["current"], staged_version
        return {"ok": True, "rank": rank, "seconds": time.perf_counter() - start, "error": ""}

    def libra_rollback(self, version: int) -> int:
        """Undo a commit of `version` on this rank (a peer rank failed); returns the version now loaded."""
        state = self._libra()
        if state["current"].version == version and state["previous"] is not None:
            self._libra_restore(state["previous"])
            state["current"], state["previous"] = state["previous"], None
        state["pending"] = None
        return state["current"].version

    def _libra_restore(self, target: _Version) -> None:
        model = self.model_runner.get_model()
        if target.staged is None:
            self.model_runner.reload_weights()  # the checkpoint the engine started from
            return
        write_params(
            model, resolve_targets(model, target.manifest), target.staged, target.manifest.torch_dtype
        )

    def libra_reload_hf(self, blob: bytes) -> float:
        """The naive path, kept as the baseline: full HF tensors (safetensors bytes) through vLLM's
        own `reload_weights` (name mapping, TP slicing, re-processing). Returns its seconds; does
        not change the reported version."""
        from safetensors.torch import load

        start = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(load(blob).items()))
        return time.perf_counter() - start

    def libra_read_params(self, names: list[str] | None = None) -> bytes:
        """This rank's params as the engine computes with them, as safetensors bytes (verification
        and tests; see `read_param`)."""
        from safetensors.torch import save

        model = self.model_runner.get_model()
        names = names if names is not None else [n for n, _ in model.named_parameters()]
        params = {name: read_param(model, name) for name in names}
        # Layers that keep their weight but compute with a packed copy (embeddings used as LM
        # heads, tied or not): the copy as the GEMM sees it, under "<module>.weight@packed".
        for module_name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if _is_cpu_packed(module) and isinstance(weight, torch.Tensor) and weight.numel() > 0:
                probe = torch.eye(weight.shape[1], dtype=weight.dtype)
                params[f"{module_name}.weight@packed"] = module.cpu_linear(probe, None, None).t().contiguous()
        return save(params)
