"""One rank of a Megatron TP=2 training job for the weight-publication tests (run by
`tests.training.jobs.run_job(spec, out_dir, script=...)`).

Loads the HF model, takes one GRPO step, then rank 0 saves: every TP rank's Megatron params
(the publisher's input, keyed (tp rank, pp stage, name)), the trainer's own HF export of the same
weights, and the trainer's per-token logprobs of fixed trajectories (the train side of the
train/inference gap).
"""

from __future__ import annotations

import json
import sys


def main(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    from libra.backends import get_backend

    get_backend("cpu").prepare_worker()
    from megatron.core import parallel_state as ps

    from libra.model_spec import ModelSpec
    from libra.training.config import GrpoConfig, TrainingConfig
    from libra.training.engine import TrainEngine
    from libra.training.hf_weights import hf_tensor_reader
    from libra.training.model import ModelArchitecture
    from libra.training.parallel import initialize, shutdown
    from tests.training.tiny_models import make_batch

    tp = spec["tp"]
    info = initialize(
        tp, 1, rank=spec["rank"], world_size=tp, master_addr="127.0.0.1", master_port=spec["port"], seed=1234
    )
    model_dir = spec["models"][0]
    arch = ModelArchitecture.from_spec(ModelSpec.from_hf_dir(model_dir))
    cfg = TrainingConfig(
        tensor_parallel=tp,
        pipeline_parallel=1,
        data_parallel=1,
        lr=1e-2,  # large, so that the published version clearly differs from the checkpoint
        num_minibatches=1,
        max_tokens_per_microbatch=256,
        train_batch_size=12,
        grpo=GrpoConfig(kl_coef=0.0),
    )
    engine = TrainEngine(arch, cfg, info)
    engine.load_hf(hf_tensor_reader(model_dir))
    engine.train_step(make_batch(seed=11, vocab=arch.vocab_size))
    local = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    gathered: list[dict] = [None] * tp  # type: ignore[list-item]
    dist.all_gather_object(gathered, local, group=ps.get_tensor_model_parallel_group())
    probe = make_batch(seed=spec["probe_seed"], num_groups=1, group_size=2, vocab=arch.vocab_size)
    logprobs = engine.compute_logprobs(probe)
    hf = engine.export_hf()
    if info.rank == 0:
        shards = {(r, 0, name): tensor for r, part in enumerate(gathered) for name, tensor in part.items()}
        torch.save(
            {
                "shards": shards,
                "hf": hf,
                "probe": probe,
                "trainer_logprobs": logprobs,
                "version": engine.version,
            },
            f"{spec['out_dir']}/result.pt",
        )
    shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
