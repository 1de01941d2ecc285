"""A tiny GRPO run with a verifiable reward (run as a script by test_learning.py).

Task: the prompt is one token p in [2, 16); the policy answers 4 tokens and earns the fraction of
them with the same parity as p. A random policy scores about 0.5. Rollout is a transformers copy
of the policy, refreshed from `export_hf()` after every step (the trainer -> rollout weight flow),
sampling at temperature 1; trajectories carry the sampler's logprobs and policy version.
"""

from __future__ import annotations

import json
import sys

VOCAB = 16
RESPONSE_TOKENS = 4


def sample_groups(hf_model, engine_version: int, generator, num_prompts: int, group_size: int):
    import torch

    from libra.trajectory import Trajectory

    prompts = torch.randint(2, VOCAB, (num_prompts,), generator=generator).repeat_interleave(group_size)
    ids = prompts[:, None]
    logprobs = []
    with torch.no_grad():
        for _ in range(RESPONSE_TOKENS):
            logp = torch.log_softmax(hf_model(ids).logits[:, -1].float(), dim=-1)
            token = torch.multinomial(logp.exp(), 1, generator=generator)
            logprobs.append(logp.gather(-1, token))
            ids = torch.cat([ids, token], dim=1)
    logprobs = torch.cat(logprobs, dim=1)
    batch = []
    for i in range(ids.shape[0]):
        p, response = int(ids[i, 0]), ids[i, 1:].tolist()
        t = Trajectory(
            trajectory_id=f"t{i}",
            prompt_id=f"p{i // group_size}",
            group_id=f"g{i // group_size}",
            prompt_token_ids=[p],
        )
        t.append(response, logprobs[i].tolist(), policy_version=engine_version)
        t.reward = sum((r - p) % 2 == 0 for r in response) / RESPONSE_TOKENS
        batch.append(t)
    return batch


def main(spec: dict) -> None:
    import torch

    from libra.backends import get_backend

    get_backend("cpu").prepare_worker()
    from transformers import AutoModelForCausalLM

    from libra.model_spec import ModelSpec
    from libra.training.config import GrpoConfig, TrainingConfig
    from libra.training.engine import TrainEngine
    from libra.training.hf_weights import hf_tensor_reader
    from libra.training.model import ModelArchitecture
    from libra.training.parallel import initialize, shutdown

    info = initialize(1, 1, rank=0, world_size=1, master_addr="127.0.0.1", master_port=spec["port"])
    hf_model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    arch = ModelArchitecture.from_spec(ModelSpec.from_hf_dir(spec["model"]))
    cfg = TrainingConfig(
        dtype=spec.get("dtype", "float32"),
        lr=spec["lr"],
        max_staleness=1,
        train_batch_size=spec["num_prompts"] * spec["group_size"],
        grad_clip=1.0,
        grpo=GrpoConfig(clip_high=0.28),
    )
    engine = TrainEngine(arch, cfg, info)
    engine.load_hf(hf_tensor_reader(spec["model"]))
    generator = torch.Generator().manual_seed(spec["seed"])
    rewards = []
    for _ in range(spec["steps"]):
        hf_model.load_state_dict(engine.export_hf(), strict=True)
        batch = sample_groups(hf_model, engine.version, generator, spec["num_prompts"], spec["group_size"])
        rewards.append(sum(t.reward for t in batch) / len(batch))
        engine.train_step(batch)
    torch.save({"rewards": rewards}, f"{spec['out_dir']}/result.pt")
    shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
