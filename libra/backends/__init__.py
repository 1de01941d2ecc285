"""Hardware backends: the `Backend` protocol, the registry that finds backends by name (built-in
`cpu`, plugins through the entry-point group `libra.backends`), the cpu backend (CPU slots as
devices, gloo, the Megatron-core CPU patches it applies in its workers, an in-process eager
rollout engine) and the hardware
profiles of the accelerators Libra targets, and the `backend` config section (`config`). The cuda
and ascend backends are the plugin packages under `backends/`.
"""

from libra.backends.base import Availability, Backend, DeviceInfo, EngineDefaults, HardwareProfile
from libra.backends.config import BackendConfig
from libra.backends.registry import available_backends, get_backend

__all__ = [
    "Availability",
    "Backend",
    "BackendConfig",
    "DeviceInfo",
    "EngineDefaults",
    "HardwareProfile",
    "available_backends",
    "get_backend",
]
