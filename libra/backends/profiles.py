"""Hardware profiles of the accelerators Libra targets, and a lookup by the device name that torch
reports (`torch.cuda.get_device_properties(i).name`, `torch.npu.get_device_name(i)`).

Units: FLOP/s, bytes, bytes/s. Memory capacities are what the device reports to torch
(`total_memory`, binary units: the 80 GB parts show 79.3 GiB), not the datasheet's decimal GB:
KV capacity is what is left of that after the weights. Link bandwidths are per device and per
direction (`HardwareProfile`): vendors quote NVLink / HCCS as the sum of both directions, so the
profiles hold half the quoted figure. Node layout: 8 devices per node in every HGX / Atlas 800T
A2 system. Each figure is held against published engine measurements in
`tests/planner/test_rollout_anchors.py` (the anchor table, `reference/rollout-anchors.md`).

Sources:
- A800 SXM4 80GB: NVIDIA A800 datasheet (the A100 80GB SXM4 silicon with NVLink capped at
  400 GB/s, i.e. 200 GB/s a direction): BF16 tensor 312 TFLOPS dense (624 with sparsity), HBM2e
  2,039 GB/s, 80 GB (79.3 GiB reported). NIC: one 200 Gb/s HDR InfiniBand HCA per GPU, as in
  DGX A100 / HGX A800 reference designs. With the rollout factors' communication efficiency
  (0.7) the all-reduce bus bandwidth is 140 GB/s: 8xA100 (600 GB/s NVLink) measures 200-230 GB/s
  in nccl-tests (NVIDIA/nccl-tests issues 149, 178), i.e. 0.7-0.75 of its 300 GB/s a direction.
- H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet: BF16 tensor 1,979 TFLOPS *with sparsity*,
  so 989.5 TFLOPS dense; HBM3 3.35 TB/s; 80 GB; NVLink 900 GB/s (450 a direction). NIC: one
  400 Gb/s ConnectX-7 per GPU (DGX H100).
- H200 SXM 141GB: NVIDIA H200 Tensor Core GPU datasheet: same compute as H100 SXM (989.5 TFLOPS
  dense BF16); HBM3e 4.8 TB/s; 141 GB (139.8 GiB reported); NVLink 900 GB/s. NIC: one 400 Gb/s
  ConnectX-7 per GPU (DGX H200).
- Ascend 910B: Huawei publishes no per-chip datasheet. Figures are those commonly reported for
  the 910B3 in Atlas 800T A2 servers: ~313 TFLOPS dense FP16/BF16, 64 GB HBM2e at ~1.6 TB/s,
  HCCS full mesh of 7 links x 56 GB/s = 392 GB/s per NPU (196 a direction), one 200 GE RoCE port
  per NPU. The reported share of its 64 GiB is not published; taken as the A100's (99 %). Treat
  them as approximate; calibration (planner) should replace them with measurements.

All-reduce latency floor (`allreduce_latency_s`, one intra-node all-reduce of a decode step's
activations, tens to hundreds of KB, beyond what its bytes cost at the bus bandwidth):
- H100 / H200 (NVLink 4 + NVSwitch): 8 us. sgl-project/sglang PR #2904 measures a one-shot
  custom all-reduce on H100 at 3.7 / 4.8 / 5.9 us for 512 B at TP 2 / 4 / 8 and 16.7 / 22 us at
  256 / 512 KB on 8 GPUs; vLLM's at 10 / 24 / 30 us; NVIDIA/nccl issue #1259 reports ~6 us for
  NCCL's NVLS all-reduce of small messages on 2 H100s with CUDA graphs.
- A800 (NVLink 3, links capped at 400 GB/s): 20 us. No published A800/A100 small-message figure
  was found; with it (and the step overhead below) the model's single-stream speed-ups of TP-2 /
  4 / 8 over TP-1 fall inside what the anchors imply (about 1.5-1.7x / 2.2-2.6x / 2.5-3.3x).
- Ascend 910B (HCCS full mesh): 30 us. No published HCCL small-message latency was found either;
  HCCL runs collectives through the device's task scheduler rather than a one-shot kernel over
  peer memory, and is taken as above NVLink's. Replace with `hccl_test` numbers.

Engine step overhead (`engine_step_overhead_s`, the host's time per forward pass): 1.5 ms on
H100 / H200 (SGLang's host time at TP-2 on H100 is 1.4-1.9 ms a step; Llama-3.1-8B at TP-8, batch
1 decodes at 2.2-2.3 ms a step in sgl-project/sglang PR 3124 where weights and all-reduces
explain about 1 ms), 2 ms on A800 (the anchor table's "1-2 ms a step missing"; older hosts),
3 ms on the 910B (no figure found; vllm-ascend's host path is taken as slower).
"""

from __future__ import annotations

from libra.backends.base import HardwareProfile

_TERA = 1e12
_GB = 1e9
_GIB = 2**30
_MS = 1e-3
_GBIT = 1e9 / 8  # bytes/s in one Gb/s
_US = 1e-6

A800_SXM4_80GB = HardwareProfile(
    name="NVIDIA A800-SXM4-80GB",
    peak_bf16_flops=312 * _TERA,
    memory_bandwidth_bytes_per_s=2039 * _GB,
    memory_capacity_bytes=int(79.3 * _GIB),
    intra_node_bandwidth_bytes_per_s=200 * _GB,
    inter_node_bandwidth_bytes_per_s=200 * _GBIT,
    devices_per_node=8,
    allreduce_latency_s=20 * _US,
    engine_step_overhead_s=2 * _MS,
)

H100_SXM_80GB = HardwareProfile(
    name="NVIDIA H100 SXM5 80GB",
    peak_bf16_flops=989.5 * _TERA,
    memory_bandwidth_bytes_per_s=3350 * _GB,
    memory_capacity_bytes=int(79.3 * _GIB),
    intra_node_bandwidth_bytes_per_s=450 * _GB,
    inter_node_bandwidth_bytes_per_s=400 * _GBIT,
    devices_per_node=8,
    allreduce_latency_s=8 * _US,
    engine_step_overhead_s=1.5 * _MS,
)

H200_SXM_141GB = HardwareProfile(
    name="NVIDIA H200 SXM 141GB",
    peak_bf16_flops=989.5 * _TERA,
    memory_bandwidth_bytes_per_s=4800 * _GB,
    memory_capacity_bytes=int(139.8 * _GIB),
    intra_node_bandwidth_bytes_per_s=450 * _GB,
    inter_node_bandwidth_bytes_per_s=400 * _GBIT,
    devices_per_node=8,
    allreduce_latency_s=8 * _US,
    engine_step_overhead_s=1.5 * _MS,
)

ASCEND_910B = HardwareProfile(
    name="Ascend 910B",
    peak_bf16_flops=313 * _TERA,
    memory_bandwidth_bytes_per_s=1600 * _GB,
    memory_capacity_bytes=int(0.99 * 64 * _GIB),
    intra_node_bandwidth_bytes_per_s=196 * _GB,
    inter_node_bandwidth_bytes_per_s=200 * _GBIT,
    devices_per_node=8,
    allreduce_latency_s=30 * _US,
    engine_step_overhead_s=3 * _MS,
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
