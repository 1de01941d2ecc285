"""PublishWeights on real train ranks (Megatron TP=2, two worker processes, gloo): the shards of
both ranks are gathered to the publishing rank, resharded into shared memory for rollout TP=1
and TP=2, and every published buffer equals vLLM's own slicing of the trainer's HF export bit for
bit; released versions' buffers are gone. ~30 s on 2 cores (process start-up, one train step)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from libra.control.config import ControlConfig
from libra.job.trainer import TrainRanks
from tests.sync.reference_reshard import hf_to_vllm
from tests.training.test_worker import TOKEN, call_all, ranks  # noqa: F401 - the TP=2 ranks fixture
from tests.training.tiny_models import make_batch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _published_params(load) -> list[dict[str, torch.Tensor]]:
    """Per destination rank, its params viewed out of the shared-memory buffer."""
    out = []
    for rank in load.ranks:
        flat = torch.frombuffer(bytearray(Path(rank.handle["path"]).read_bytes()), dtype=torch.float32)
        out.append({p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in rank.manifest.params})
    return out


def test_publish_weights_gathers_tp_shards_and_matches_the_export(ranks):  # noqa: F811
    from safetensors.torch import load

    from libra.model_spec import ModelSpec
    from libra.sync.layouts import ModelShape
    from libra.training.worker import trajectory_to_proto
    from libra.v1 import training_pb2

    stubs, root, model = ranks
    trainer = TrainRanks(
        [f"127.0.0.1:{(root / f'port{r}').read_text()}" for r in range(2)], TOKEN, ControlConfig()
    )
    paths: list[Path] = []
    try:
        batch = [trajectory_to_proto(t) for t in make_batch(seed=7)]
        version = call_all(stubs, "TrainStep", training_pb2.TrainStepRequest(trajectories=batch))[0].version
        with pytest.raises(grpc.RpcError) as wrong:
            trainer.publish_weights(version + 1, [1])
        assert (
            wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "trainer's version" in wrong.value.details()
        )

        published = trainer.publish_weights(version, [1, 2])
        assert published.version == version and sorted(published.loads) == [1, 2]
        paths += [Path(r.handle["path"]) for load_ in published.loads.values() for r in load_.ranks]
        hf = load(call_all(stubs, "ExportWeights", training_pb2.ExportWeightsRequest())[0].safetensors)
        shape = ModelShape.from_spec(ModelSpec.from_hf_dir(model))
        for tp, load_request in published.loads.items():
            assert load_request.version == version and load_request.tp_size == tp
            for rank, (got, expected) in enumerate(
                zip(_published_params(load_request), hf_to_vllm(hf, shape, tp), strict=True)
            ):
                assert set(got) == set(expected), (tp, rank)
                for name, tensor in expected.items():
                    assert torch.equal(got[name].view(torch.int32), tensor.view(torch.int32)), (
                        tp,
                        rank,
                        name,
                    )

        # The next version, releasing this one: its shared-memory files go.
        fresh = [trajectory_to_proto(t) for t in make_batch(seed=8)]
        for t in fresh:
            t.policy_versions[:] = [version if v >= 0 else v for v in t.policy_versions]
        call_all(stubs, "TrainStep", training_pb2.TrainStepRequest(trajectories=fresh))
        newer = trainer.publish_weights(version + 1, [1], release_versions=[version])
        paths += [Path(r.handle["path"]) for r in newer.loads[1].ranks]
        assert not any(p.exists() for p in paths[:-1]) and paths[-1].exists()
    finally:
        trainer.close()
        for path in paths:  # the fixture SIGKILLs the ranks, which leaves no chance to clean up
            path.unlink(missing_ok=True)
