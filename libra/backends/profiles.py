"""Hardware profiles of the accelerators Libra targets, and a lookup by the device name that torch
reports (`torch.cuda.get_device_properties(i).name`, `torch.npu.get_device_name(i)`).

Units are SI: FLOP/s, bytes, bytes/s; capacities are the datasheet's decimal GB. Bandwidths are
per device and per direction-sum as the vendors quote them (NVLink "900 GB/s" is the bidirectional
total of one GPU). Node layout: 8 devices per node in every HGX / Atlas 800T A2 system.

Sources:
- A800 SXM4 80GB: NVIDIA A800 datasheet (the A100 80GB SXM4 silicon with NVLink capped at
  400 GB/s): BF16 tensor 312 TFLOPS dense (624 with sparsity), HBM2e 2,039 GB/s, 80 GB.
  NIC: one 200 Gb/s HDR InfiniBand HCA per GPU, as in DGX A100 / HGX A800 reference designs.
- H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet: BF16 tensor 1,979 TFLOPS *with sparsity*,
  so 989.5 TFLOPS dense; HBM3 3.35 TB/s; 80 GB; NVLink 900 GB/s. NIC: one 400 Gb/s ConnectX-7 per
  GPU (DGX H100).
- H200 SXM 141GB: NVIDIA H200 Tensor Core GPU datasheet: same compute as H100 SXM (989.5 TFLOPS
  dense BF16); HBM3e 4.8 TB/s; 141 GB; NVLink 900 GB/s. NIC: one 400 Gb/s ConnectX-7 per GPU
  (DGX H200).
- Ascend 910B: Huawei publishes no per-chip datasheet. Figures are those commonly reported for
  the 910B3 in Atlas 800T A2 servers: ~313 TFLOPS dense FP16/BF16, 64 GB HBM2e at ~1.6 TB/s,
  HCCS full mesh of 7 links x 56 GB/s = 392 GB/s per NPU, one 200 GE RoCE port per NPU. Treat them
  as approximate; calibration (planner) should replace them with measurements.

All-reduce latency floor (`allreduce_latency_s`, one small intra-node all-reduce, what each of
a TP decode step's two all-reduces per layer costs however few bytes it moves):
- H100 / H200 (NVLink 4 + NVSwitch): 5 us. sgl-project/sglang PR #2904 measures a one-shot
  custom all-reduce on H100 at 3.7 / 4.8 / 5.9 us for 512 B at TP 2 / 4 / 8 (3.9-7.8 us up to
  32 KB), and vLLM's at 8.5-11.8 us without CUDA graphs; NVIDIA/nccl issue #1259 reports ~6 us
  for NCCL's NVLS all-reduce of small messages on 2 H100s with CUDA graphs. Decode batches of
  tens of sequences move 10-100 KB per all-reduce, inside that range.
- A800 (NVLink 3, links capped at 400 GB/s): 8 us. No published A800/A100 small-message figure
  was found; the previous NVLink generation is assumed ~1.5x Hopper's floor (between the custom
  and NCCL paths above).
- Ascend 910B (HCCS full mesh): 20 us. No published HCCL small-message latency was found either;
  HCCL runs collectives through the device's task scheduler rather than a one-shot kernel over
  peer memory, and is taken as several times NVLink's floor. Replace with `hccl_test` numbers.
"""

from __future__ import annotations

from libra.backends.base import HardwareProfile

_TERA = 1e12
_GB = 1e9
_GBIT = 1e9 / 8  # bytes/s in one Gb/s
_US = 1e-6

A800_SXM4_80GB = HardwareProfile(
    name="NVIDIA A800-SXM4-80GB",
    peak_bf16_flops=312 * _TERA,
    memory_bandwidth_bytes_per_s=2039 * _GB,
    memory_capacity_bytes=int(80 * _GB),
    intra_node_bandwidth_bytes_per_s=400 * _GB,
    inter_node_bandwidth_bytes_per_s=200 * _GBIT,
    devices_per_node=8,
    allreduce_latency_s=8 * _US,
)

H100_SXM_80GB = HardwareProfile(
    name="NVIDIA H100 SXM5 80GB",
    peak_bf16_flops=989.5 * _TERA,
    memory_bandwidth_bytes_per_s=3350 * _GB,
    memory_capacity_bytes=int(80 * _GB),
    intra_node_bandwidth_bytes_per_s=900 * _GB,
    inter_node_bandwidth_bytes_per_s=400 * _GBIT,
    devices_per_node=8,
    allreduce_latency_s=5 * _US,
)

H200_SXM_141GB = HardwareProfile(
    name="NVIDIA H200 SXM 141GB",
    peak_bf16_flops=989.5 * _TERA,
    memory_bandwidth_bytes_per_s=4800 * _GB,
    memory_capacity_bytes=int(141 * _GB),
    intra_node_bandwidth_bytes_per_s=900 * _GB,
    inter_node_bandwidth_bytes_per_s=400 * _GBIT,
    devices_per_node=8,
    allreduce_latency_s=5 * _US,
)

ASCEND_910B = HardwareProfile(
    name="Ascend 910B",
    peak_bf16_flops=313 * _TERA,
    memory_bandwidth_bytes_per_s=1600 * _GB,
    memory_capacity_bytes=int(64 * _GB),
    intra_node_bandwidth_bytes_per_s=392 * _GB,
    inter_node_bandwidth_bytes_per_s=200 * _GBIT,
    devices_per_node=8,
    allreduce_latency_s=20 * _US,
)

# (family token, profile). Matching is on the normalised name (lower case, no spaces or dashes).
# The NVIDIA figures are SXM-module figures: PCIe and NVL boards of the same family have other
# clocks, power limits and links, so they are deliberately not matched (see `profile_for`).
_FAMILIES: tuple[tuple[str, HardwareProfile], ...] = (
    ("a800", A800_SXM4_80GB),
    ("h100", H100_SXM_80GB),
    ("h200", H200_SXM_141GB),
    ("ascend910b", ASCEND_910B),
)
_NOT_SXM = ("pcie", "nvl")

KNOWN_PROFILES: tuple[HardwareProfile, ...] = tuple(profile for _, profile in _FAMILIES)


def profile_for(product_name: str) -> HardwareProfile | None:
    """The profile for a device name as torch reports it, e.g. `NVIDIA H200`,
    `NVIDIA A800-SXM4-80GB`, `NVIDIA H100 80GB HBM3`, `Ascend910B3`; None when no profile fits
    (another product, or a PCIe/NVL board of a listed family)."""
    normalised = product_name.lower().replace(" ", "").replace("-", "").replace("_", "")
    for token, profile in _FAMILIES:
        if token not in normalised:
            continue
        if profile.name.startswith("NVIDIA") and any(word in normalised for word in _NOT_SXM):
            return None
        return profile
    return None


def require_profile_for(product_name: str) -> HardwareProfile:
    """`profile_for`, raising RuntimeError for a device without a profile rather than guessing
    figures the planner would trust."""
    profile = profile_for(product_name)
    if profile is None:
        known = ", ".join(p.name for p in KNOWN_PROFILES)
        raise RuntimeError(
            f"no hardware profile for {product_name!r} (known: {known}); "
            "add one to libra/backends/profiles.py"
        )
    return profile
