"""Check 5: weight publication from a train rank on the device to the rollout instance, as the
job publishes (`TrainerPublisher` over shared memory, the instance's LoadWeights): after one
training step the instance computes with the trainer's exported weights bit for bit, and the
trainer scores the tokens the instance samples with them as the instance did."""

from __future__ import annotations

import asyncio

import torch

from libra.checks.bf16_step import synthetic_batch
from libra.checks.context import CheckContext
from libra.checks.instance import CheckInstance
from libra.checks.result import CheckResult
from libra.rollout.types import SamplingSpec
from libra.trajectory import Trajectory

NAME = "publication"
LR = 1e-3
"""Large enough that one step moves every weight that gets a gradient (the check must see new
weights arrive, not the old ones kept)."""
VLLM_VOCAB_MULTIPLE = 64
"""vLLM pads its embedding and LM head rows to this multiple (with zeros)."""
NUM_SAMPLES = 4
SAMPLE_TOKENS = 32
FP32_LOGPROB_TOL = 1e-4
"""Max per-token |instance - trainer| logprob in fp32 on the CPU, where both sides compute the
same sums in another order (measured ~1e-6); different weights are off by far more."""
ACCELERATOR_LOGPROB_TOL = 2e-2
"""Different kernels on an accelerator (vLLM's attention, TF32-eligible matmuls) round fp32
differently. Either tolerance is capped at a tenth of what the step itself moved the logprobs."""


def run(ctx: CheckContext) -> CheckResult:
    from libra.model_spec import ModelSpec
    from libra.sync.config import SyncConfig
    from libra.sync.layouts import ModelShape
    from libra.sync.trainer_publisher import SourceRank, TrainerPublisher
    from libra.training.config import TrainingConfig
    from libra.training.engine import TrainEngine
    from libra.training.hf_weights import hf_tensor_reader
    from libra.training.model import VOCAB_DIVISIBLE_BY, ModelArchitecture

    info = ctx.world()
    policy = ctx.tiny_model()
    spec = ModelSpec.from_hf_dir(policy)
    arch = ModelArchitecture.from_spec(spec)
    engines = []
    for _ in range(2):  # the one to step and publish, and the weights before the step
        engine = TrainEngine(
            arch, TrainingConfig(dtype="float32", lr=LR, train_batch_size=12), info, device=ctx.device
        )
        engine.load_hf(hf_tensor_reader(str(policy)))
        engines.append(engine)
    engine, before = engines
    engine.train_step(synthetic_batch(seed=2, vocab=spec.vocab_size))
    source = SourceRank(info.rank, info.tp_rank, info.tp_size, info.pp_rank, info.pp_size, info.dp_rank)
    publisher = TrainerPublisher(ModelShape.from_spec(spec), source, SyncConfig(), VOCAB_DIVISIBLE_BY)
    try:
        published = publisher.publish(engine.version, [1], engine.publishable_parameters())
        loaded, engine_params, samples = asyncio.run(
            _load_read_and_sample(ctx.instance(), published.loads[1], engine.version)
        )
    finally:
        publisher.close()
    if not loaded.ok:
        return CheckResult(NAME, False, f"the instance refused version {engine.version}: {loaded.error}")
    mismatched, compared = _compare(engine_params, _vllm_tp1_params(engine.export_hf(), arch))
    trainer_logprobs = engine.compute_logprobs(samples)
    gaps = _gaps([t.rollout_logprobs for t in samples], trainer_logprobs)
    # What the same tokens score under the weights before the step: a gap this large would mean
    # the instance still samples with them. The measured gap must be far below it.
    step_shift = max(_gaps(before.compute_logprobs(samples), trainer_logprobs))
    tolerance = min(
        FP32_LOGPROB_TOL if ctx.device.type == "cpu" else ACCELERATOR_LOGPROB_TOL, step_shift / 10
    )
    values: dict[str, float | int | str] = {
        "version": engine.version,
        "tensors_compared": compared,
        "tensors_mismatched": len(mismatched),
        "logprob_gap_mean": sum(gaps) / len(gaps),
        "logprob_gap_max": max(gaps),
        "logprob_step_shift": step_shift,
        "publish_s": published.publish_seconds,
    }
    figure = (
        f"version {engine.version}: {compared - len(mismatched)}/{compared} tensors bit-identical to "
        f"the trainer's export (published in {published.publish_seconds * 1e3:.0f} ms); logprob gap "
        f"on {len(gaps)} sampled tokens mean {values['logprob_gap_mean']:.1e}, max {max(gaps):.1e} "
        f"(tolerance {tolerance:.0e}; the step moved them by up to {step_shift:.1e})"
    )
    if mismatched:
        figure += f"; differ: {', '.join(mismatched[:4])}"
    return CheckResult(NAME, not mismatched and max(gaps) <= tolerance, figure, values)


