"""The Backend protocol: everything Libra needs to know about one kind of hardware.

A backend is chosen by name (`cpu`, `cuda`, `ascend`) through `libra.backends.get_backend`. The
control plane asks it for the device inventory of a host and for the environment that makes a
worker process see only its own devices; cost models ask it for a hardware profile; worker
processes call `prepare_worker` before they build an engine (the cpu backend patches Megatron-core
there, and only there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DeviceInfo:
    """One device as the backend sees it on this host."""

    index: int
    """Index within the host, as the visible-devices variable names it."""
    kind: str
    """Product name, e.g. `cpu-slot`, `NVIDIA H200`, `Ascend910B3`."""
    memory_bytes: int
    """Memory available to one worker on this device."""
    cores: tuple[int, ...] = ()
    """CPU cores pinned to this device (cpu backend: the slot's cores)."""


@dataclass(frozen=True)
class HardwareProfile:
    """Per-device performance figures the planner's cost models are parameterised by."""

    name: str
    peak_bf16_flops: float
    """Dense bf16 FLOP/s of one device."""
    memory_bandwidth_bytes_per_s: float
    memory_capacity_bytes: int
    intra_node_bandwidth_bytes_per_s: float
    """Per-device bandwidth to peers in the same node (NVLink, HCCS; memcpy on the CPU), in one
    direction: what a transfer, or a ring all-reduce's step that sends and receives at once, can
    use (vendors quote NVLink as the sum of both directions: half of it)."""
    inter_node_bandwidth_bytes_per_s: float
    """Per-device bandwidth to other nodes (InfiniBand / RoCE NICs), in one direction."""
    devices_per_node: int
    allreduce_latency_s: float = 0.0
    """Latency floor of one small all-reduce inside a node (a decode step's activations): what
    a TP group pays per collective however few bytes it moves. 0: not modelled."""
    engine_step_overhead_s: float = 0.0
    """Host time an inference engine spends per forward pass (scheduling, sampling, input
    preparation, launches): paid once a step at every TP size, it bounds what a larger TP size
    gains on small batches. 0: not modelled (calibration's `overhead_s` can fit it)."""


@dataclass(frozen=True)
class EngineDefaults:
    """How a rollout engine (vLLM) runs on this hardware unless `rollout.instance` says otherwise:
    what is best differs by backend, so the backend owns it."""

    enforce_eager: bool
    """No CUDA/ACL graphs or torch.compile. Graphs pay most in the long tail's small-batch decode;
    on the CPU they cost 30-60 s of start-up for ~5 %."""
    kv_cache_gib: int | None
    """KV-cache space in GiB (`VLLM_CPU_KVCACHE_SPACE`); None where the engine sizes its KV cache
    by `gpu_memory_utilization` instead."""
    gpu_memory_utilization: float | None
    """Share of the device's memory the engine may take (weights, activations, KV cache); None
    where it does not apply (the CPU)."""
    chunked_prefill: bool
    """Prefills split over engine steps (vLLM's default). Off on the CPU: a split prefill samples
    a token that vLLM discards and then rewinds the request's generator, which a seeded request
    (the held-out evaluation's, an agent's OpenAI `seed`) has, and torch's CPU generator cannot
    rewind: the engine died ("CPU Generator does not use offset"). vLLM then warns that the model
    does not officially support whole prefills, and sizes a step to hold the longest prompt; the
    CPU tests and the embedded job run this way."""


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str = ""
    """Why the backend cannot be used here, when it cannot."""


@runtime_checkable
class Backend(Protocol):
    """Contract of a device backend. Implementations must import on any machine: libraries of
    the hardware (torch.cuda, torch_npu) are touched only inside methods, and `availability`
    says why they are missing instead of raising."""

    name: str
    """Registry name: `cpu`, `cuda`, `ascend`."""
    visible_devices_env: str
    """The variable that restricts a process to its devices (e.g. `CUDA_VISIBLE_DEVICES`)."""
    distributed_backend: str
    """torch.distributed backend for collectives: `gloo`, `nccl`, `hccl`."""
    engine_defaults: EngineDefaults
    """The rollout engine's settings on this hardware where the config leaves them unset."""

    def availability(self) -> Availability: ...

    def devices(self) -> list[DeviceInfo]:
        """The devices of this host. Raises RuntimeError (with the availability reason) when
        the backend is unavailable."""
        ...

    def worker_env(self, device_indices: list[int]) -> dict[str, str]:
        """Environment variables for a worker process that owns exactly these devices."""
        ...

    def torch_device(self, local_index: int) -> torch.device:
        """The torch device for the `local_index`-th device visible to the current process."""
        ...

    def hardware_profile(self) -> HardwareProfile:
        """Figures for the devices of this host (cost models, planner)."""
        ...

    def prepare_worker(self) -> None:
        """Called once in a worker process before any engine (vLLM, Megatron) is built."""
        ...
