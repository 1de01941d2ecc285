"""One train rank: a Megatron `GPTModel` stage with per-token logprobs, GRPO steps, checkpoints
and HF export.

Every rank of a job receives the same global batch and derives the same plan from it (DP shares,
micro-batches), so peers agree without extra messages. Gradients are reduced explicitly rather
than through Megatron's DDP and optimizer, which hard-code CUDA (the cpu backend patches only
model forward/backward): a sum over the DP group, the tied embedding over Megatron's embedding
group (first and last stage), and Qwen3's per-head QK-norm weights over the TP group (each TP
rank sees different heads). The pipeline schedule is the simplest correct one: each micro-batch
runs forward through the stages and straight back (no overlap), over blocking point-to-point
sends; that is enough for CPU jobs and exact.

Token layout: a trajectory is `prompt + response` (P + R tokens) fed as one row; the logits at
position t predict token t+1, so response token j is scored at position P - 1 + j.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from libra.training.batching import MicroBatch, make_micro_batches, pad_rows, split_across_ranks
from libra.training.config import TrainingConfig
from libra.training.grpo import group_advantages, groups_with_variance, grpo_token_loss
from libra.training.hf_weights import hf_to_megatron, megatron_to_hf
from libra.training.model import ModelArchitecture, build_gpt_model, padded_vocab_size
from libra.training.parallel import RankInfo
from libra.training.staleness import StalenessGate
from libra.training.vocab_parallel import logprobs_and_entropy, mask_vocab_padding
from libra.trajectory import Trajectory

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class StepResult:
    version: int
    """Policy version after the step."""
    loss: float
    pg_loss: float
    kl: float
    entropy: float
    clip_fraction: float
    grad_norm: float
    """Before clipping, of the last optimizer step."""
    num_tokens: int
    """Trained (loss-mask) tokens."""
    num_trajectories: int
    num_dropped_stale: int
    num_dropped_no_variance: int


@dataclass
class _Rows:
    """One micro-batch, padded, with per-position values aligned to the logits (see module doc)."""

    tokens: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    values: dict[str, torch.Tensor]


class TrainEngine:
    def __init__(
        self, arch: ModelArchitecture, cfg: TrainingConfig, info: RankInfo, device: torch.device | None = None
    ):
        from megatron.core import parallel_state as ps

        if (info.tp_size, info.pp_size, info.dp_size) != (
            cfg.tensor_parallel,
            cfg.pipeline_parallel,
            cfg.data_parallel,
        ):
            raise ValueError(
                f"process groups are TP={info.tp_size} PP={info.pp_size} DP={info.dp_size} but the config "
                f"asks for TP={cfg.tensor_parallel} PP={cfg.pipeline_parallel} DP={cfg.data_parallel}"
            )
        self.arch, self.cfg, self.info = arch, cfg, info
        self.device = device or torch.device("cpu")
        self.dtype = _DTYPES[cfg.dtype]
        self.model = build_gpt_model(
            arch,
            info.tp_size,
            info.pp_size,
            pre_process=info.is_first_stage,
            post_process=info.is_last_stage,
            dtype=self.dtype,
            device=self.device,
        )
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self.gate = StalenessGate(cfg.max_staleness, cfg.train_batch_size)
        self.ref_model = None
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._dp_group = ps.get_data_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self._mp_group = ps.get_model_parallel_group()
        self._prev_rank = None if info.is_first_stage else ps.get_pipeline_model_parallel_prev_rank()
        self._next_rank = None if info.is_last_stage else ps.get_pipeline_model_parallel_next_rank()
        self._vocab_start = info.tp_rank * padded_vocab_size(arch.vocab_size, info.tp_size) // info.tp_size
        self.peer: GradientPeer | None = None
        """Set while this rank exchanges gradients with an elastic hybrid replica
        (`libra.training.hybrid`); None: plain Megatron DP."""
        self.reset_reference()

    @property
    def version(self) -> int:
        return self.gate.version

    # -- weights ---------------------------------------------------------------------------------

    def load_hf(self, get_hf: Callable[[str], torch.Tensor]) -> None:
        """Loads full HF tensors (`hf_weights.hf_tensor_reader`) into this rank's shard."""
        shards = hf_to_megatron(
            get_hf,
            self.arch,
            tp_rank=self.info.tp_rank,
            tp_size=self.info.tp_size,
            pp_rank=self.info.pp_rank,
            pp_size=self.info.pp_size,
        )
        params = dict(self.model.named_parameters())
        if set(shards) != set(params):
            raise RuntimeError(
                f"converter/model name mismatch: missing {sorted(set(params) - set(shards))}, "
                f"unexpected {sorted(set(shards) - set(params))}"
            )
        with torch.no_grad():
            for name, tensor in shards.items():
                if params[name].shape != tensor.shape:
                    raise RuntimeError(
                        f"{name}: model shard {tuple(params[name].shape)} vs converted {tuple(tensor.shape)}"
                    )
                params[name].copy_(tensor)
        self.reset_reference()

    def reset_reference(self) -> None:
        """The KL reference policy becomes a frozen copy of the current weights (when KL is on)."""
        if self.cfg.grpo.kl_coef <= 0:
            return
        if self.ref_model is None:
            # A second stage built the same way (models hold process groups: no deepcopy).
            self.ref_model = build_gpt_model(
                self.arch,
                self.info.tp_size,
                self.info.pp_size,
                pre_process=self.info.is_first_stage,
                post_process=self.info.is_last_stage,
                dtype=self.dtype,
                device=self.device,
            ).requires_grad_(False)
        with torch.no_grad():
            for ref, current in zip(self.ref_model.parameters(), self.model.parameters(), strict=True):
                ref.copy_(current)

    def export_hf(self) -> dict[str, torch.Tensor]:
        """The whole model as HF tensors, on every rank (gathers TP shards, then PP stages)."""
        local = {name: p.detach() for name, p in self.model.named_parameters()}
        tp_shards: list[dict[str, torch.Tensor]] = [None] * self.info.tp_size  # type: ignore[list-item]
        dist.all_gather_object(tp_shards, local, group=self._tp_group)
        stage = megatron_to_hf(tp_shards, self.arch, pp_rank=self.info.pp_rank, pp_size=self.info.pp_size)
        stages: list[dict[str, torch.Tensor]] = [None] * self.info.pp_size  # type: ignore[list-item]
        dist.all_gather_object(stages, stage, group=self._pp_group)
        return {name: tensor for part in stages for name, tensor in part.items()}

    # -- logprobs --------------------------------------------------------------------------------

    def compute_logprobs(self, trajectories: Sequence[Trajectory], model=None) -> list[list[float]]:
        """Per response token logprob under the current policy (0.0 where the loss mask is 0)."""
        _check_batch(trajectories)
        # Outside a train step: no exchange with a hybrid replica, this rank's DP layout only.
        padded = self._forward_only(trajectories, model or self.model, with_peer=False)
        return [padded[i, : len(t.response_token_ids)].tolist() for i, t in enumerate(trajectories)]

    @torch.no_grad()
    def _forward_only(
        self, trajectories: Sequence[Trajectory], model, with_peer: bool = True
    ) -> torch.Tensor:
        """[num_trajectories, longest response] logprobs, identical on every rank."""
        peer = self.peer if with_peer else None
        if peer is not None and not peer.computes():
            # A hybrid replica in ZERO_SYNC only replays the core's updates: nothing to score.
            width = max(len(t.response_token_ids) for t in trajectories)
            return torch.zeros(len(trajectories), width, dtype=torch.float32)
        share = self._share() if peer is not None else (self.info.dp_rank, self.info.dp_size)
        out = self._forward_share(trajectories, model, share)
        if peer is not None:
            # A hybrid replica's rows join its paired core rank's before the DP reduction.
            out = peer.add_logprobs(out, lambda share: self._forward_share(trajectories, model, share))
        # Only the last stage of each DP rank wrote its share: a sum over DP and PP gathers it.
        dist.all_reduce(out, group=self._dp_group)
        dist.all_reduce(out, group=self._pp_group)
        if peer is not None:
            out = peer.logprobs_reduced(out)
        return out

    @torch.no_grad()
    def _forward_share(
        self, trajectories: Sequence[Trajectory], model, share: tuple[int, int]
    ) -> torch.Tensor:
        """The logprobs of one DP share's rows (zeros elsewhere), on the last stage."""
        width = max(len(t.response_token_ids) for t in trajectories)
        out = torch.zeros(len(trajectories), width, dtype=torch.float32)
        for mb in self._my_micro_batches(trajectories, range(len(trajectories)), share):
            rows = self._rows(trajectories, mb, {})
            output = self._stage_forward(model, rows, requires_grad=False)
            if self.info.is_last_stage:
                logp, _ = self._logprobs(output, rows.targets, with_entropy=False)
                for row, index in enumerate(mb.indices):
                    start, n = (
                        len(trajectories[index].prompt_token_ids) - 1,
                        len(trajectories[index].response_token_ids),
                    )
                    out[index, :n] = (
                        logp[row, start : start + n] * rows.mask[row, start : start + n]
                    ).float()
            else:
                self._send(output)
        return out

    # -- training --------------------------------------------------------------------------------

    def train_step(self, trajectories: Sequence[Trajectory]) -> StepResult:
        """One GRPO step: gate, advantages, pi_old (and reference) logprobs, then
        `num_minibatches` optimizer steps. Increments the policy version."""
        _check_batch(trajectories)
        if any(t.reward is None for t in trajectories):
            raise ValueError("every trajectory of a train step needs a reward")
        fresh = self.gate.admit([t.oldest_policy_version for t in trajectories])
        batch = [t for t, ok in zip(trajectories, fresh, strict=False) if ok]
        num_stale = len(trajectories) - len(batch)
        num_flat = 0
        if self.cfg.dynamic_sampling:
            keep = groups_with_variance([t.reward for t in batch], [t.group_id for t in batch])
            num_flat = sum(t.group_id not in keep for t in batch)
            batch = [t for t in batch if t.group_id in keep]
            self.gate.drop(num_flat)
        totals = torch.zeros(6, dtype=torch.float64)
        grad_norm = 0.0
        if batch:
            advantages = group_advantages(
                [t.reward for t in batch], [t.group_id for t in batch], self.cfg.grpo
            )
            old = self._forward_only(batch, self.model) if self.cfg.recompute_old_logprobs else None
            ref = self._forward_only(batch, self.ref_model) if self.ref_model is not None else None
            for minibatch in _chunks(len(batch), self.cfg.num_minibatches):
                stats, grad_norm = self._optimizer_step(batch, minibatch, advantages, old, ref)
                totals += stats
        version = self.gate.on_train_step(len(batch))
        num_tokens = max(totals[5].item(), 1.0)
        return StepResult(
            version=version,
            loss=totals[0].item() / num_tokens,
            pg_loss=totals[1].item() / num_tokens,
            kl=totals[2].item() / num_tokens,
            entropy=totals[3].item() / num_tokens,
            clip_fraction=totals[4].item() / num_tokens,
            grad_norm=grad_norm,
            num_tokens=int(totals[5].item()),
            num_trajectories=len(batch),
            num_dropped_stale=num_stale,
            num_dropped_no_variance=num_flat,
        )

    def _optimizer_step(self, batch, indices, advantages, old, ref) -> tuple[torch.Tensor, float]:
        """Forward/backward over this rank's micro-batches of the mini-batch `indices`, gradient
        reduction, clipping, AdamW. Returns [loss, pg, kl, entropy, clipped, tokens] sums of the
        whole mini-batch (all ranks) and the grad norm."""
        num_tokens = sum(sum(batch[i].loss_mask) for i in indices)
        self._zero_grads()
        if self.peer is None:
            stats = self._backward_share(batch, indices, advantages, old, ref, num_tokens, self._share())
            stats = self._reduce_grads_and_stats(stats)
        else:
            stats = (
                self._backward_share(batch, indices, advantages, old, ref, num_tokens, self._share())
                if self.peer.computes()
                else torch.zeros(6, dtype=torch.float64)
            )
            # The peer adds the hybrid replica's gradients before the DP reduction (or, on the
            # hybrid side, sends them and takes the reduced ones back); `fill_in` computes a
            # share here when the replica that owned it failed.
            stats = self.peer.reduce_gradients(
                self,
                stats,
                lambda share: self._backward_share(batch, indices, advantages, old, ref, num_tokens, share),
            )
        grad_norm = self._clip_grads()
        self.optimizer.step()
        return stats, grad_norm

    def _zero_grads(self) -> None:
        """Zero gradients, allocated where none exists yet: a rank whose DP share of a mini-batch
        is empty (fewer trajectories than shares) still takes part in the gradient reduction."""
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()

    def _reduce_grads_and_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """The core's DP (and tied-embedding, QK-norm) gradient reduction and the stats' sum."""
        self._reduce_grads()
        dist.all_reduce(stats, group=self._dp_group)
        dist.all_reduce(stats, group=self._pp_group)
        return stats

    def _backward_share(self, batch, indices, advantages, old, ref, num_tokens, share) -> torch.Tensor:
        """Forward/backward of one DP share of the mini-batch `indices`, accumulating into the
        gradients; returns that share's [loss, pg, kl, entropy, clipped, tokens] sums."""
        stats = torch.zeros(6, dtype=torch.float64)
        for mb in self._my_micro_batches(batch, indices, share):
            extra = {
                "rollout": [batch[i].rollout_logprobs for i in mb.indices],
                "advantage": [[advantages[i]] * len(batch[i].response_token_ids) for i in mb.indices],
                "scale": [
                    [self._token_scale(batch[i], len(indices), num_tokens)] * len(batch[i].response_token_ids)
                    for i in mb.indices
                ],
            }
            extra["old"] = (
                [old[i, : len(batch[i].response_token_ids)].tolist() for i in mb.indices]
                if old is not None
                else extra["rollout"]
            )
            if ref is not None:
                extra["ref"] = [ref[i, : len(batch[i].response_token_ids)].tolist() for i in mb.indices]
            rows = self._rows(batch, mb, extra)
            output = self._stage_forward(self.model, rows, requires_grad=True)
            if self.info.is_last_stage:
                logp, entropy = self._logprobs(output, rows.targets, with_entropy=True)
                terms = grpo_token_loss(
                    logp,
                    rows.values["old"],
                    rows.values["rollout"],
                    rows.values["advantage"],
                    rows.mask,
                    self.cfg.grpo,
                    ref_logp=rows.values.get("ref"),
                    entropy=entropy,
                    scale=rows.values["scale"],
                )
                # Scales are of the global mini-batch: micro-batches and DP ranks sum to its loss.
                terms.objective.backward()
                stats += torch.tensor(
                    [
                        terms.loss_sum.item(),
                        terms.pg_sum.item(),
                        terms.kl_sum.item(),
                        terms.entropy_sum.item(),
                        terms.clipped_tokens.item(),
                        rows.mask.sum().item(),
                    ],
                    dtype=torch.float64,
                )
            else:
                self._send(output)
                output.backward(self._recv(output.shape, output.dtype, self._next_rank))
            if not self.info.is_first_stage:
                self._send_grad(rows)
        return stats

    def _token_scale(self, trajectory: Trajectory, num_rows: int, num_tokens: int) -> float:
        """Weight of each of `trajectory`'s tokens in a mini-batch of `num_rows` trajectories and
        `num_tokens` masked tokens (`GrpoConfig.loss_aggregation`)."""
        if self.cfg.grpo.loss_aggregation == "sequence_mean":
            return 1.0 / (max(sum(trajectory.loss_mask), 1) * num_rows)
        return 1.0 / max(num_tokens, 1)

    # -- pipeline plumbing -----------------------------------------------------------------------

    def _share(self) -> tuple[int, int]:
        """(this rank's DP share, number of shares): Megatron's DP rank and size, or the
        peer's view when hybrid replicas take shares too."""
        if self.peer is not None:
            return self.peer.share()
        return self.info.dp_rank, self.info.dp_size

    def _my_micro_batches(
        self, trajectories: Sequence[Trajectory], indices, share: tuple[int, int] | None = None
    ) -> list[MicroBatch]:
        rank, size = share or self._share()
        indices = list(indices)
        lengths = {i: len(trajectories[i].token_ids) for i in indices}
        shares = split_across_ranks([lengths[i] for i in indices], size)
        mine = [indices[k] for k in shares[rank]]
        return make_micro_batches(mine, lengths, self.cfg.max_tokens_per_microbatch)

    def _rows(self, trajectories: Sequence[Trajectory], mb: MicroBatch, extra: dict[str, list]) -> _Rows:
        chosen = [trajectories[i] for i in mb.indices]
        length = mb.padded_length
        tokens = pad_rows([t.token_ids for t in chosen], length)
        targets = torch.zeros_like(tokens)
        targets[:, :-1] = tokens[:, 1:]
        mask = torch.zeros(len(chosen), length, dtype=torch.float32)
        values = {name: torch.zeros(len(chosen), length, dtype=torch.float32) for name in extra}
        for row, t in enumerate(chosen):
            start, n = len(t.prompt_token_ids) - 1, len(t.response_token_ids)
            mask[row, start : start + n] = torch.tensor(t.loss_mask, dtype=torch.float32)
            for name, rows in extra.items():
                values[name][row, start : start + n] = torch.tensor(rows[row], dtype=torch.float32)
        return _Rows(
            tokens.to(self.device),
            targets.to(self.device),
            mask.to(self.device),
            {k: v.to(self.device) for k, v in values.items()},
        )

    def _stage_forward(self, model, rows: _Rows, requires_grad: bool) -> torch.Tensor:
        """This stage's output: hidden states [S, B, H] to send on, or logits [B, S, V/TP]."""
        if not self.info.is_first_stage:
            shape = (rows.tokens.shape[1], rows.tokens.shape[0], self.arch.hidden_size)
            received = self._recv(shape, self.dtype, self._prev_rank).requires_grad_(requires_grad)
            rows.values["_input"] = received
            model.set_input_tensor(received)
        positions = torch.arange(rows.tokens.shape[1], device=self.device).expand_as(rows.tokens)
        return model(rows.tokens, positions, None)

    def _logprobs(self, logits_BSV: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
        logits = mask_vocab_padding(logits_BSV, self._vocab_start, self.arch.vocab_size)
        if self.cfg.grpo.temperature != 1.0:
            logits = logits / self.cfg.grpo.temperature
        return logprobs_and_entropy(
            logits, targets, self._vocab_start, self._tp_group, self.info.tp_size, with_entropy=with_entropy
        )

    def _send(self, tensor: torch.Tensor) -> None:
        dist.send(tensor.detach().contiguous(), self._next_rank)

    def _recv(self, shape, dtype, source: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buffer, source)
        return buffer

    def _send_grad(self, rows: _Rows) -> None:
        received = rows.values["_input"]
        grad = received.grad if received.grad is not None else torch.zeros_like(received)
        dist.send(grad.contiguous(), self._prev_rank)

    # -- gradients -------------------------------------------------------------------------------

    def _reduce_grads(self) -> None:
        from megatron.core import parallel_state as ps

        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.info.dp_size > 1:
            for p in params:
                dist.all_reduce(p.grad, group=self._dp_group)
        if (
            self.arch.tie_word_embeddings
            and self.info.pp_size > 1
            and (self.info.is_first_stage or self.info.is_last_stage)
        ):
            shared = self.model.shared_embedding_or_output_weight()
            dist.all_reduce(shared.grad, group=ps.get_embedding_group())
        if self.arch.qk_norm and self.info.tp_size > 1:
            for name, p in self.model.named_parameters():
                if "q_layernorm" in name or "k_layernorm" in name:
                    dist.all_reduce(p.grad, group=self._tp_group)

    def _clip_grads(self) -> float:
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        duplicate_tied = None
        if self.arch.tie_word_embeddings and self.info.pp_size > 1 and self.info.is_last_stage:
            duplicate_tied = self.model.shared_embedding_or_output_weight()
        squares = torch.zeros((), dtype=torch.float64)
        for p in self.model.parameters():
            if p.grad is None or p is duplicate_tied or not param_is_not_tensor_parallel_duplicate(p):
                continue
            squares += p.grad.double().pow(2).sum()
        dist.all_reduce(squares, group=self._mp_group)
        norm = squares.sqrt().item()
        if self.cfg.grad_clip > 0 and norm > self.cfg.grad_clip:
            scale = self.cfg.grad_clip / (norm + 1e-6)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    # -- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        """Megatron `dist_checkpointing` (torch_dist): loadable at any other TP/PP. Holds the
        model, the AdamW state, the KL reference weights (when KL is on), the policy version and
        the staleness gate's counters."""
        from pathlib import Path

        from megatron.core import dist_checkpointing

        from libra.training.checkpoint_strategy import in_thread_save_strategy

        if dist.get_rank() == 0:
            Path(directory).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        # Megatron's default writer forks, which hangs inside the gRPC worker (see the module).
        dist_checkpointing.save(
            self._sharded_state_dict(), directory, sharded_strategy=in_thread_save_strategy()
        )

    def load_checkpoint(self, directory: str, release_in_flight: bool = True) -> None:
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self._sharded_state_dict(), directory)
        _load_params(self.model, loaded["model"])
        if self.ref_model is not None:
            _load_params(
                self.ref_model, {k.removeprefix("reference."): v for k, v in loaded["reference"].items()}
            )
        optim = self.optimizer.state_dict()
        for param_id, state in loaded["optimizer"]["state"].items():
            optim["state"][param_id].update({k: v.clone() for k, v in state.items()})
            optim["state"][param_id]["step"] = torch.tensor(float(loaded["libra"]["adam_step"]))
        self.optimizer.load_state_dict(optim)
        self.gate.load_state_dict(loaded["libra"]["staleness"], release_in_flight=release_in_flight)

    def _sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        self._init_optimizer_state()
        model_sd = self.model.sharded_state_dict(prefix="")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        optim_sd = self.optimizer.state_dict()
        step = int(next(iter(optim_sd["state"].values()))["step"].item())
        optim_state_to_sharding_state(
            optim_sd, get_param_id_to_sharded_param_map(model_sd, params), exclude_keys=("step",)
        )
        state = {
            "model": model_sd,
            "optimizer": optim_sd,
            "libra": {
                "adam_step": step,
                "staleness": self.gate.state_dict(),
                "architecture": self.arch.to_dict(),
            },
        }
        if self.ref_model is not None:
            state["reference"] = self.ref_model.sharded_state_dict(prefix="reference.")
        return state

    def _init_optimizer_state(self) -> None:
        """AdamW creates its state lazily at the first step; a checkpoint needs it to exist."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if not self.optimizer.state[p]:
                    self.optimizer.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }


class GradientPeer(Protocol):
    """The engine's hooks for the elastic hybrid pool (implemented in `libra.training.hybrid`)."""

    def share(self) -> tuple[int, int]:
        """(this rank's share of the global batch, number of shares) for the current step."""

    def computes(self) -> bool:
        """False on a hybrid replica in ZERO_SYNC: it runs no forward/backward."""

    def add_logprobs(
        self, out: torch.Tensor, fill_in: Callable[[tuple[int, int]], torch.Tensor]
    ) -> torch.Tensor:
        """This rank's rows plus those of the hybrid replica it pairs with, before the DP
        reduction (`fill_in(share)` scores a share here when its replica failed)."""

    def logprobs_reduced(self, out: torch.Tensor) -> torch.Tensor:
        """The full table once the core has reduced it (a hybrid replica receives it here)."""

    def reduce_gradients(
        self, engine: TrainEngine, stats: torch.Tensor, fill_in: Callable[[tuple[int, int]], torch.Tensor]
    ) -> torch.Tensor:
        """Leaves the globally reduced gradients in the parameters' `.grad`; returns the summed
        stats of the whole mini-batch."""


def _check_batch(trajectories: Sequence[Trajectory]) -> None:
    if not trajectories:
        raise ValueError("empty batch of trajectories")
    for t in trajectories:
        n = len(t.response_token_ids)
        if not t.prompt_token_ids:
            raise ValueError(f"trajectory {t.trajectory_id} has an empty prompt")
        if not (len(t.loss_mask) == len(t.rollout_logprobs) == n):
            raise ValueError(
                f"trajectory {t.trajectory_id}: {n} response tokens but {len(t.loss_mask)} loss-mask and "
                f"{len(t.rollout_logprobs)} logprob entries"
            )


def _load_params(model: torch.nn.Module, state: dict) -> None:
    """`load_state_dict` that tolerates only missing `_extra_state` entries (never persisted by
    the local spec)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if not name.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")


def _chunks(count: int, parts: int) -> list[list[int]]:
    parts = min(parts, count)
    bounds = [count * k // parts for k in range(parts + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(parts)]
