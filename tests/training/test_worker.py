"""The TrainRank gRPC service: two real worker processes (TP=2) behind bearer-token auth; every
call goes to both ranks at once, as the controller does."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from libra.training.config import TrainingConfig
from libra.training.worker import TrainRankSpec
from tests.training.jobs import free_port
from tests.training.tiny_models import make_batch, make_hf_model

NUM_CPUS = 2
TOKEN = "test-token"

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from libra.control.auth import open_channel
    from libra.v1 import training_pb2_grpc

    root = tmp_path_factory.mktemp("worker")
    model = make_hf_model("qwen2", root / "model", tie=True, seed=5)
    master = free_port()
    env = {**os.environ, "LIBRA_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = []
    for rank in range(2):
        spec = TrainRankSpec(
            hf_model=str(model),
            rank=rank,
            master_port=master,
            training=TrainingConfig(lr=0.001, max_staleness=0, train_batch_size=12, tensor_parallel=2),
            port_file=str(root / f"port{rank}"),
        )
        cmd = spec.to_argv()
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(root / f"rank{rank}.log", "w")
            )
        )
    deadline = time.monotonic() + 120
    while not all((root / f"port{r}").exists() for r in range(2)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            logs = "\n".join((root / f"rank{r}.log").read_text()[-2000:] for r in range(2))
            for p in procs:
                p.kill()
            raise AssertionError(f"train ranks did not start:\n{logs}")
        time.sleep(0.2)
    channels = [open_channel(f"127.0.0.1:{(root / f'port{r}').read_text()}", TOKEN) for r in range(2)]
    yield [training_pb2_grpc.TrainRankStub(c) for c in channels], root, str(model)
    for c in channels:
        c.close()
    for p in procs:
        p.kill()
        p.wait()


def call_all(stubs, method: str, request):
    with ThreadPoolExecutor(len(stubs)) as pool:
        return list(pool.map(lambda stub: getattr(stub, method)(request, timeout=120), stubs))


def test_logprobs_train_export_checkpoint(ranks):
    from safetensors.torch import load

    from libra.training.worker import trajectory_to_proto
    from libra.v1 import training_pb2
    from tests.training.test_parallel_equivalence import hf_logprobs, max_diff

    stubs, root, model = ranks
    batch = [trajectory_to_proto(t) for t in make_batch(seed=7)]
    replies = call_all(stubs, "ComputeLogprobs", training_pb2.ComputeLogprobsRequest(trajectories=batch))
    got = [list(t.logprobs) for t in replies[0].trajectories]
    assert got == [list(t.logprobs) for t in replies[1].trajectories]
    assert max_diff(got, hf_logprobs(model, temperature=1.0)) <= 1e-5

    step = call_all(stubs, "TrainStep", training_pb2.TrainStepRequest(trajectories=batch))
    assert step[0].version == step[1].version == 1
    assert step[0].loss == step[1].loss and step[0].num_trajectories == 12
    # (version 1 + max_staleness 0 + 1) x 12 slots, 12 used by the batch (counted on arrival).
    assert step[0].rollout_capacity == 12

    exported = call_all(stubs, "ExportWeights", training_pb2.ExportWeightsRequest())
    tensors = load(exported[0].safetensors)
    assert exported[0].version == 1 and "model.embed_tokens.weight" in tensors

    # Save at version 1 (TP=2, through the gRPC server: the writer must not fork there), train
    # one step, load the checkpoint back and train the same step again: same loss, same version.
    ckpt = str(root / "ckpt_v1")
    saved = call_all(stubs, "SaveCheckpoint", training_pb2.CheckpointRequest(directory=ckpt))
    assert saved[0].version == saved[1].version == 1
    fresh = [trajectory_to_proto(t) for t in make_batch(seed=8)]
    for t in fresh:
        t.policy_versions[:] = [1 if v >= 0 else v for v in t.policy_versions]
    first = call_all(stubs, "TrainStep", training_pb2.TrainStepRequest(trajectories=fresh))
    assert first[0].version == 2 and first[0].num_trajectories == 12
    loaded = call_all(stubs, "LoadCheckpoint", training_pb2.CheckpointRequest(directory=ckpt))
    assert loaded[0].version == loaded[1].version == 1
    again = call_all(stubs, "TrainStep", training_pb2.TrainStepRequest(trajectories=fresh))
    assert again[0].version == 2 and again[0].num_trajectories == 12
    assert abs(again[0].loss - first[0].loss) <= 1e-6, (again[0].loss, first[0].loss)
    assert abs(again[0].grad_norm - first[0].grad_norm) <= 1e-5 * max(1.0, first[0].grad_norm)

    # Version 0 data at trainer version 2 with max_staleness 0: all dropped as stale.
    stale = call_all(stubs, "TrainStep", training_pb2.TrainStepRequest(trajectories=batch))
    assert stale[0].num_dropped_stale == 12 and stale[0].num_trajectories == 0


def test_bad_requests_are_invalid_argument(ranks):
    from libra.v1 import training_pb2

    stubs, _, _ = ranks
    with pytest.raises(grpc.RpcError) as err:
        stubs[0].TrainStep(training_pb2.TrainStepRequest(), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = training_pb2.TrainTrajectory(
        trajectory_id="x",
        group_id="g",
        prompt_token_ids=[1],
        response_token_ids=[2, 3],
        loss_mask=[1],
        rollout_logprobs=[0.0],
        policy_versions=[0],
    )
    with pytest.raises(grpc.RpcError) as err:
        stubs[0].ComputeLogprobs(training_pb2.ComputeLogprobsRequest(trajectories=[bad]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "loss_mask" in err.value.details()


def test_unauthenticated_call_is_refused(ranks):
    from libra.v1 import training_pb2

    stubs, root, _ = ranks
    channel = grpc.insecure_channel(f"127.0.0.1:{(root / 'port0').read_text()}")
    from libra.v1 import training_pb2_grpc

    with pytest.raises(grpc.RpcError) as err:
        training_pb2_grpc.TrainRankStub(channel).ExportWeights(
            training_pb2.ExportWeightsRequest(), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()
