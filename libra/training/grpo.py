"""GRPO: group-normalised advantages and the clipped, importance-weighted token loss.

Pure torch functions over padded `[rows, tokens]` tensors; the engine feeds them per micro-batch.

Per token t with loss mask m_t (0 for tool results, templates and padding):

    r_t   = exp(logp_t - old_t)                        ratio to pi_old (recomputed at step start)
    w_t   = min(exp(old_t - rollout_t), C)             truncated importance weight (detached):
                                                       corrects for the (stale) sampling policy
    pg_t  = -w_t * min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)
    kl_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1    (k3 estimator, >= 0)
    loss  = sum_t m_t * (pg_t + beta * kl_t - alpha * H_t) / N

N is the number of masked tokens in the whole (global) batch: token-level aggregation, so long
trajectories weigh by their tokens (DAPO), and micro-batches or DP ranks sum to the same loss.
`loss_aggregation="sequence_mean"` instead weighs every trajectory equally: 1 / (n_i * B) per
token of trajectory i (n_i its masked tokens, B trajectories), so within a group the positive and
negative advantages, which sum to zero, also push with equal total weight however long the
failed trajectories run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libra.training.config import GrpoConfig


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str], cfg: GrpoConfig) -> list[float]:
    """A_i = (R_i - mean_g) / (std_g + eps), over the trajectories of i's group g (sample std,
    i.e. unbiased); a group of one has advantage 0. `normalize_std=False` skips the division."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    members: dict[str, list[int]] = {}
    for index, group in enumerate(group_ids):
        members.setdefault(group, []).append(index)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        values = torch.tensor([float(rewards[i]) for i in indices], dtype=torch.float64)
        if len(indices) < 2 or values.max() == values.min():
            continue  # no signal; and exactly 0, not the rounding residue of x - mean(x, x, x)
        centred = values - values.mean()
        if cfg.normalize_std:
            centred = centred / (values.std() + cfg.std_eps)
        for i, a in zip(indices, centred.tolist(), strict=False):
            advantages[i] = a
    return advantages


def groups_with_variance(rewards: Sequence[float], group_ids: Sequence[str]) -> set[str]:
    """Dynamic sampling (DAPO): the groups whose rewards are not all equal; the others carry no
    GRPO signal (every advantage is 0)."""
    seen: dict[str, set[float]] = {}
    for reward, group in zip(rewards, group_ids, strict=True):
        seen.setdefault(group, set()).add(float(reward))
    return {group for group, values in seen.items() if len(values) > 1}


@dataclass
class TokenLoss:
    loss_sum: torch.Tensor
    """sum_t m_t * loss_t (divide by the global token count for the batch loss)."""
    pg_sum: torch.Tensor
    kl_sum: torch.Tensor
    entropy_sum: torch.Tensor
    clipped_tokens: torch.Tensor
    """Masked tokens whose ratio was clipped (the clip was the active branch of the min)."""
    objective: torch.Tensor
    """sum_t m_t * s_t * loss_t with the per-token aggregation scale s_t: what backward runs on."""


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GrpoConfig,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> TokenLoss:
    """All tensors are [rows, tokens] (advantages and `scale` per token, i.e. the row's value
    broadcast). `scale` (default 1) weighs each token's loss in `objective`."""
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    weight = torch.exp(old_logp - rollout_logp).clamp(max=cfg.importance_cap).detach()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages
    pg = -weight * torch.minimum(unclipped, clipped)
    total = pg
    zero = logp.new_zeros(())
    kl_sum = zero
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("training.grpo.kl_coef > 0 needs reference logprobs")
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1.0
        total = total + cfg.kl_coef * kl
        kl_sum = (kl * mask).sum()
    entropy_sum = zero
    if entropy is not None:
        entropy_sum = (entropy * mask).sum()
        if cfg.entropy_coef > 0:
            total = total - cfg.entropy_coef * entropy
    return TokenLoss(
        loss_sum=(total * mask).sum(),
        pg_sum=(pg * mask).sum(),
        kl_sum=kl_sum,
        entropy_sum=entropy_sum,
        clipped_tokens=((clipped < unclipped).to(mask.dtype) * mask).sum().detach(),
        objective=(total * mask * scale).sum() if scale is not None else (total * mask).sum(),
    )
