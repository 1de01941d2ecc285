"""NVIDIA GPUs through torch.cuda: one device per GPU (or `slots_per_device` per GPU), NCCL collectives.

Importable without torch: torch is imported inside methods, and `availability()` says what is
missing. Device indices are positions in this process's view of the GPUs (torch's numbering);
`worker_env` maps them through an inherited `CUDA_VISIBLE_DEVICES` (see
`libra.backends.visible_devices.restrict_visible_devices`).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING

from libra.backends.base import Availability, DeviceInfo, EngineDefaults, HardwareProfile
from libra.backends.profiles import require_profile_for
from libra.backends.visible_devices import DeviceSlots, local_rank_device

if TYPE_CHECKING:
    import torch

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


class CudaBackend(DeviceSlots):
    name = "cuda"
    visible_devices_env = VISIBLE_DEVICES_ENV
    distributed_backend = "nccl"
    # CUDA graphs for the small-batch decode of the long tail; vLLM's own memory share.
    engine_defaults = EngineDefaults(
        enforce_eager=False, kv_cache_gib=None, gpu_memory_utilization=0.9, chunked_prefill=True
    )

    def availability(self) -> Availability:
        try:
            import torch
        except ImportError:
            return Availability(False, "torch is not installed")
        if torch.version.cuda is None:
            return Availability(False, f"torch was built without CUDA (torch {torch.__version__})")
        if torch.cuda.device_count() == 0:
            restriction = os.environ.get(VISIBLE_DEVICES_ENV)
            detail = f" ({VISIBLE_DEVICES_ENV}={restriction!r})" if restriction is not None else ""
            return Availability(False, f"no CUDA device visible{detail}")
        return Availability(True)

    def devices(self) -> list[DeviceInfo]:
        torch = self._require_torch_cuda()
        properties = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        return self.slot_inventory([(p.name, p.total_memory) for p in properties])

    def worker_env(self, device_indices: list[int]) -> dict[str, str]:
        """Only `CUDA_VISIBLE_DEVICES`. Needs no GPU here: the control plane may compute it anywhere."""
        return self.slots_env(VISIBLE_DEVICES_ENV, device_indices)

    def torch_device(self, local_index: int) -> torch.device:
        import torch

        if local_index < 0:
            raise ValueError(f"local_index must be >= 0, got {local_index}")
        return torch.device("cuda", local_index)

    def hardware_profile(self) -> HardwareProfile:
        """The datasheet profile of GPU 0 (hosts are homogeneous). Raises RuntimeError for a GPU
        without a profile rather than guessing figures the planner would trust."""
        return self.slot_profile(require_profile_for(self.devices()[0].kind))

    def prepare_worker(self) -> None:
        """Makes GPU `LOCAL_RANK` (torchrun's variable) the current device when it is set;
        otherwise the worker keeps torch's default, its first visible GPU."""
        torch = self._require_torch_cuda()
        index = local_rank_device(torch.cuda.device_count(), VISIBLE_DEVICES_ENV, "GPU")
        if index is not None:
            torch.cuda.set_device(index)

    def _require_torch_cuda(self) -> ModuleType:
        availability = self.availability()
        if not availability.available:
            raise RuntimeError(f"cuda backend unavailable: {availability.reason}")
        import torch

        return torch
