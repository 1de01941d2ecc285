"""Check 3: one GRPO step in bf16 with fp32 main parameters against the same step in fp32, from
the same weights on the same batch."""

from __future__ import annotations

import math
import random

from libra.checks.context import TINY_VOCAB, CheckContext
from libra.checks.result import CheckResult
from libra.trajectory import Trajectory

NAME = "bf16 step"
LR = 1e-6
"""An Adam update of ~1e-6 per element is far below half an ulp of a bf16 weight of 0.1 (~2e-4):
stepped on the bf16 weights it would round away. Only fp32 main parameters keep it."""
GRAD_NORM_RTOL = 0.05
"""Relative gap of the bf16 grad norm to the fp32 one: measured 1.9e-3 on the CPU (bf16 rounding of
weights and activations, fp32 grad buffers); a broken bf16 path (a gradient lost or doubled, the
bf16 copy of the weights out of step) moves the norm by far more."""
CHANGED_SHARE = 0.99
"""bf16's main parameters must change in at least this share of the elements fp32's step changes
(those with a gradient: embedding rows of tokens not in the batch keep Adam's update at 0)."""
BATCH_SIZE = 12


def run(ctx: CheckContext) -> CheckResult:
    from libra.model_spec import ModelSpec
    from libra.training.config import TrainingConfig
    from libra.training.engine import TrainEngine
    from libra.training.hf_weights import hf_tensor_reader
    from libra.training.model import ModelArchitecture

    info = ctx.world()
    model_dir = str(ctx.tiny_model())
    arch = ModelArchitecture.from_spec(ModelSpec.from_hf_dir(model_dir))
    step: dict[str, dict] = {}
    for dtype in ("float32", "bfloat16"):
        cfg = TrainingConfig(dtype=dtype, lr=LR, train_batch_size=BATCH_SIZE)
        engine = TrainEngine(arch, cfg, info, device=ctx.device)
        engine.load_hf(hf_tensor_reader(model_dir))
        before = [p.detach().clone() for p in engine.main_parameters()]
        result = engine.train_step(synthetic_batch(seed=1))
        main = engine.main_parameters()
        changed = sum((p != b).sum().item() for p, b in zip(main, before, strict=True))
        step[dtype] = {
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "changed": changed / sum(p.numel() for p in main),
            "main_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in main}),
        }
    fp32, bf16 = step["float32"], step["bfloat16"]
    gap = abs(bf16["grad_norm"] - fp32["grad_norm"]) / fp32["grad_norm"]
    values = {
        "loss_bf16": bf16["loss"],
        "loss_fp32": fp32["loss"],
        "grad_norm_bf16": bf16["grad_norm"],
        "grad_norm_fp32": fp32["grad_norm"],
        "grad_norm_rel_gap": gap,
        "main_changed_bf16": bf16["changed"],
        "main_changed_fp32": fp32["changed"],
    }
    figure = (
        f"loss bf16 {bf16['loss']:.4f} / fp32 {fp32['loss']:.4f}, "
        f"grad norm bf16 {bf16['grad_norm']:.4f} / fp32 {fp32['grad_norm']:.4f} "
        f"(gap {gap:.1e}, tolerance {GRAD_NORM_RTOL:.0e}), main params {'/'.join(bf16['main_dtypes'])} "
        f"changed {bf16['changed']:.1%} (fp32 step {fp32['changed']:.1%}) at lr {LR:.0e}"
    )
    problems = []
    if not math.isfinite(bf16["loss"]):
        problems.append("loss is not finite")
    if bf16["main_dtypes"] != ["float32"]:
        problems.append(f"main parameters are {bf16['main_dtypes']}, not float32")
    if not bf16["changed"] > 0 or bf16["changed"] < CHANGED_SHARE * fp32["changed"]:
        problems.append("bf16's step left main parameters unchanged that fp32's step changes")
    if gap > GRAD_NORM_RTOL:
        problems.append("grad norms differ beyond tolerance")
    if problems:
        figure = f"{'; '.join(problems)}: {figure}"
    return CheckResult(NAME, not problems, figure, values)


def synthetic_batch(
    seed: int, num_groups: int = 3, group_size: int = 4, vocab: int = TINY_VOCAB
) -> list[Trajectory]:
    """Multi-turn trajectories of random tokens: model turns (trained on) between tool results
    (masked out), rewards that differ within each group so every group has an advantage."""
    rng = random.Random(seed)
    batch = []
    for g in range(num_groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 10))]
        for k in range(group_size):
            t = Trajectory(f"t{g}-{k}", f"p{g}", f"g{g}", list(prompt))
            for turn in range(rng.randint(1, 3)):
                n = rng.randint(2, 12)
                tokens = [rng.randrange(vocab) for _ in range(n)]
                t.append(tokens, [-rng.uniform(0.5, 6.0) for _ in range(n)], policy_version=0)
                if turn < 2 and rng.random() < 0.6:
                    t.append([rng.randrange(vocab) for _ in range(rng.randint(1, 6))], None, 0)
            t.reward = float(k % 2)
            batch.append(t)
    return batch
