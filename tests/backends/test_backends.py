"""The backend registry, the cpu backend's inventory and environment, the cuda/ascend plugins on a
machine without their hardware (with torch's device API faked where a code path needs devices),
and the hardware profiles.

The cuda and ascend tests need the plugin packages installed:
`pip install -e backends/cuda -e backends/ascend`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.metadata import EntryPoint
from types import SimpleNamespace

import psutil
import pytest
import torch

from libra.backends import (
    Availability,
    Backend,
    BackendConfig,
    DeviceInfo,
    available_backends,
    get_backend,
    registry,
)
from libra.backends.cpu import CpuBackend
from libra.backends.profiles import A800_SXM4_80GB, ASCEND_910B, H100_SXM_80GB, H200_SXM_141GB, profile_for

NUM_CPUS = 1
GiB = 1 << 30

_PLUGINS_INSTALLED = all(importlib.util.find_spec(p) for p in ("libra_backend_cuda", "libra_backend_ascend"))
needs_plugins = pytest.mark.skipif(
    not _PLUGINS_INSTALLED, reason="pip install -e backends/cuda -e backends/ascend first"
)
_HAS_CUDA = torch.version.cuda is not None and torch.cuda.device_count() > 0
_HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


@pytest.fixture
def fake_host(monkeypatch: pytest.MonkeyPatch):
    """Pins the cpu backend's view of the host: `fake_host(cores, total_memory_bytes)`."""

    def install(cores: set[int], total_memory: int = 16 * GiB) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
        monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=total_memory))

    return install


# -- registry -----------------------------------------------------------------------------------


def test_get_backend_cpu_returns_a_backend() -> None:
    backend = get_backend("cpu")
    assert isinstance(backend, CpuBackend)
    assert isinstance(backend, Backend)
    assert backend.availability() == Availability(available=True)


def test_unknown_backend_names_itself_and_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown backend 'nope'") as error:
        get_backend("nope")
    assert "cpu" in str(error.value)


def test_options_go_to_the_constructor_and_unknown_options_are_named(fake_host) -> None:
    fake_host({0, 1, 2, 3})
    assert len(get_backend("cpu", num_devices=2).devices()) == 2
    with pytest.raises(ValueError, match="num_slots"):
        get_backend("cpu", num_slots=2)


def test_cpu_is_found_without_package_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    assert available_backends() == ["cpu"]
    assert isinstance(get_backend("cpu"), CpuBackend)


def test_plugin_that_fails_to_import_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = EntryPoint(name="broken", value="libra_no_such_module:Backend", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [broken])
    with pytest.raises(RuntimeError, match="backend 'broken'.*failed to import"):
        get_backend("broken")


def test_plugin_that_is_not_a_backend_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    impostor = EntryPoint(name="impostor", value="builtins:object", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [impostor])
    with pytest.raises(TypeError, match="Backend protocol"):
        get_backend("impostor")


@needs_plugins
def test_plugins_are_discovered_through_entry_points() -> None:
    assert {"cpu", "cuda", "ascend"} <= set(available_backends())


@needs_plugins
@pytest.mark.parametrize(
    ("name", "visible_devices_env", "distributed_backend"),
    [
        ("cpu", "LIBRA_VISIBLE_DEVICES", "gloo"),
        ("cuda", "CUDA_VISIBLE_DEVICES", "nccl"),
        ("ascend", "ASCEND_RT_VISIBLE_DEVICES", "hccl"),
    ],
)
def test_backend_contract(name: str, visible_devices_env: str, distributed_backend: str) -> None:
    backend = get_backend(name)
    assert isinstance(backend, Backend)
    assert backend.name == name
    assert backend.visible_devices_env == visible_devices_env
    assert backend.distributed_backend == distributed_backend
    assert isinstance(backend.availability(), Availability)


# -- cpu backend --------------------------------------------------------------------------------


def test_cpu_default_is_one_slot_per_core_of_the_affinity() -> None:
    cores = os.sched_getaffinity(0)
    devices = CpuBackend().devices()
    assert len(devices) == len(cores)
    assert all(d.kind == "cpu-slot" and set(d.cores) <= cores for d in devices)
    assert [d.index for d in devices] == list(range(len(cores)))


def test_cpu_two_slots_get_disjoint_cores_and_half_the_memory(fake_host) -> None:
    fake_host({0, 1, 2, 3}, total_memory=16 * GiB)
    devices = CpuBackend(num_devices=2).devices()
    assert devices == [
        DeviceInfo(index=0, kind="cpu-slot", memory_bytes=8 * GiB, cores=(0, 1)),
        DeviceInfo(index=1, kind="cpu-slot", memory_bytes=8 * GiB, cores=(2, 3)),
    ]


def test_cpu_more_slots_than_cores_share_cores(fake_host) -> None:
    fake_host({4, 5})
    devices = CpuBackend(num_devices=4).devices()
    assert [d.cores for d in devices] == [(4,), (5,), (4,), (5,)]


