"""torch.distributed and Megatron's model-parallel groups for one train rank, from the plan.

Rank layout is Megatron's default order (TP fastest, then DP, then PP), so ranks 0..TP-1 form
the first TP group. The collective comes from the backend (gloo on the CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def initialize(
    tensor_parallel: int,
    pipeline_parallel: int,
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    seed: int = 1234,
    timeout_s: float = 600.0,
) -> RankInfo:
    """Joins the job's process group and builds Megatron's parallel state. Call once per process,
    after the backend's `prepare_worker()`."""
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mp

    if world_size % (tensor_parallel * pipeline_parallel):
        raise ValueError(
            f"world_size={world_size} is not a multiple of tensor_parallel x pipeline_parallel "
            f"= {tensor_parallel * pipeline_parallel}"
        )
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", master_addr)
        os.environ.setdefault("MASTER_PORT", str(master_port))
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
    )
    # Same seed everywhere: Megatron builds the full weights on each rank and slices them.
    torch.manual_seed(seed)
    mp.model_parallel_cuda_manual_seed(seed)
    return rank_info()


def rank_info() -> RankInfo:
    from megatron.core import parallel_state as ps

    return RankInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
    )


def shutdown() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