async def _load_read_and_sample(instance: CheckInstance, load, version: int):
    """Loads the publication, reads back what the engine computes with (rank 0: the whole model
    at TP 1), and samples `NUM_SAMPLES` continuations under it."""
    client = instance.client()
    try:
        loaded = await client.load_weights(load)
        params = (await client.read_weights())[0]
        spec = SamplingSpec(temperature=1.0, max_tokens=SAMPLE_TOKENS, ignore_eos=True, seed=1)
        samples = []
        for i in range(NUM_SAMPLES):
            prompt = [(7 * i + k) % 200 + 10 for k in range(6)]
            segment = await client.generate(f"sample-{i}", prompt, spec)
            trajectory = Trajectory(f"s{i}", "p", "g", prompt)
            for chunk in segment.chunks:
                trajectory.append(chunk.token_ids, chunk.logprobs, chunk.weight_version)
            if set(trajectory.policy_versions) != {version}:
                raise RuntimeError(f"sampled by versions {set(trajectory.policy_versions)}, not {version}")
            samples.append(trajectory)
        return loaded, params, samples
    finally:
        await client.close()


def _gaps(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return [abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True)]


def _vllm_tp1_params(hf: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
    """What a TP-1 vLLM engine of a Llama/Qwen-family model holds, from the HF tensors: q, k, v
    fused row-wise into `qkv_proj` and gate, up into `gate_up_proj` (vLLM's own loading rules,
    written out independently of `libra.sync`'s layouts)."""
    out = {}
    for name, tensor in hf.items():
        layer, _, leaf = name.partition(".self_attn.")
        if leaf.startswith(("k_proj.", "v_proj.")):
            continue
        if leaf.startswith("q_proj."):
            suffix = leaf.removeprefix("q_proj.")
            parts = [hf[f"{layer}.self_attn.{p}_proj.{suffix}"] for p in "qkv"]
            out[f"{layer}.self_attn.qkv_proj.{suffix}"] = torch.cat(parts)
            continue
        layer, _, leaf = name.partition(".mlp.")
        if leaf == "up_proj.weight":
            continue
        if leaf == "gate_proj.weight":
            out[f"{layer}.mlp.gate_up_proj.weight"] = torch.cat([tensor, hf[f"{layer}.mlp.up_proj.weight"]])
            continue
        out[name] = tensor
    if arch.tie_word_embeddings:
        out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return out


def _compare(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """Names whose tensors are not bit-identical (vLLM's zero rows of vocabulary padding aside;
    a `name@packed` copy, which the CPU engine computes with, compares like `name`), and the
    number compared. Expected tensors the engine lacks count as mismatched."""
    mismatched, seen = [], set()
    for name, tensor in got.items():
        base = name.split("@", 1)[0]
        seen.add(base)
        want = expected.get(base)
        if want is None:
            mismatched.append(f"{name} (unexpected)")
            continue
        tensor = tensor.to(want.dtype)
        rows = want.shape[0]
        padded = tensor.shape[0] > rows and tensor.shape[0] % VLLM_VOCAB_MULTIPLE == 0
        body, pad = (tensor[:rows], tensor[rows:]) if padded else (tensor, None)
        same = body.shape == want.shape and torch.equal(_bits(body), _bits(want.to("cpu")))
        if not same or (pad is not None and pad.count_nonzero().item()):
            mismatched.append(name)
    mismatched += [f"{name} (missing)" for name in expected.keys() - seen]
    return mismatched, len(got)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32 if tensor.element_size() == 4 else torch.int16)
