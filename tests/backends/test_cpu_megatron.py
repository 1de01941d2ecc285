"""`CpuBackend.prepare_worker` makes megatron-core (local layer spec) train on the CPU.

Each check runs in a child process started with the cpu backend's worker environment, like a real
train rank: the patches are process-global and must not leak into the test process. Run as a
script, this file is that child (`python test_cpu_megatron.py MODE RENDEZVOUS_FILE`) and prints
one JSON line of results.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

NUM_CPUS = 1
CHILD_TIMEOUT_S = 120

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed",
)


@pytest.fixture(scope="module")
def children(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.Popen]]:
    """Both children start at once: each spends most of its ~6 s importing torch and Megatron."""
    from libra.backends import get_backend

    env = dict(os.environ)
    env.update(get_backend("cpu", num_devices=1).worker_env([0]))
    env["OMP_NUM_THREADS"] = str(NUM_CPUS)
    started = {}
    for mode in ("train", "imported-first"):
        rendezvous = tmp_path_factory.mktemp(mode) / "rendezvous"
        command = [sys.executable, __file__, mode, str(rendezvous)]
        started[mode] = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    yield started
    for child in started.values():
        if child.poll() is None:
            child.kill()
            child.wait()


def _result(child: subprocess.Popen) -> dict:
    stdout, stderr = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, f"child failed:\n{stderr[-4000:]}"
    return json.loads(stdout.strip().splitlines()[-1])


def test_tiny_gpt_trains_with_adamw_after_prepare_worker(children: dict[str, subprocess.Popen]) -> None:
    result = _result(children["train"])

    assert result["tracker"] == "CpuRNGStatesTracker"
    assert result["param_devices"] == ["cpu"]
    losses = result["losses"]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]  # AdamW on one fixed batch must make progress
    assert result["grad_norm"] > 0
    # Same seed, same losses: the RNG tracker over the CPU generator is deterministic.
    assert result["losses_rerun"] == losses


def test_patches_reach_megatron_modules_imported_before_prepare_worker(
    children: dict[str, subprocess.Popen],
) -> None:
    result = _result(children["imported-first"])

    assert result["tracker"] == "CpuRNGStatesTracker"
    assert result["mask_device"] == "cpu"
    assert result["optimizer_tensor_device"] == result["schedules_tensor_device"] == "cpu"
    assert result["clipping_patched"]
    # The model-parallel state is seeded apart from the default one, and forking it twice draws
    # fresh numbers (its state advances) while leaving the default generator alone.
    assert result["fork_a"] != result["fork_b"]
    assert result["default_after_forks"] == result["default_without_forks"]


# -- the child ----------------------------------------------------------------------------------


def _init_megatron(rendezvous: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", world_size=1, rank=0)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def _train_tiny_gpt(seed: int) -> tuple[list[float], float, set[str]]:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        attention_dropout=0.1,  # exercises the tracker's fork in every forward
        hidden_dropout=0.1,
        use_cpu_initialization=False,  # init on torch.cuda.current_device(), i.e. patch 1
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 16))
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(inputs.shape[1]).expand_as(inputs).contiguous()
    losses = []
    grad_norm = 0.0
    for _ in range(3):
        # attention_mask=None: the local attention builds its causal mask itself (patch 3).
        loss = model(inputs, positions, None, labels=labels).mean()
        optimizer.zero_grad()
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        optimizer.step()
        losses.append(loss.item())
    return losses, grad_norm, {p.device.type for p in model.parameters()}


def _child_train(rendezvous: str) -> dict:
    from libra.backends import get_backend

    backend = get_backend("cpu", num_devices=1)
    backend.prepare_worker()
    backend.prepare_worker()  # idempotent
    _init_megatron(rendezvous)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    losses, grad_norm, devices = _train_tiny_gpt(seed=1234)
    losses_rerun, _, _ = _train_tiny_gpt(seed=1234)
    return {
        "tracker": type(get_cuda_rng_tracker()).__name__,
        "losses": losses,
        "losses_rerun": losses_rerun,
        "grad_norm": grad_norm,
        "param_devices": sorted(devices),
    }


def _child_imported_first(rendezvous: str) -> dict:
    import torch
    from megatron.core.fusions import fused_softmax
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mp_random

    from libra.backends import get_backend

    get_backend("cpu", num_devices=1).prepare_worker()
    _init_megatron(rendezvous)
    mp_random.model_parallel_cuda_manual_seed(7)
    tracker = mp_random.get_cuda_rng_tracker()

    torch.manual_seed(0)
    default_without_forks = torch.rand(2).tolist()
    torch.manual_seed(0)
    with tracker.fork():
        fork_a = torch.rand(2).tolist()
    with tracker.fork():
        fork_b = torch.rand(2).tolist()
    default_after_forks = torch.rand(2).tolist()
    return {
        "tracker": type(tracker).__name__,
        "mask_device": fused_softmax.get_default_causal_mask(4).device.type,
        # Patch 3's literal device="cuda" tensors of the optimizer and the schedules.
        "optimizer_tensor_device": megatron_optimizer.torch.tensor([1.0], device="cuda").device.type,
        "schedules_tensor_device": schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type,
        "clipping_patched": getattr(
            megatron_optimizer.clip_grad_by_total_norm_fp32, "_libra_cpu_patch", False
        ),
        "fork_a": fork_a,
        "fork_b": fork_b,
        "default_without_forks": default_without_forks,
        "default_after_forks": default_after_forks,
    }


if __name__ == "__main__":
    mode, rendezvous_file = sys.argv[1], sys.argv[2]
    children = {"train": _child_train, "imported-first": _child_imported_first}
    print(json.dumps(children[mode](rendezvous_file)))
