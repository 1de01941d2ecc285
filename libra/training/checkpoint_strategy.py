"""A `dist_checkpointing` save strategy that writes from the calling thread, without forking.

Megatron's default `torch_dist` save strategy hands the write to `FileSystemWriterAsync`, which
always forks one writer process per file bucket (`write_preloaded_data_multiproc`,
`mp.get_context("fork")`) and collects their results through a `multiprocessing.Manager` queue.
Forking a process that runs a multi-threaded gRPC server hangs (the child inherits locks held by
other threads; gRPC's fork handlers wait on threads that do not exist in the child), which is why
`SaveCheckpoint` over the `TrainRank` service hung while direct engine calls worked.

This strategy keeps Megatron's sharded-key translation and its save planner, and writes with
torch.distributed.checkpoint's own `FileSystemWriter(thread_count=1)`, which writes in the calling
thread. The result is the same `torch_dist` format (backend `torch_dist`, version 1: `.distcp`
files, `.metadata`, `common.pt`, `metadata.json`), so `dist_checkpointing.load` and the default
load strategy read it unchanged, at any TP/PP. Checkpoints are small next to a training step on
the CPU; a writer thread pool (`thread_count > 1`) would also be fork-free if that ever matters.
"""

from __future__ import annotations

from pathlib import Path


def in_thread_save_strategy():
    """A `SaveShardedStrategy` for `dist_checkpointing.save(..., sharded_strategy=...)`."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed import checkpoint as dcp

    class InThreadTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir: str | Path) -> None:
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            dcp.save(
                mcore_to_pyt_state_dict(sharded_state_dict, False),
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                # The decentralized plan is only what Megatron's own async saver runs; the
                # standard torch save path plans centrally on rank 0.
                planner=MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica,
                    flatten_state_dict=False,
                    can_run_decentralized_global_plan=False,
                ),
            )

    return InThreadTorchDistSaveStrategy("torch_dist", 1)
