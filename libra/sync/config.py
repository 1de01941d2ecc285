"""Configuration of weight publication (the `sync` section)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SyncConfig:
    bucket_bytes: int = 512 << 20
    """Largest piece of a destination flat buffer moved at once (split on param boundaries; a
    larger param travels alone)."""
    num_copy_threads: int = 2
    """std::threads per resharding copy (keep at 1-2 per process on the 2-core CPU machines)."""
    megatron_vocab_divisible_by: int = 128
    """Megatron's make_vocab_size_divisible_by: must match the trainer, it decides the source
    vocab padding that the plan strips."""

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0:
            raise ValueError(f"sync.bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.num_copy_threads < 1:
            raise ValueError(f"sync.num_copy_threads must be >= 1, got {self.num_copy_threads}")
        if self.megatron_vocab_divisible_by < 1:
            raise ValueError(
                f"sync.megatron_vocab_divisible_by must be >= 1, got {self.megatron_vocab_divisible_by}"
            )
