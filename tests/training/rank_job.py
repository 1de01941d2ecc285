"""One rank of a multi-process training test job (run as a script by `jobs.run_job`).

`python rank_job.py SPEC_JSON` where the spec names the HF model, the parallelism, the steps to
run and where to save results. Rank 0 writes `result.pt` in the spec's out_dir.
"""

from __future__ import annotations

import json
import sys


def batch_for_step(step: int):
    from tests.training.tiny_models import make_batch

    batch = make_batch(seed=100 + step)
    for t in batch:  # sampled one version behind the trainer, as in one-step-off async RL
        t.policy_versions = [max(step - 1, 0) if v >= 0 else v for v in t.policy_versions]
    if step == 3:  # far too stale: the gate (max_staleness=1) drops it
        batch[0].policy_versions = [0 if v >= 0 else v for v in batch[0].policy_versions]
    if step == 4:  # a thin batch: mini-batches of 1 and 2 trajectories leave DP shares empty
        batch = batch[:3]
    return batch


def main(spec: dict) -> None:
    import torch

    from libra.backends import get_backend

    get_backend("cpu").prepare_worker()
    from libra.model_spec import ModelSpec
    from libra.training.config import GrpoConfig, TrainingConfig
    from libra.training.engine import TrainEngine
    from libra.training.hf_weights import hf_tensor_reader
    from libra.training.model import ModelArchitecture
    from libra.training.parallel import initialize, shutdown
    from tests.training.tiny_models import make_batch

    tp, pp, dp = spec["tp"], spec["pp"], spec["dp"]
    info = initialize(
        tp,
        pp,
        rank=spec["rank"],
        world_size=tp * pp * dp,
        master_addr="127.0.0.1",
        master_port=spec["port"],
        seed=1234,
    )
    results: dict = {}
    for model_dir in spec["models"]:
        arch = ModelArchitecture.from_spec(ModelSpec.from_hf_dir(model_dir))
        cfg = TrainingConfig(
            tensor_parallel=tp,
            pipeline_parallel=pp,
            data_parallel=dp,
            lr=1e-3,
            adam_eps=1e-6,
            num_minibatches=2,
            max_tokens_per_microbatch=spec.get("max_tokens_per_microbatch", 96),
            use_distributed_optimizer=spec.get("use_distributed_optimizer", True),
            overlap_grad_reduce=spec.get("overlap_grad_reduce", False),
            recompute=spec.get("recompute", "none"),
            max_staleness=1,
            train_batch_size=12,
            grpo=GrpoConfig(
                clip_high=0.28, kl_coef=0.05, entropy_coef=0.01, temperature=spec.get("temperature", 1.0)
            ),
        )
        engine = TrainEngine(arch, cfg, info)
        out: dict = {"losses": [], "steps": []}
        start = 0
        primary = model_dir == spec["models"][0]
        if primary and spec.get("resume"):
            engine.load_checkpoint(spec["resume"])
            start = engine.version
            out["restored_staleness"] = engine.gate.state_dict()
        else:
            engine.load_hf(hf_tensor_reader(model_dir))
        out["logprobs_start"] = engine.compute_logprobs(make_batch(seed=7))
        for step in range(start, spec["steps"]):
            if primary and spec.get("save_at") == step:
                # Fill the rollout capacity: these in-flight rollouts die with the restart.
                engine.gate.try_start(engine.gate.capacity())
                out["saved_staleness"] = engine.gate.state_dict()
                engine.save_checkpoint(spec["save_dir"])
            result = engine.train_step(batch_for_step(step))
            out["losses"].append(result.loss)
            out["steps"].append(result.__dict__)
        out["logprobs_end"] = engine.compute_logprobs(make_batch(seed=7))
        out["optimizer_bytes"] = engine.optimizer_state_bytes()
        out["num_params"] = sum(p.numel() for p in engine.model.parameters())
        out["export"] = engine.export_hf() if spec.get("export") else None
        results[model_dir] = out
    if info.rank == 0:
        torch.save(results, f"{spec['out_dir']}/result.pt")
    shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
