"""The `control` section of a run's config: the gRPC control plane's address, credentials, TLS and
the limits its servers and clients keep."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ControlConfig:
    """The gRPC control plane."""

    host: str = "127.0.0.1"
    """Address the controller listens on (and agents' default for their own service)."""
    port: int = 50051
    """Controller port; 0 picks a free one."""
    token: str | None = None
    """Bearer token every call must carry. None: LIBRA_TOKEN from the environment, else one is
    generated for the run and written to `<run_dir>/token` (mode 0600)."""
    tls_cert_file: str | None = None
    """PEM server certificate; with `tls_key_file`, the controller and agents serve TLS only."""
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    """PEM CA bundle: clients verify servers with it (default: the server certificate itself)."""
    heartbeat_interval_s: float = 1.0
    """Agents beat this often; three missed beats mark an agent lost."""
    max_rpc_threads: int = 32
    """Threads serving RPCs in each of the data plane's synchronous servers (a training rank's,
    the weight stream's). The controller and node agents serve on asyncio and hold no thread per
    call."""
    record_ttl_s: float = 600.0
    """The controller forgets departed agents and ended workers this long after they ended."""
    max_connection_age_s: float = 1800.0
    """Servers recycle a connection after this long (its calls get a third more to finish);
    heartbeat streams are renewed within it, event watchers resume (`ClusterClient`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"control.port must be in 0..65535, got {self.port}")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"control.heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("control.tls_cert_file and control.tls_key_file must be set together")
        if self.max_connection_age_s < 1:
            raise ValueError(f"control.max_connection_age_s must be >= 1, got {self.max_connection_age_s}")
        if self.record_ttl_s <= 0:
            raise ValueError(f"control.record_ttl_s must be > 0, got {self.record_ttl_s}")
        if self.max_rpc_threads < 4:
            raise ValueError(f"control.max_rpc_threads must be >= 4, got {self.max_rpc_threads}")
