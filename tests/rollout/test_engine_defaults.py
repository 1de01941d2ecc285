"""Each backend owns its rollout engine's defaults (issue #24): the CPU's eager engine with KV
space in GiB, the accelerators' graphs and memory share. The settings a config leaves unset
become the backend's, the ones it states win, and a setting the backend has no use for is refused
by name, when the job is built. The accelerator configs state theirs.

The CPU's prefills are whole: a seeded request's split prefill killed its engine
(`test_agent_loop.py` rolls seeded trajectories out on real instances).

The cuda and ascend plugins must be installed (scripts/setup_env.sh installs them); no GPU is
needed: nothing here starts an engine."""

from __future__ import annotations

import os

import pytest

from libra.backends import get_backend
from libra.config import LibraConfig, load_config, load_from_file
from libra.job.loop import GrpoJob
from libra.rollout.config import InstanceConfig
from libra.rollout.engine import InstanceEngine, configure_vllm_env, engine_kwargs
from tests.job.test_configs import GPU_JOB_CONFIGS


@pytest.fixture
def scratch_env(monkeypatch):
    """`configure_vllm_env` writes the process environment: give it a copy, restored after."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
        os.environ.pop(name, None)


@pytest.mark.parametrize(
    ("backend", "kv_space", "eager", "memory", "chunked"),
    [("cpu", "1", True, None, False), ("cuda", None, False, 0.9, True), ("ascend", None, False, 0.9, True)],
)
def test_unset_settings_are_the_backends_and_reach_vllm(
    scratch_env, backend, kv_space, eager, memory, chunked
):
    config = InstanceConfig(model="/m").for_backend(get_backend(backend))
    assert config.engine_settings_decided
    configure_vllm_env(config)
    assert os.environ.get("VLLM_CPU_KVCACHE_SPACE") == kv_space
    kwargs = engine_kwargs(config)
    assert kwargs["enforce_eager"] is eager
    assert kwargs.get("gpu_memory_utilization") == memory  # the CPU engine has no memory share
    assert kwargs["enable_chunked_prefill"] is chunked


def test_stated_settings_win_over_the_backends():
    stated = InstanceConfig(model="/m", enforce_eager=True, gpu_memory_utilization=0.4, chunked_prefill=False)
    assert stated.for_backend(get_backend("cuda")) == stated
    cpu = InstanceConfig(model="/m", kv_cache_gib=3, enforce_eager=False, chunked_prefill=True)
    cpu = cpu.for_backend(get_backend("cpu"))
    assert (cpu.kv_cache_gib, cpu.enforce_eager, cpu.chunked_prefill) == (3, False, True)


@pytest.mark.parametrize(
    ("backend", "stated", "message"),
    [
        (
            "cuda",
            {"kv_cache_gib": 4},
            "rollout.instance.kv_cache_gib does not apply to the cuda backend, whose engine is sized "
            "by rollout.instance.gpu_memory_utilization",
        ),
        (
            "cpu",
            {"gpu_memory_utilization": 0.5},
            "rollout.instance.gpu_memory_utilization does not apply to the cpu backend",
        ),
    ],
)
def test_a_setting_the_backend_cannot_use_is_refused(backend, stated, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        InstanceConfig(model="/m", **stated).for_backend(get_backend(backend))
    # ... also when a job is built from a whole config, before any process starts.
    override = f"rollout.instance.{next(iter(stated))}={next(iter(stated.values()))}"
    path = "configs/qwen3_4b_r2e.py" if backend == "cuda" else "configs/tiny_cpu.py"
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        GrpoJob(load_config(path, [override]))


def test_a_shared_device_needs_a_memory_share_that_leaves_room():
    shared = ["backend.slots_per_device=2"]
    with pytest.raises(ValueError, match=r"with backend\.slots_per_device=2 it must be at most 0\.50"):
        GrpoJob(load_config("configs/qwen3_4b_r2e.py", shared))  # the config's 0.9
    job = GrpoJob(
        load_config("configs/qwen3_4b_r2e.py", [*shared, "rollout.instance.gpu_memory_utilization=0.3"])
    )
    assert job.config.rollout.instance.gpu_memory_utilization == 0.3
    with pytest.raises(ValueError, match="backend.slots_per_device does not apply to the cpu backend"):
        load_config("configs/tiny_cpu.py", shared)


@pytest.mark.parametrize("bad", [{"gpu_memory_utilization": 0.0}, {"gpu_memory_utilization": 1.5}])
def test_a_memory_share_outside_0_1_is_named(bad):
    with pytest.raises(ValueError, match=r"rollout\.instance\.gpu_memory_utilization must be in \(0, 1\]"):
        InstanceConfig(**bad)


def test_an_engine_refuses_settings_no_backend_decided():
    with pytest.raises(ValueError, match=r"InstanceConfig\.for_backend"):
        InstanceEngine(InstanceConfig(model="/m"))
    with pytest.raises(ValueError, match=r"InstanceConfig\.for_backend"):
        configure_vllm_env(InstanceConfig())


def test_the_job_states_the_engine_settings_it_runs():
    job = GrpoJob(load_config("configs/tiny_cpu.py"))
    instance = job.config.rollout.instance
    assert (instance.kv_cache_gib, instance.enforce_eager, instance.gpu_memory_utilization) == (1, True, None)
    assert instance.chunked_prefill is False


@pytest.mark.parametrize("name", GPU_JOB_CONFIGS)
def test_the_accelerator_configs_state_their_engine_settings(name):
    """Stated in the file, not left to the backend: a reader of the config sees how its engines run."""
    stated = load_from_file(f"configs/{name}.py", "config", LibraConfig).rollout.instance
    assert (stated.enforce_eager, stated.gpu_memory_utilization, stated.chunked_prefill) == (False, 0.9, True)
    assert stated.for_backend(get_backend("cuda")) == stated
