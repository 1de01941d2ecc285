"""Controller and node agents as separate hosts on one machine: each agent serves on its own
loopback address (127.0.0.2, 127.0.0.3) and registers it, the controller reaches each there, and
the workers they start form one torch.distributed (gloo) group across the two "hosts"."""

from __future__ import annotations

import socket
import sys

import pytest

from libra.backends.config import BackendConfig
from libra.config import LibraConfig
from libra.control import WorkerRole, WorkerSpec
from libra.control.config import ControlConfig
from tests.control.helpers import TOKEN, wait_for

pytestmark = pytest.mark.multiprocess

HOSTS = ("127.0.0.2", "127.0.0.3")

ALL_REDUCE = """
import os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=60))
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
open(sys.argv[2], "w").write(f"{value.item()} {os.environ['LIBRA_VISIBLE_DEVICES']}")
dist.destroy_process_group()
"""


@pytest.fixture
def config(tmp_path) -> LibraConfig:
    # Beats a second apart: this test is about addresses, not about detecting a loss quickly.
    control = ControlConfig(port=0, token=TOKEN, heartbeat_interval_s=1.0)
    return LibraConfig(run_dir=str(tmp_path / "run"), control=control, backend=BackendConfig(name="cpu"))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def test_agents_on_their_own_addresses_run_one_gloo_group(client, spawn_agent, tmp_path):
    agents = [spawn_agent(num_devices=2, overrides=(f"control.host={host}",)) for host in HOSTS]
    addresses = {a.agent_id: a.address for a in client.cluster_state().agents}
    for agent, host in zip(agents, HOSTS, strict=True):
        agent_host, port = addresses[agent.agent_id].rsplit(":", 1)
        assert agent_host == host
        # It serves on that address only, as a host's agent serves on its own interface.
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", int(port)), 2):
            pass

    master = {"MASTER_ADDR": HOSTS[0], "MASTER_PORT": str(_free_port(HOSTS[0])), "GLOO_SOCKET_IFNAME": "lo"}
    outputs = [tmp_path / f"rank{rank}" for rank in range(2)]
    for rank, agent in enumerate(agents):
        argv = (sys.executable, "-c", ALL_REDUCE, str(rank), str(outputs[rank]))
        client.start_worker(agent.agent_id, WorkerSpec(f"rank{rank}", WorkerRole.TRAIN, (1,), argv, master))
    for output in outputs:
        wait_for(
            lambda o=output: _result_or_failure(client, o), timeout_s=120, what=f"{output.name}'s result"
        )
    assert [o.read_text() for o in outputs] == ["3.0 1", "3.0 1"]
    workers = {w.spec.worker_id: w for w in client.cluster_state().workers}
    assert {workers[f"rank{r}"].agent_id for r in range(2)} == {a.agent_id for a in agents}


def _result_or_failure(client, output) -> str:
    if output.is_file() and output.read_text():
        return output.read_text()
    status = next(w for w in client.cluster_state().workers if w.spec.worker_id == output.name)
    if status.state.ended:
        raise AssertionError(
            f"{output.name} ended {status.state.name}: {open(status.log_path).read()[-2000:]}"
        )
    return ""
