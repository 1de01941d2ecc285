"""Helpers for backends whose devices a process sees through a visible-devices variable
(`CUDA_VISIBLE_DEVICES`, `ASCEND_RT_VISIBLE_DEVICES`, the cpu backend's `LIBRA_VISIBLE_DEVICES`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from libra.backends.base import DeviceInfo, HardwareProfile


def check_device_indices(device_indices: list[int], num_devices: int | None = None) -> None:
    """Raises ValueError unless the indices are non-empty, distinct, >= 0 and, when `num_devices`
    is given, below it."""
    if not device_indices:
        raise ValueError("device_indices must not be empty")
    if len(set(device_indices)) != len(device_indices):
        raise ValueError(f"device_indices has duplicates: {device_indices}")
    negative = [i for i in device_indices if i < 0]
    if negative:
        raise ValueError(f"device_indices must be >= 0, got {negative}")
    if num_devices is not None:
        out_of_range = [i for i in device_indices if i >= num_devices]
        if out_of_range:
            raise ValueError(
                f"device_indices {out_of_range} out of range: this host has devices 0..{num_devices - 1}"
            )


def restrict_visible_devices(
    variable: str, device_indices: list[int], environ: Mapping[str, str] | None = None
) -> str:
    """The value of `variable` for a child process that should see exactly `device_indices` of the
    devices this process sees, in that order.

    Device indices are positions in this process's view, the numbering torch uses here. When this
    process is itself restricted (`variable` set, e.g. by Slurm or a container runtime), position
    `i` is the i-th entry of that list, which may be an id, a UUID or a MIG id, and the child gets
    those entries; the driver reads the child's variable against the whole host, not the parent's
    view. Unrestricted, positions are the host's device ids.
    """
    environ = os.environ if environ is None else environ
    check_device_indices(device_indices)
    inherited = environ.get(variable)
    if inherited is None:
        return ",".join(str(i) for i in device_indices)
    entries = [entry.strip() for entry in inherited.split(",") if entry.strip()]
    out_of_range = [i for i in device_indices if i >= len(entries)]
    if out_of_range:
        raise ValueError(
            f"device_indices {out_of_range} out of range: this process sees {len(entries)} devices "
            f"({variable}={inherited!r})"
        )
    return ",".join(entries[i] for i in device_indices)


class DeviceSlots:
    """For accelerator backends: each device listed as `slots_per_device` devices (slot `s` of
    device `d` is `d * slots_per_device + s`), each with its share of the memory, so that several
    workers can share one device (a train rank beside a rollout instance on a single GPU, each
    given its memory share in its own config)."""

    def __init__(self, slots_per_device: int = 1):
        if slots_per_device < 1:
            raise ValueError(f"slots_per_device must be >= 1, got {slots_per_device}")
        self.slots_per_device = slots_per_device

    def slot_inventory(self, devices: list[tuple[str, int]]) -> list[DeviceInfo]:
        """The slots of `devices` ((kind, memory bytes) per device, in index order)."""
        n = self.slots_per_device
        return [
            DeviceInfo(index=d * n + s, kind=kind, memory_bytes=memory // n)
            for d, (kind, memory) in enumerate(devices)
            for s in range(n)
        ]

    def slot_profile(self, profile: HardwareProfile) -> HardwareProfile:
        """`profile` for one slot: the planner plans each slot as a device with its share of the
        memory, compute and memory bandwidth (the links are the device's)."""
        n = self.slots_per_device
        if n == 1:
            return profile
        return dataclasses.replace(
            profile,
            name=f"{profile.name} (1/{n})",
            peak_bf16_flops=profile.peak_bf16_flops / n,
            memory_bandwidth_bytes_per_s=profile.memory_bandwidth_bytes_per_s / n,
            memory_capacity_bytes=profile.memory_capacity_bytes // n,
        )

    def slots_env(self, variable: str, slot_indices: list[int]) -> dict[str, str]:
        """`variable` for a worker owning `slot_indices`: the devices they are on."""
        devices = devices_of_slots(slot_indices, self.slots_per_device)
        return {variable: restrict_visible_devices(variable, devices)}


def devices_of_slots(slot_indices: list[int], slots_per_device: int) -> list[int]:
    """The devices (positions in this process's view) a worker owning `slot_indices` uses, where
    device `d` is split into slots `d * slots_per_device ...` (several workers on one device, each
    with its share of memory: a train rank beside a rollout instance on a single GPU). Raises
    ValueError when two of the slots are on one device: every rank of a multi-device worker needs
    a device of its own."""
    check_device_indices(slot_indices)
    devices = [i // slots_per_device for i in slot_indices]
    if len(set(devices)) != len(devices):
        raise ValueError(
            f"slots {slot_indices} share a device ({slots_per_device} slots per device): a worker "
            "of several ranks needs a device per rank"
        )
    return devices


def local_rank_device(num_visible: int, variable: str, kind: str) -> int | None:
    """The device index torchrun's `LOCAL_RANK` selects among the `num_visible` devices this
    process sees, or None when it is not set. Raises RuntimeError when it is out of range."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        return None
    if not 0 <= int(local_rank) < num_visible:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this process sees {num_visible} {kind}(s) "
            f"({variable}={os.environ.get(variable)!r})"
        )
    return int(local_rank)
