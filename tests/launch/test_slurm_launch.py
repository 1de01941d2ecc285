"""`scripts/launch_cuda.sh` under a real one-node Slurm (issue #20): munged, slurmctld and slurmd
started as root in a scratch folder (tests/launch/daemons.py), then
`salloc -N1 bash scripts/launch_cuda.sh configs/tiny_cpu.py RUN_DIR <a one-step job>` with
BACKEND=cpu. The script runs the controller itself and starts the node agent with `srun` inside
the allocation; the job must run to its end, the agent must have been a Slurm step (slurmd launched
it, its output is srun's per-node file) that registered with the controller, and nothing of the
job may outlive the launcher. Skips where Slurm is not installed or this is not root
(`scripts/install_test_deps.sh`, which `scripts/test.sh` runs, installs it as root).

About 40-80 s on 2 cores, by load (the cluster is up in a second or two; the job is the rest).
"""

from __future__ import annotations

import pytest

from tests.launch.daemons import SlurmCluster, slurm_unavailable, started_or_skipped
from tests.launch.helpers import Launch, check_agent_registered, check_finished, launch, launch_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.warm_start, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    with started_or_skipped(cluster, slurm_unavailable(), "one-node Slurm"):
        yield cluster


@pytest.fixture(scope="module")
def launched(slurm, tmp_path_factory) -> Launch:
    run_dir = tmp_path_factory.mktemp("slurm-job") / "run"
    prefix = ["salloc", "-N1", "--job-name=libra-launch-test"]
    return launch(prefix, run_dir, launch_env(slurm.env), slurm.root)


def test_the_job_runs_to_its_end_under_salloc(launched):
    check_finished(launched)
    assert "agent(s) via slurm" in launched.output, launched.explain()
    print(f"salloc + launch_cuda.sh: {launched.seconds:.0f} s")


def test_the_agent_is_a_slurm_step_that_registers(launched, slurm):
    # srun's --output=logs/agent-%N.log: one file per node, named by Slurm.
    check_agent_registered(launched, f"agent-{slurm.node}.log")
    slurmd_log = (slurm.root / "slurmd.log").read_text()
    assert "launch task StepId=1.0 request" in slurmd_log, slurmd_log[-2000:]


def test_nothing_outlives_the_launcher(launched, slurm):
    assert not launched.leftovers, launched.leftovers
    assert slurm.node_state() == "idle"  # the allocation was released
