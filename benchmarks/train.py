"""Trained tokens/s and peak memory per rank of the train ranks on the CPU: Megatron's own
machinery (DDP, `get_megatron_optimizer`, `get_forward_backward_func`; `libra.training.engine`)
against the hand-rolled path it replaced (gradients all-reduced parameter by parameter, torch
AdamW on the model's parameters, micro-batches run forward then straight back), at the same
layouts, in one run.

    python benchmarks/train.py [--steps 4] [--batch 8] [--seq 256]

The baseline is the engine of commit `HANDROLLED_COMMIT`, read from git history (run from a
clone) and imported beside the current one; both build the same Megatron `GPTModel`. The model is
a ~10M-parameter Llama (hidden 256, 8 layers, 8 heads / 4 KV heads, ffn 704, vocab 8192), fp32
unless the row says bf16. Every configuration runs alone (nothing else of this benchmark runs
concurrently); each process uses 1 OpenMP thread, as the cpu backend gives a one-core slot. A step
is one GRPO optimizer step over `batch` trajectories of `seq` tokens (prompt 32), with pi_old
recomputed first (as in training); tokens/s counts the trajectory tokens of the batch. PP=2 runs 4
micro-batches per step. Reported: the median step after one warm-up step, and the largest peak
RSS of the job's ranks.
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
HANDROLLED_COMMIT = "d44edd9"
"""The last commit whose `libra/training/engine.py` reduced gradients by hand."""


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


def handrolled_engine_class():
    """`TrainEngine` as of `HANDROLLED_COMMIT`, imported under another module name."""
    import importlib.util

    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{HANDROLLED_COMMIT}:libra/training/engine.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "handrolled_engine.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("handrolled_engine", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.TrainEngine


def rank_main(spec: dict) -> None:
    import resource

    from libra.backends import get_backend

    get_backend("cpu").prepare_worker()
    from libra.model_spec import ModelSpec
    from libra.training.config import TrainingConfig
    from libra.training.engine import TrainEngine
    from libra.training.hf_weights import hf_tensor_reader
    from libra.training.model import ModelArchitecture
    from libra.training.parallel import initialize, shutdown

    tp, pp, dp = spec["tp"], spec["pp"], spec["dp"]
    info = initialize(
        tp, pp, rank=spec["rank"], world_size=tp * pp * dp, master_addr="127.0.0.1", master_port=spec["port"]
    )
    arch = ModelArchitecture.from_spec(ModelSpec.from_hf_dir(spec["model"]))
    cfg = TrainingConfig(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=dp,
        dtype=spec["dtype"],
        lr=1e-5,
        max_staleness=10**6,
        train_batch_size=spec["batch"],
        max_tokens_per_microbatch=spec["seq"] * spec["batch"] // (4 if pp > 1 else 1),
        overlap_grad_reduce=spec["overlap"],
    )
    engine_class = TrainEngine if spec["engine"] == "megatron" else handrolled_engine_class()
    engine = engine_class(arch, cfg, info)
    engine.load_hf(hf_tensor_reader(spec["model"]))
    batch = make_batch(spec["batch"], spec["seq"])
    times = []
    for _ in range(spec["steps"] + 1):
        start = time.perf_counter()
        engine.train_step(batch)
        times.append(time.perf_counter() - start)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"step_s": statistics.median(times[1:]), "peak_mib": peak_mib}), flush=True)
    shutdown()


def run_ranks(spec: dict, world: int) -> tuple[float, float]:
    """(rank 0's median step seconds, the largest peak RSS of the ranks in MiB)."""
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
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    return results[0]["step_s"], max(r["peak_mib"] for r in results)


LAYOUTS = (
    # (name, tp, pp, dp, dtype, overlap)
    ("TP=1", 1, 1, 1, "float32", False),
    ("TP=2", 2, 1, 1, "float32", False),
    ("PP=2 (4 micro)", 1, 2, 1, "float32", False),
    ("DP=2", 1, 1, 2, "float32", False),
    ("DP=2 overlap", 1, 1, 2, "float32", True),
    ("TP=1 bf16", 1, 1, 1, "bfloat16", False),
)


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
        print(f"model ~10M params, batch {args.batch} x {args.seq} tokens, median of {args.steps} steps")
        print(f"{'layout':<16}{'path':<12}{'step s':>8}{'tok/s':>8}{'peak MiB':>10}{'speed vs hand':>15}")
        for name, tp, pp, dp, dtype, overlap in LAYOUTS:
            layout = {**spec, "tp": tp, "pp": pp, "dp": dp, "dtype": dtype, "overlap": overlap}
            # The hand-rolled path has no overlap (nor fp32 main parameters for bf16): its row is
            # the same layout without them.
            hand_s, hand_mib = run_ranks({**layout, "engine": "handrolled"}, tp * pp * dp)
            mega_s, mega_mib = run_ranks({**layout, "engine": "megatron"}, tp * pp * dp)
            hand = f"{hand_s:>8.2f}{tokens / hand_s:>8.0f}{hand_mib:>10.0f}"
            print(f"{name:<16}{'hand-rolled':<12}{hand}{1.0:>15.2f}")
            print(
                f"{'':<16}{'Megatron':<12}{mega_s:>8.2f}{tokens / mega_s:>8.0f}{mega_mib:>10.0f}"
                f"{hand_s / mega_s:>15.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
