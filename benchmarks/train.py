"""Trained tokens/s of the Megatron train ranks (TP=1, TP=2, DP=2) on the CPU, against a plain
PyTorch implementation of the same model and loss (transformers Llama + the same GRPO loss +
torch AdamW) measured in the same run.

    python benchmarks/train.py [--steps 4] [--batch 8] [--seq 256]

The model is a ~10M-parameter Llama (hidden 256, 8 layers, 8 heads / 4 KV heads, ffn 704,
vocab 8192), fp32. Every configuration runs alone (nothing else of this benchmark runs
concurrently); each process uses 1 OpenMP thread, as the cpu backend gives a one-core slot.
A step is one GRPO optimizer step over `batch` trajectories of `seq` tokens (prompt 32), with
pi_old recomputed first (as in training); tokens/s counts the trajectory tokens of the batch.
Reported: the median step after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PROMPT = 32


def make_model(directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def make_batch(batch: int, seq: int):
    import random

    from libra.trajectory import Trajectory

    rng = random.Random(0)
    out = []
    for i in range(batch):
        t = Trajectory(
            trajectory_id=str(i),
            prompt_id=str(i // 4),
            group_id=str(i // 4),
            prompt_token_ids=[rng.randrange(8192) for _ in range(PROMPT)],
        )
        n = seq - PROMPT
        t.append([rng.randrange(8192) for _ in range(n)], [-9.0] * n, policy_version=0)
        t.reward = float(i % 2)
        out.append(t)
    return out


def rank_main(spec: dict) -> None:
    import torch

    from libra.backends import get_backend

    get_backend("cpu").prepare_worker()
    from transformers import AutoConfig

    from libra.training.config import TrainingConfig
    from libra.training.engine import TrainEngine
    from libra.training.hf_weights import hf_tensor_reader
    from libra.training.model import ModelArchitecture
    from libra.training.parallel import initialize, shutdown

    tp, dp = spec["tp"], spec["dp"]
    info = initialize(
        tp, 1, rank=spec["rank"], world_size=tp * dp, master_addr="127.0.0.1", master_port=spec["port"]
    )
    arch = ModelArchitecture.from_hf_config(AutoConfig.from_pretrained(spec["model"]))
    cfg = TrainingConfig(
        tensor_parallel=tp,
        data_parallel=dp,
        lr=1e-5,
        max_staleness=10**6,
        max_tokens_per_microbatch=spec["seq"] * spec["batch"],
    )
    engine = TrainEngine(arch, cfg, info)
    engine.load_hf(hf_tensor_reader(spec["model"]))
    batch = make_batch(spec["batch"], spec["seq"])
    times = []
    for _ in range(spec["steps"] + 1):
        start = time.perf_counter()
        engine.train_step(batch)
        times.append(time.perf_counter() - start)
    if info.rank == 0:
        print(json.dumps({"step_s": statistics.median(times[1:])}), flush=True)
    shutdown()
    del torch


def plain_pytorch(spec: dict) -> float:
    """The same model and GRPO step in plain PyTorch: transformers Llama, log-softmax logprobs,
    the same loss function, torch AdamW. Returns the median step seconds."""
    import torch
    from transformers import AutoModelForCausalLM

    from libra.training.config import GrpoConfig
    from libra.training.grpo import group_advantages, grpo_token_loss

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = make_batch(spec["batch"], spec["seq"])
    cfg = GrpoConfig()
    ids = torch.tensor([t.token_ids for t in batch])
    targets = ids[:, 1:]
    mask = torch.zeros_like(targets, dtype=torch.float32)
    mask[:, PROMPT - 1 :] = 1.0
    adv = torch.tensor(group_advantages([t.reward for t in batch], [t.group_id for t in batch], cfg))
    adv = adv[:, None].expand_as(mask)
    rollout = torch.full_like(mask, -9.0)

    def logprobs():
        logits = model(ids).logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]

    times = []
    for _ in range(spec["steps"] + 1):
        start = time.perf_counter()
        with torch.no_grad():
            old = logprobs()
        optimizer.zero_grad()
        loss = grpo_token_loss(logprobs(), old, rollout, adv, mask, cfg).loss_sum / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run_ranks(spec: dict, world: int) -> float:
    from tests.training.jobs import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-spec", json.dumps({**spec, "rank": r, "port": port})],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for r in range(world)
    ]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: {[p.returncode for p in procs]}")
    return json.loads(outputs[0].strip().splitlines()[-1])["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rank-spec", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_spec:
        rank_main(json.loads(args.rank_spec))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_model(model)
        spec = {"model": str(model), "steps": args.steps, "batch": args.batch, "seq": args.seq}
        tokens = args.batch * args.seq
        baseline = plain_pytorch(spec)
        print(f"model ~10M params, batch {args.batch} x {args.seq} tokens, median of {args.steps} steps")
        print(f"{'config':<22}{'step s':>8}{'tok/s':>9}{'vs plain':>10}")
        print(f"{'plain PyTorch (1 proc)':<22}{baseline:>8.2f}{tokens / baseline:>9.0f}{1.0:>10.2f}")
        for name, tp, dp in (("Megatron TP=1", 1, 1), ("Megatron TP=2", 2, 1), ("Megatron DP=2", 1, 2)):
            step = run_ranks({**spec, "tp": tp, "dp": dp}, tp * dp)
            print(f"{name:<22}{step:>8.2f}{tokens / step:>9.0f}{baseline / step:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
