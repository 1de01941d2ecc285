"""GRPO advantages and loss against a direct per-token reference (plain Python floats)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from libra.training.config import GrpoConfig
from libra.training.grpo import group_advantages, groups_with_variance, grpo_token_loss


def reference_advantages(rewards, groups, normalize_std=True, eps=1e-6):
    out = []
    for r, g in zip(rewards, groups, strict=False):
        members = [x for x, h in zip(rewards, groups, strict=False) if h == g]
        if len(members) < 2:
            out.append(0.0)
            continue
        a = r - statistics.fmean(members)
        out.append(a / (statistics.stdev(members) + eps) if normalize_std else a)
    return out


def reference_loss(logp, old, rollout, adv, mask, cfg: GrpoConfig, ref=None, entropy=None):
    """Token-by-token: returns (sum of masked per-token losses, clipped-token count)."""
    total, clipped_count = 0.0, 0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            w = min(math.exp(old[i][t] - rollout[i][t]), cfg.importance_cap)
            a = adv[i][t]
            unclipped = ratio * a
            clipped = min(max(ratio, 1 - cfg.clip_low), 1 + cfg.clip_high) * a
            loss = -w * min(unclipped, clipped)
            clipped_count += clipped < unclipped
            if cfg.kl_coef:
                d = ref[i][t] - logp[i][t]
                loss += cfg.kl_coef * (math.exp(d) - d - 1)
            if cfg.entropy_coef:
                loss -= cfg.entropy_coef * entropy[i][t]
            total += loss
    return total, clipped_count


def test_advantages_match_reference():
    rewards = [1.0, 0.0, 0.5, 1.0, 0.2, 0.2, 0.2, 3.0, 0.0]
    groups = ["a", "a", "a", "a", "b", "b", "b", "c", "d"]
    for normalize in (True, False):
        cfg = GrpoConfig(normalize_std=normalize)
        got = group_advantages(rewards, groups, cfg)
        assert got == pytest.approx(reference_advantages(rewards, groups, normalize), abs=1e-9)
    got = group_advantages(rewards, groups, GrpoConfig())
    assert got[4:7] == [0.0, 0.0, 0.0]  # zero variance: no signal, no division blow-up
    assert got[7] == 0.0 and got[8] == 0.0  # groups of one


def test_advantages_reject_mismatched_lengths():
    with pytest.raises(ValueError, match="rewards"):
        group_advantages([1.0], ["a", "b"], GrpoConfig())


def test_groups_with_variance_for_dynamic_sampling():
    assert groups_with_variance([1, 1, 0, 1, 0.5, 0.5], ["a", "a", "b", "b", "c", "c"]) == {"b"}


@pytest.mark.parametrize(
    "cfg",
    [
        GrpoConfig(),
        GrpoConfig(clip_low=0.2, clip_high=0.28, importance_cap=1.5),
        GrpoConfig(kl_coef=0.1, entropy_coef=0.01, clip_low=0.1, clip_high=0.1),
    ],
)
def test_token_loss_matches_reference(cfg):
    g = torch.Generator().manual_seed(0)
    rows, cols = 4, 9
    logp = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3
    # Ratios spread over [0.5, 1.6]: both clip edges and the unclipped middle are exercised.
    old = logp - torch.empty(rows, cols, dtype=torch.float64).uniform_(-0.47, 0.69, generator=g)
    rollout = old - torch.empty(rows, cols, dtype=torch.float64).uniform_(-1.0, 1.0, generator=g)
    adv = torch.tensor([1.5, -0.7, 0.0, -2.0], dtype=torch.float64)[:, None].expand(rows, cols)
    mask = (torch.rand(rows, cols, generator=g) > 0.3).to(torch.float64)
    mask[1, 4:] = 0  # a tool-result stretch and padding
    ref = logp + torch.empty(rows, cols, dtype=torch.float64).uniform_(-0.5, 0.5, generator=g)
    entropy = torch.rand(rows, cols, generator=g, dtype=torch.float64) * 4
    got = grpo_token_loss(logp, old, rollout, adv, mask, cfg, ref_logp=ref, entropy=entropy)
    want, want_clipped = reference_loss(
        logp.tolist(),
        old.tolist(),
        rollout.tolist(),
        adv.tolist(),
        mask.tolist(),
        cfg,
        ref.tolist(),
        entropy.tolist(),
    )
    assert got.loss_sum.item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert got.clipped_tokens.item() == want_clipped > 0
    assert got.objective.item() == got.loss_sum.item()  # no scale: the plain sum


def test_sequence_mean_weighs_each_trajectory_equally():
    """Two trajectories, advantages +1 and -1, the failed one four times longer: token-mean pushes
    the failure 4x harder in total, sequence-mean pushes both with the same total weight."""
    cfg = GrpoConfig()
    logp = torch.full((2, 8), -1.0, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 8, dtype=torch.float64)
    mask[0, :2], mask[1, :] = 1, 1
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64).expand(2, 8)
    lengths = mask.sum(dim=1, keepdim=True)
    for scale, want_ratio in ((None, 4.0), ((1.0 / (lengths * 2)).expand(2, 8), 1.0)):
        logp.grad = None
        out = grpo_token_loss(logp, logp.detach(), logp.detach(), adv, mask, cfg, scale=scale)
        out.objective.backward()
        push_up, push_down = -logp.grad[0].sum().item(), logp.grad[1].sum().item()
        assert push_up > 0 and push_down > 0
        assert push_down / push_up == pytest.approx(want_ratio)


def test_clip_edges_and_gradients():
    """At the clip boundaries the gradient vanishes exactly on the clipped side only."""
    cfg = GrpoConfig(clip_low=0.2, clip_high=0.28)
    ratios = torch.tensor([[0.7, 0.8, 1.0, 1.28, 1.4, 0.7, 1.4]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    logp = ratios.log().clone().requires_grad_(True)
    zeros = torch.zeros_like(logp)
    out = grpo_token_loss(logp, zeros, zeros, adv, torch.ones_like(logp), cfg)
    out.loss_sum.backward()
    grad = logp.grad[0].tolist()
    # A>0: ratio below 1-eps keeps its gradient (min picks the unclipped, smaller term); above
    # 1+eps_high it is clipped (no gradient). A<0: mirror image.
    assert grad[0] == pytest.approx(-0.7) and grad[4] == 0.0
    assert grad[1] == pytest.approx(-0.8) and grad[2] == pytest.approx(-1.0)
    assert grad[5] == 0.0 and grad[6] == pytest.approx(1.4)
    assert out.clipped_tokens.item() == 2


def test_masked_tokens_contribute_nothing():
    cfg = GrpoConfig(kl_coef=0.5, entropy_coef=0.1)
    logp = torch.full((1, 3), -1.0, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    big = torch.tensor([[0.0, 50.0, -50.0]])  # absurd values where masked out
    out = grpo_token_loss(
        logp, logp.detach() + big, torch.zeros(1, 3), torch.ones(1, 3), mask, cfg, ref_logp=big, entropy=big
    )
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum)
    assert logp.grad[0, 1:].tolist() == [0.0, 0.0]


def test_importance_weight_is_truncated():
    cfg = GrpoConfig(importance_cap=2.0)
    logp = torch.zeros(1, 1)
    # Rollout policy gave the token 1/10 of pi_old's probability: weight 10 truncated to 2.
    out = grpo_token_loss(
        logp, logp, torch.tensor([[-math.log(10)]]), torch.ones(1, 1), torch.ones(1, 1), cfg
    )
    assert out.loss_sum.item() == pytest.approx(-2.0)


def test_kl_needs_reference():
    with pytest.raises(ValueError, match="kl_coef"):
        grpo_token_loss(
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1, 1),
            torch.ones(1, 1),
            GrpoConfig(kl_coef=0.1),
        )


def test_config_names_bad_field():
    with pytest.raises(ValueError, match="training.grpo.clip_low"):
        GrpoConfig(clip_low=1.5)
    with pytest.raises(ValueError, match="training.grpo.loss_aggregation must be token_mean or"):
        GrpoConfig(loss_aggregation="sum")
    with pytest.raises(ValueError, match="training.grpo.temperature"):
        GrpoConfig(temperature=0)
