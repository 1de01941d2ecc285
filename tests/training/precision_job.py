"""bf16 against fp32 on one rank (run as a script by test_bf16.py).

Two measurements on the same tiny Qwen3 and the same batches:
1. `small_lr`: one GRPO step at lr 1e-6; which elements of the optimizer's main parameters (fp32
   copies for a bf16 model) changed, per dtype.
2. `run`: `steps` GRPO steps at the spec's lr; per-step losses, grad norms, and per-token
   logprobs of a fixed batch before and after, per dtype. The bf16 run saves a checkpoint halfway;
   a fresh engine resumes from it and runs the second half again (`resumed_losses`).
"""

from __future__ import annotations

import json
import sys


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
    from tests.training.rank_job import batch_for_step
    from tests.training.tiny_models import make_batch

    info = initialize(1, 1, rank=0, world_size=1, master_addr="127.0.0.1", master_port=spec["port"])
    arch = ModelArchitecture.from_spec(ModelSpec.from_hf_dir(spec["model"]))

    def engine(dtype: str, lr: float) -> TrainEngine:
        cfg = TrainingConfig(
            dtype=dtype,
            lr=lr,
            num_minibatches=2,
            max_tokens_per_microbatch=96,
            train_batch_size=12,
            grpo=GrpoConfig(clip_high=0.28),
        )
        e = TrainEngine(arch, cfg, info)
        e.load_hf(hf_tensor_reader(spec["model"]))
        return e

    out: dict = {"small_lr": {}, "run": {}}
    for dtype in ("float32", "bfloat16"):
        e = engine(dtype, 1e-6)
        before = [p.detach().clone() for p in e.main_parameters()]
        model_before = [p.detach().clone() for p in e.model.parameters()]
        e.train_step(batch_for_step(1))
        out["small_lr"][dtype] = {
            "main_changed": [(p != b).cpu() for p, b in zip(e.main_parameters(), before, strict=True)],
            "main_dtypes": sorted({str(p.dtype) for p in e.main_parameters()}),
            "model_dtypes": sorted({str(p.dtype) for p in e.model.parameters()}),
            "model_changed_fraction": sum(
                (p != b).sum().item() for p, b in zip(e.model.parameters(), model_before, strict=True)
            )
            / sum(p.numel() for p in model_before),
        }
        e = engine(dtype, spec["lr"])
        record = {"losses": [], "grad_norms": [], "logprobs_start": e.compute_logprobs(make_batch(seed=7))}
        halfway = spec["steps"] // 2
        checkpoint = f"{spec['out_dir']}/ckpt_{dtype}"
        for step in range(1, spec["steps"] + 1):
            if dtype == "bfloat16" and step == halfway + 1:
                e.save_checkpoint(checkpoint)
            result = e.train_step(batch_for_step(step))
            record["losses"].append(result.loss)
            record["grad_norms"].append(result.grad_norm)
        record["logprobs_end"] = e.compute_logprobs(make_batch(seed=7))
        record["optimizer_bytes"] = e.optimizer_state_bytes()
        record["num_params"] = sum(p.numel() for p in e.model.parameters())
        if dtype == "bfloat16":
            resumed = engine(dtype, spec["lr"])
            resumed.load_checkpoint(checkpoint)
            steps = range(halfway + 1, spec["steps"] + 1)
            record["resumed_losses"] = [resumed.train_step(batch_for_step(step)).loss for step in steps]
        out["run"][dtype] = record
    torch.save(out, f"{spec['out_dir']}/result.pt")
    shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
