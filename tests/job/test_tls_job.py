"""A TLS run of the tiny job (issue #22): with `control.tls_cert_file` set, every server of the run
serves TLS only — the controller, the node agent, the train rank and the rollout instances, which
get the control section through their launch specs — and the job steps and publishes weights
over it. A plaintext call to a worker fails while a TLS one is answered."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libra.control.auth import open_channel
from libra.control.config import ControlConfig
from tests.control.test_tls_and_cli import certificate  # noqa: F401 - a fixture
from tests.job.driven_job import ONE_INSTANCE, run_driven_job, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.warm_start, pytest.mark.timeout(600)]

NUM_STEPS = 2


def _health(address: str, control: ControlConfig | None) -> int:
    channel = open_channel(address, None, control)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status
    finally:
        channel.close()


def _probe_workers(run_dir, driver: dict) -> None:
    """Once the train rank and an instance serve, calls each in plaintext and over TLS."""
    control = driver["control"]
    if not wait_for(
        lambda: (run_dir / "train-rank-0.port").is_file() and (run_dir / "rollout-0.addr").is_file(), driver
    ):
        return
    addresses = {
        "train rank": f"127.0.0.1:{(run_dir / 'train-rank-0.port').read_text().strip()}",
        "instance": (run_dir / "rollout-0.addr").read_text().strip(),
    }
    for name, address in addresses.items():
        try:
            _health(address, None)
            driver.setdefault("plaintext_answered", []).append(name)
        except grpc.RpcError as e:
            driver.setdefault("plaintext_refused", []).append((name, e.code()))
        driver.setdefault("tls_status", {})[name] = _health(address, control)


def test_a_tls_run_serves_tls_everywhere_and_trains(tmp_path, certificate):  # noqa: F811
    cert, key = certificate
    control = ControlConfig(tls_cert_file=str(cert), tls_key_file=str(key))
    driver = {"control": control}
    overrides = [
        *ONE_INSTANCE,
        f"control.tls_cert_file={cert}",
        f"control.tls_key_file={key}",
        f"job.num_steps={NUM_STEPS}",
        "job.prompts_per_step=2",
        "job.group_size=4",
        "job.eval_tasks=0",
        "job.planner=false",
    ]
    result = run_driven_job(tmp_path / "run", overrides, _probe_workers, driver)
    assert result.version == NUM_STEPS
    assert [s.step for s in result.steps] == [1, 2]
    # Every step's weights reached the instance over the TLS control plane.
    assert all(s.num_current_tokens == 0 or s.logprob_abs_diff < 1e-3 for s in result.steps)
    assert driver.get("plaintext_answered", []) == []
    assert [name for name, code in driver["plaintext_refused"]] == ["train rank", "instance"]
    assert driver["tls_status"] == {
        "train rank": health_pb2.HealthCheckResponse.SERVING,
        "instance": health_pb2.HealthCheckResponse.SERVING,
    }