def test_cpu_explicit_cores_per_device(fake_host) -> None:
    fake_host({0, 1, 2, 3, 4, 5})
    devices = CpuBackend(num_devices=2, cores_per_device=2).devices()
    assert [d.cores for d in devices] == [(0, 1), (2, 3)]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"num_devices": 0}, "num_devices"),
        ({"num_devices": -1}, "num_devices"),
        ({"cores_per_device": 0}, "cores_per_device"),
        ({"cores_per_device": 3}, "cores_per_device"),  # the fake host has 2 cores
    ],
)
def test_cpu_invalid_options_name_the_option(fake_host, options: dict, named: str) -> None:
    fake_host({0, 1})
    with pytest.raises(ValueError, match=named):
        CpuBackend(**options)


def test_cpu_worker_env_for_one_slot(fake_host) -> None:
    fake_host({0, 1, 2, 3})
    assert CpuBackend(num_devices=2).worker_env([1]) == {
        "LIBRA_VISIBLE_DEVICES": "1",
        "OMP_NUM_THREADS": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "2,3",
    }


def test_cpu_worker_env_for_two_slots_binds_one_core_list_per_slot(fake_host) -> None:
    fake_host({0, 1})
    assert CpuBackend().worker_env([0, 1]) == {
        "LIBRA_VISIBLE_DEVICES": "0,1",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }


@pytest.mark.parametrize("indices", [[], [2], [-1], [0, 0]])
def test_cpu_worker_env_rejects_bad_indices(fake_host, indices: list[int]) -> None:
    fake_host({0, 1})
    with pytest.raises(ValueError, match="device_indices"):
        CpuBackend(num_devices=2).worker_env(indices)


def test_cpu_torch_device_and_profile(fake_host) -> None:
    fake_host({0, 1, 2, 3}, total_memory=16 * GiB)
    backend = CpuBackend(num_devices=2)
    assert backend.torch_device(0) == torch.device("cpu")
    profile = backend.hardware_profile()
    assert profile.memory_capacity_bytes == 8 * GiB
    assert profile.devices_per_node == 2
    one_core = CpuBackend(num_devices=4).hardware_profile()
    assert profile.peak_bf16_flops == 2 * one_core.peak_bf16_flops > 0


# -- cuda plugin --------------------------------------------------------------------------------


@pytest.fixture
def cuda_backend() -> Backend:
    if not _PLUGINS_INSTALLED:
        pytest.skip("pip install -e backends/cuda -e backends/ascend first")
    return get_backend("cuda")


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch):
    """Makes torch report CUDA GPUs of the given names, and records `set_device` calls."""
    current: list[int] = []

    def install(names: list[str]) -> list[int]:
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            lambda i: SimpleNamespace(name=names[i], total_memory=80 * GiB),
        )
        monkeypatch.setattr(torch.cuda, "set_device", current.append)
        return current

    return install


@pytest.mark.skipif(_HAS_CUDA, reason="this machine has a CUDA device")
def test_cuda_is_unavailable_here_with_a_reason(cuda_backend: Backend) -> None:
    availability = cuda_backend.availability()
    assert not availability.available
    expected = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device visible"
    assert availability.reason.startswith(expected)
    for needs_devices in (cuda_backend.devices, cuda_backend.hardware_profile, cuda_backend.prepare_worker):
        with pytest.raises(RuntimeError, match=expected):
            needs_devices()


