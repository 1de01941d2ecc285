"""Huawei Ascend NPUs through torch_npu: one device per NPU (or `slots_per_device` per NPU), HCCL
collectives.

Importable without torch or torch_npu: both are imported inside methods (importing torch_npu
registers the `npu` device type and `torch.npu`), and `availability()` says what is missing. Device
indices are positions in this process's view of the NPUs; `worker_env` maps them through an
inherited `ASCEND_RT_VISIBLE_DEVICES` (see `libra.backends.visible_devices`).
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

VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"


class AscendBackend(DeviceSlots):
    name = "ascend"
    visible_devices_env = VISIBLE_DEVICES_ENV
    distributed_backend = "hccl"
    # ACL graphs (vllm-ascend's graph mode) for the small-batch decode of the long tail; vLLM's own
    # memory share.
    engine_defaults = EngineDefaults(
        enforce_eager=False, kv_cache_gib=None, gpu_memory_utilization=0.9, chunked_prefill=True
    )

    def availability(self) -> Availability:
        try:
            import torch
        except ImportError:
            return Availability(False, "torch is not installed")
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ModuleNotFoundError as exc:
            if exc.name == "torch_npu":
                return Availability(False, "torch_npu is not installed")
            return Availability(False, f"torch_npu failed to import: {exc}")
        except Exception as exc:  # noqa: BLE001  (e.g. CANN libraries missing): report, never raise
            return Availability(False, f"torch_npu failed to import: {exc}")
        if torch.npu.device_count() == 0:
            restriction = os.environ.get(VISIBLE_DEVICES_ENV)
            detail = f" ({VISIBLE_DEVICES_ENV}={restriction!r})" if restriction is not None else ""
            return Availability(False, f"no Ascend NPU visible{detail}")
        return Availability(True)

    def devices(self) -> list[DeviceInfo]:
        torch = self._require_torch_npu()
        properties = [torch.npu.get_device_properties(i) for i in range(torch.npu.device_count())]
        return self.slot_inventory([(p.name, p.total_memory) for p in properties])

    def worker_env(self, device_indices: list[int]) -> dict[str, str]:
        """Only `ASCEND_RT_VISIBLE_DEVICES`. Needs no NPU here: the control plane may compute it
        anywhere."""
        return self.slots_env(VISIBLE_DEVICES_ENV, device_indices)

    def torch_device(self, local_index: int) -> torch.device:
        if local_index < 0:
            raise ValueError(f"local_index must be >= 0, got {local_index}")
        # torch.device("npu") only parses once torch_npu has registered the device type.
        torch = self._require_torch_npu()
        return torch.device("npu", local_index)

    def hardware_profile(self) -> HardwareProfile:
        """The profile of NPU 0 (hosts are homogeneous). Raises RuntimeError for an NPU without a
        profile rather than guessing figures the planner would trust."""
        return self.slot_profile(require_profile_for(self.devices()[0].kind))

    def prepare_worker(self) -> None:
        """Makes NPU `LOCAL_RANK` (torchrun's variable) the current device when it is set;
        otherwise the worker keeps torch_npu's default, its first visible NPU."""
        torch = self._require_torch_npu()
        index = local_rank_device(torch.npu.device_count(), VISIBLE_DEVICES_ENV, "NPU")
        if index is not None:
            torch.npu.set_device(index)

    def _require_torch_npu(self) -> ModuleType:
        availability = self.availability()
        if not availability.available:
            raise RuntimeError(f"ascend backend unavailable: {availability.reason}")
        import torch

        return torch
