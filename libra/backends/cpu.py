"""The built-in cpu backend: devices are CPU slots, i.e. sets of cores of this process's affinity.

The embedded default and CI run everything on one host with CPU slots as devices. A worker owning
a slot gets one OpenMP thread per core of the slot (more threads than cores stall, see
PLATFORM.md) and, for vLLM, the slot's cores as its thread binding. Slots split the host's RAM
evenly; nothing enforces that split, it only tells the planner what to plan with.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import psutil

from libra.backends.base import Availability, DeviceInfo, EngineDefaults, HardwareProfile
from libra.backends.visible_devices import check_device_indices

if TYPE_CHECKING:
    import torch

VISIBLE_DEVICES_ENV = "LIBRA_VISIBLE_DEVICES"

# Fixed, conservative per-core figures for a generic x86-64 server core, not measured at start-up
# (a micro-benchmark would cost seconds per worker and vary with whatever else runs; the planner's
# calibration replaces them with measured step times). Compute: PLATFORM.md measured ~89 GFLOP/s
# fp32 for one thread on a 1024x1024 matmul, ~44 per core with two busy processes; bf16 is taken
# as no faster (no AMX assumed). The rest are assumptions: one core streams ~10 GB/s from DRAM,
# gloo between slots goes through loopback TCP (~2 GB/s), and hosts have a 10 GbE NIC.
_FLOPS_PER_CORE = 40e9
_MEMORY_BANDWIDTH_PER_CORE = 10e9
_GLOO_LOOPBACK_BANDWIDTH = 2e9
_NIC_BANDWIDTH = 10e9 / 8


class CpuBackend:
    """CPU slots as devices.

    Slot `i` owns `cores_per_device` cores of `os.sched_getaffinity(0)`, taken in order; slots are
    disjoint when `num_devices * cores_per_device` does not exceed the cores available, and wrap
    around (share cores) otherwise, which lets a 2-core machine run e.g. 4 single-core ranks.
    """

    name = "cpu"
    visible_devices_env = VISIBLE_DEVICES_ENV
    distributed_backend = "gloo"
    # No compile (30-60 s of start-up for ~5 %); 1 GiB of KV (without a size vLLM reserves 92 %
    # of RAM).
    engine_defaults = EngineDefaults(
        enforce_eager=True, kv_cache_gib=1, gpu_memory_utilization=None, chunked_prefill=False
    )

    def __init__(self, num_devices: int | None = None, cores_per_device: int | None = None):
        """`num_devices`: number of slots (default: one per available core).
        `cores_per_device`: cores per slot (default: the available cores divided evenly, >= 1)."""
        cores = sorted(os.sched_getaffinity(0))
        if num_devices is None:
            num_devices = max(1, len(cores))
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        if cores_per_device is None:
            cores_per_device = max(1, len(cores) // num_devices)
        if cores_per_device < 1:
            raise ValueError(f"cores_per_device must be >= 1, got {cores_per_device}")
        if cores_per_device > len(cores):
            raise ValueError(
                f"cores_per_device={cores_per_device} but this process may use only {len(cores)} "
                f"cores ({_format_cores(cores)})"
            )
        self.num_devices = num_devices
        self.cores_per_device = cores_per_device
        self._slot_cores = [
            tuple(cores[(slot * cores_per_device + k) % len(cores)] for k in range(cores_per_device))
            for slot in range(num_devices)
        ]
        self._memory_per_slot = psutil.virtual_memory().total // num_devices

    def availability(self) -> Availability:
        return Availability(available=True)

    def devices(self) -> list[DeviceInfo]:
        return [
            DeviceInfo(index=slot, kind="cpu-slot", memory_bytes=self._memory_per_slot, cores=cores)
            for slot, cores in enumerate(self._slot_cores)
        ]

    def worker_env(self, device_indices: list[int]) -> dict[str, str]:
        """`LIBRA_VISIBLE_DEVICES` lists the slots; `OMP_NUM_THREADS` is one slot's core count
        (one rank per slot); `VLLM_CPU_OMP_THREADS_BIND` has one core list per slot, `|`-separated,
        which is vLLM's format for one engine process per slot (its TP ranks)."""
        check_device_indices(device_indices, self.num_devices)
        slots = [self._slot_cores[i] for i in device_indices]
        return {
            VISIBLE_DEVICES_ENV: ",".join(str(i) for i in device_indices),
            "OMP_NUM_THREADS": str(self.cores_per_device),
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(str(c) for c in cores) for cores in slots),
        }

    def torch_device(self, local_index: int) -> torch.device:
        import torch

        if local_index < 0:
            raise ValueError(f"local_index must be >= 0, got {local_index}")
        return torch.device("cpu")

    def hardware_profile(self) -> HardwareProfile:
        """Fixed conservative figures per slot (see the constants above), scaled by its cores."""
        return HardwareProfile(
            name=f"cpu-slot ({self.cores_per_device} cores)",
            peak_bf16_flops=_FLOPS_PER_CORE * self.cores_per_device,
            memory_bandwidth_bytes_per_s=_MEMORY_BANDWIDTH_PER_CORE * self.cores_per_device,
            memory_capacity_bytes=self._memory_per_slot,
            intra_node_bandwidth_bytes_per_s=_GLOO_LOOPBACK_BANDWIDTH,
            inter_node_bandwidth_bytes_per_s=_NIC_BANDWIDTH,
            devices_per_node=self.num_devices,
        )

    def prepare_worker(self) -> None:
        """Applies the Megatron-core CPU patches (`cpu_megatron_patches`); they are process-global,
        so this belongs in worker processes only."""
        from libra.backends import cpu_megatron_patches

        cpu_megatron_patches.apply()


def _format_cores(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)