def test_cuda_reason_without_torch(cuda_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    assert cuda_backend.availability() == Availability(False, "torch is not installed")


def test_cuda_reason_without_visible_devices(
    cuda_backend: Backend, fake_gpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpus([])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda_backend.availability() == Availability(
        False, "no CUDA device visible (CUDA_VISIBLE_DEVICES='')"
    )


@pytest.mark.parametrize("name", ["cuda", "ascend"])
def test_slots_let_workers_share_a_device(name: str, fake_gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    """`backend.slots_per_device=2`: a train rank and a rollout instance on one GPU (the device
    check's job), each slot with half the memory; a worker of two ranks on one device is refused."""
    if not _PLUGINS_INSTALLED:
        pytest.skip("pip install -e backends/cuda -e backends/ascend first")
    variable = {"cuda": "CUDA_VISIBLE_DEVICES", "ascend": "ASCEND_RT_VISIBLE_DEVICES"}[name]
    monkeypatch.delenv(variable, raising=False)
    backend = get_backend(name, **BackendConfig(name=name, slots_per_device=2).options())
    assert [backend.worker_env([slot]) for slot in range(4)] == [{variable: gpu} for gpu in "0011"]
    assert backend.worker_env([1, 2]) == {variable: "0,1"}
    with pytest.raises(ValueError, match=r"slots \[2, 3\] share a device \(2 slots per device\)"):
        backend.worker_env([2, 3])
    if name == "cuda":
        fake_gpus(["NVIDIA H200"])
        assert backend.devices() == [
            DeviceInfo(index=0, kind="NVIDIA H200", memory_bytes=40 * GiB),
            DeviceInfo(index=1, kind="NVIDIA H200", memory_bytes=40 * GiB),
        ]
        # The planner plans each slot with half of the GPU.
        profile = backend.hardware_profile()
        assert profile.memory_capacity_bytes == H200_SXM_141GB.memory_capacity_bytes // 2
        assert profile.peak_bf16_flops == H200_SXM_141GB.peak_bf16_flops / 2
    with pytest.raises(ValueError, match="backend.slots_per_device must be >= 1"):
        BackendConfig(name=name, slots_per_device=0)
    assert BackendConfig(name=name).options() == {}


def test_cuda_inventory_and_profile_from_device_properties(cuda_backend: Backend, fake_gpus) -> None:
    fake_gpus(["NVIDIA H200", "NVIDIA H200"])
    assert cuda_backend.availability().available
    assert cuda_backend.devices() == [
        DeviceInfo(index=0, kind="NVIDIA H200", memory_bytes=80 * GiB),
        DeviceInfo(index=1, kind="NVIDIA H200", memory_bytes=80 * GiB),
    ]
    assert cuda_backend.hardware_profile() == H200_SXM_141GB
    assert cuda_backend.torch_device(1) == torch.device("cuda", 1)


def test_cuda_profile_of_an_unknown_gpu_is_an_error(cuda_backend: Backend, fake_gpus) -> None:
    fake_gpus(["NVIDIA GeForce RTX 4090"])
    with pytest.raises(RuntimeError, match="no hardware profile for 'NVIDIA GeForce RTX 4090'"):
        cuda_backend.hardware_profile()


def test_cuda_prepare_worker_follows_local_rank(
    cuda_backend: Backend, fake_gpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    current = fake_gpus(["NVIDIA H100 80GB HBM3"] * 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cuda_backend.prepare_worker()
    assert current == []
    monkeypatch.setenv("LOCAL_RANK", "1")
    cuda_backend.prepare_worker()
    assert current == [1]
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2"):
        cuda_backend.prepare_worker()


# -- ascend plugin ------------------------------------------------------------------------------


@pytest.fixture
def ascend_backend() -> Backend:
    if not _PLUGINS_INSTALLED:
        pytest.skip("pip install -e backends/cuda -e backends/ascend first")
    return get_backend("ascend")


@pytest.mark.skipif(_HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_ascend_is_unavailable_here_with_a_reason(ascend_backend: Backend) -> None:
    assert ascend_backend.availability() == Availability(False, "torch_npu is not installed")
    for needs_devices in (
        ascend_backend.devices,
        ascend_backend.prepare_worker,
        lambda: ascend_backend.torch_device(0),
    ):
        with pytest.raises(RuntimeError, match="torch_npu is not installed"):
            needs_devices()


def test_ascend_reason_without_torch(ascend_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    assert ascend_backend.availability() == Availability(False, "torch is not installed")


# -- visible devices of the accelerator plugins -------------------------------------------------


@needs_plugins
@pytest.mark.parametrize(
    ("name", "variable"), [("cuda", "CUDA_VISIBLE_DEVICES"), ("ascend", "ASCEND_RT_VISIBLE_DEVICES")]
)
def test_accelerator_worker_env(name: str, variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = get_backend(name)
    monkeypatch.delenv(variable, raising=False)
    assert backend.worker_env([0, 2]) == {variable: "0,2"}  # nothing CPU-specific
    # A restricted agent: indices are positions in its own view, mapped to its entries.
    monkeypatch.setenv(variable, "4,5,6,7")
    assert backend.worker_env([3, 1]) == {variable: "7,5"}
    monkeypatch.setenv(variable, "GPU-aaaa,GPU-bbbb")
    assert backend.worker_env([1]) == {variable: "GPU-bbbb"}
    with pytest.raises(ValueError, match="sees 2 devices"):
        backend.worker_env([2])
    for bad in ([], [0, 0], [-1]):
        with pytest.raises(ValueError, match="device_indices"):
            backend.worker_env(bad)


# -- hardware profiles --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("product_name", "profile"),
    [
        ("NVIDIA H200", H200_SXM_141GB),
        ("NVIDIA A800-SXM4-80GB", A800_SXM4_80GB),
        ("NVIDIA H100 80GB HBM3", H100_SXM_80GB),
        ("Ascend910B3", ASCEND_910B),
        ("Ascend 910B4", ASCEND_910B),
        ("NVIDIA H100 PCIe", None),  # PCIe/NVL boards are not the SXM figures
        ("NVIDIA H200 NVL", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("Ascend310P", None),
    ],
)
def test_profile_for_device_names(product_name: str, profile) -> None:
    assert profile_for(product_name) == profile


def test_profiles_are_consistent_with_the_datasheets() -> None:
    for profile in (A800_SXM4_80GB, H100_SXM_80GB, H200_SXM_141GB, ASCEND_910B):
        assert profile.devices_per_node == 8
        assert profile.intra_node_bandwidth_bytes_per_s > profile.inter_node_bandwidth_bytes_per_s
    # H200 is an H100 with more and faster memory.
    assert H200_SXM_141GB.peak_bf16_flops == H100_SXM_80GB.peak_bf16_flops
    assert H200_SXM_141GB.memory_bandwidth_bytes_per_s > H100_SXM_80GB.memory_bandwidth_bytes_per_s
    assert H200_SXM_141GB.memory_capacity_bytes > H100_SXM_80GB.memory_capacity_bytes
