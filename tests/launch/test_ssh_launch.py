"""`scripts/launch_cuda.sh`'s ssh path (issue #20): a private sshd on a free loopback port (its own
config, a generated host key pinned in a known_hosts file, a generated client key authorised for
root; tests/launch/daemons.py), then
`LIBRA_HOSTS=127.0.0.1 BACKEND=cpu bash scripts/launch_cuda.sh configs/tiny_cpu.py RUN_DIR <a one-step
job>` with LIBRA_SSH_OPTS pointing ssh at it. The node agent must come up over ssh (sshd let root
in with the key; its output came back through the connection), register, and the job must run to
its end; the remote agent must end with the launcher (the session has a terminal: closing it sends
SIGHUP), leaving nothing behind. Skips where sshd is not installed or this is not root
(`scripts/install_test_deps.sh`, which `scripts/test.sh` runs, installs it as root).

About 40-80 s on 2 cores, by load.
"""

from __future__ import annotations

import shlex

import pytest

from tests.launch.daemons import PrivateSshd, sshd_unavailable, started_or_skipped
from tests.launch.helpers import Launch, check_agent_registered, check_finished, launch, launch_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.warm_start, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = PrivateSshd(tmp_path_factory.mktemp("sshd"))
    with started_or_skipped(server, sshd_unavailable(), "a private sshd"):
        probe = server.ssh("true")
        assert probe.returncode == 0, (
            f"ssh to the private sshd failed: {probe.stderr}\n{server.log.read_text()}"
        )
        yield server


@pytest.fixture(scope="module")
def launched(sshd, tmp_path_factory) -> Launch:
    run_dir = tmp_path_factory.mktemp("ssh-job") / "run"
    env = launch_env(sshd.env, LIBRA_HOSTS="127.0.0.1", LIBRA_SSH_OPTS=shlex.join(sshd.options))
    return launch([], run_dir, env, sshd.root)


def test_the_job_runs_to_its_end_over_ssh(launched):
    check_finished(launched)
    assert "agent(s) via ssh" in launched.output, launched.explain()
    print(f"launch_cuda.sh over ssh: {launched.seconds:.0f} s")


def test_the_agent_comes_up_over_ssh_and_registers(launched, sshd):
    # The launcher writes each host's ssh output to logs/agent-<host>.log.
    check_agent_registered(launched, "agent-127.0.0.1.log")
    sshd_log = sshd.log.read_text()
    assert "Accepted publickey for root from 127.0.0.1" in sshd_log, sshd_log[-2000:]
    assert "Starting session: command on pts/" in sshd_log, sshd_log[-2000:]  # the launcher's (-tt)


def test_nothing_outlives_the_launcher(launched):
    assert not launched.leftovers, launched.leftovers
