"""Libra's cuda backend (a plugin: entry point `cuda` in the group `libra.backends`)."""

from libra_backend_cuda.backend import CudaBackend

__all__ = ["CudaBackend"]
