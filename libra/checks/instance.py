"""A rollout instance process for the checks, started the way the job starts one: an
`InstanceSpec` naming the backend (whose engine defaults fill what the config leaves unset), the
backend's environment for device 0, a bearer token, and the address file it writes once serving."""

from __future__ import annotations

import dataclasses
import os
import secrets
import subprocess
import time
from pathlib import Path

from libra.backends import Backend, BackendConfig, get_backend
from libra.control.worker_guard import end_guarded, guarded, make_private_tmp, remove_private_tmp
from libra.rollout.client import InstanceClient
from libra.rollout.config import InstanceConfig
from libra.rollout.instance_server import InstanceSpec

START_TIMEOUT_S = 600.0
"""A CUDA engine compiles and captures graphs before it serves (minutes for a large model; the
tiny one takes well under one)."""
MAX_MODEL_LEN = 512
ACCELERATOR_MEMORY_SHARE = 0.3
"""Of the device, for an instance of the checks: the check process itself holds models on the
same device (a trainer, transformers' reference)."""


def check_instance_config(model: Path, backend: Backend, **changes) -> InstanceConfig:
    """An fp32 instance of `model` (greedy output and logprobs then compare exactly with
    transformers and the trainer), the backend's engine defaults for what `changes` leaves unset."""
    memory = None if backend.engine_defaults.gpu_memory_utilization is None else ACCELERATOR_MEMORY_SHARE
    config = InstanceConfig(
        model=str(model), dtype="float32", max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=memory
    )
    return dataclasses.replace(config, **changes)


class CheckInstance:
    """One instance on device 0 of `backend`; a context manager that stops it (and its engine
    process, in its own process group) on exit."""

    def __init__(self, config: InstanceConfig, backend: str, workdir: Path, name: str):
        self.config = config
        self.backend = BackendConfig(name=backend)
        self.token = secrets.token_hex(16)
        self.address_file = workdir / f"{name}.addr"
        self.log_path = workdir / f"{name}.log"
        self.address = ""
        self._process: subprocess.Popen | None = None
        self._tmp: str | None = None
        """The instance's TMPDIR, removed by its guard, or by `stop` if the guard could not."""

    def start(self) -> CheckInstance:
        spec = InstanceSpec(self.config, backend=self.backend, address_file=str(self.address_file))
        env = {
            **os.environ,
            **get_backend(self.backend.name, **self.backend.options()).worker_env([0]),
            "LIBRA_TOKEN": self.token,
        }
        self._tmp = make_private_tmp()
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                # Under a worker guard: the instance dies with the check, even a SIGKILLed one,
                # and its temp files with it.
                guarded(spec.to_argv(), self._tmp),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.address_file.is_file():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the rollout instance did not start (log {self.log_path}):\n{tail}")
            time.sleep(0.2)
        self.address = self.address_file.read_text().strip()
        return self

    def client(self) -> InstanceClient:
        """A client for this instance; create it inside the event loop that uses it."""
        return InstanceClient(self.address, self.token)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            end_guarded(self._process, grace_s=30.0)
        remove_private_tmp(self._tmp)  # if its guard was killed outright
        self._tmp = None

    def __enter__(self) -> CheckInstance:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
