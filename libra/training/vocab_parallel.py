"""Per-token logprobs and entropy from vocabulary-parallel logits.

Each TP rank holds logits for its slice of the (padded) vocabulary. Softmax statistics are summed
across the TP group with Megatron's `reduce_from_tensor_model_parallel_region` (all-reduce
forward, identity backward: every rank's loss depends on the sum with derivative 1), so the
result and its gradient equal the full-vocabulary computation. Padding rows of the vocabulary get
a large negative logit: they exist in Megatron's model but not in the HF model or the rollout
engine, whose probabilities are over the real vocabulary only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_MASKED_LOGIT = -1e9
"""exp() of it is 0 in fp32 and bf16; finite, so 0 x logit stays 0 in the entropy."""


def mask_vocab_padding(logits_BSV: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    local = logits_BSV.shape[-1]
    padded = torch.arange(vocab_start, vocab_start + local, device=logits_BSV.device) >= vocab_size
    if not padded.any():
        return logits_BSV
    return logits_BSV.masked_fill(padded, _MASKED_LOGIT)


def logprobs_and_entropy(
    logits_BSV: torch.Tensor,
    targets_BS: torch.Tensor,
    vocab_start: int,
    tp_group: dist.ProcessGroup | None,
    tp_size: int,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[target] and the softmax entropy, both [B, S], in fp32."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    def tp_sum(x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(x, group=tp_group) if tp_size > 1 else x

    logits = logits_BSV.float()
    with torch.no_grad():
        row_max = logits.max(dim=-1).values
        if tp_size > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - row_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = tp_sum(exp.sum(dim=-1))
    log_z = sum_exp.log()
    local_vocab = logits.shape[-1]
    local_targets = targets_BS - vocab_start
    in_slice = (local_targets >= 0) & (local_targets < local_vocab)
    picked = shifted.gather(-1, local_targets.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    picked = tp_sum(picked * in_slice)
    logp = picked - log_z
    entropy = None
    if with_entropy:
        entropy = log_z - tp_sum((exp * shifted).sum(dim=-1)) / sum_exp
    return logp, entropy
