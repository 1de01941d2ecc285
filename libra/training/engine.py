"""One train rank: a Megatron `GPTModel` stage with per-token logprobs, GRPO steps, checkpoints
and HF export, trained through Megatron's own machinery on every backend:

- the model wrapped in Megatron `DistributedDataParallel` (contiguous fp32 grad buffers in
  buckets; the DP reduction, optionally overlapped with backward);
- the optimizer from `get_megatron_optimizer`: fp32 main parameters for a bf16 model (an update
  of 1e-6 rounds away on a bf16 weight), and with the distributed optimizer the main parameters
  and Adam state sharded across DP (ZeRO-1);
- micro-batches and pipeline stages through `get_forward_backward_func` (1F1B when PP > 1);
- Megatron's `finalize_model_grads` for the DP reduction, the tied embedding across the first and
  last stage and Qwen3's per-head QK-norm weights across TP.

The cpu backend's patches (`libra.backends.cpu_megatron_patches`) let this run over gloo.

Every rank of a job receives the same global batch and derives the same plan from it (DP shares,
micro-batches), so peers agree without extra messages. The GRPO objective of a micro-batch is
already weighted by its share of the whole mini-batch (`_token_scale`), so the schedules run with
`calculate_per_token_loss` (no division by the micro-batch count) and DDP sums over DP rather
than averaging: after the reduction every rank holds the mini-batch's gradient.

Token layout: a trajectory is `prompt + response` (P + R tokens) fed as one row; the logits at
position t predict token t+1, so response token j is scored at position P - 1 + j.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from libra.training.batching import MicroBatch, make_micro_batches, pad_rows, split_across_ranks
from libra.training.config import TrainingConfig
from libra.training.grpo import group_advantages, groups_with_variance, grpo_token_loss
from libra.training.hf_weights import hf_to_megatron, local_spec_names, megatron_to_hf
from libra.training.model import (
    ModelArchitecture,
    build_gpt_model,
    padded_vocab_size,
    transformer_engine_usable,
)
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

    indices: tuple[int, ...]
    """The rows' positions in the batch."""
    tokens: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    values: dict[str, torch.Tensor]


class TrainEngine:
    def __init__(
        self,
        arch: ModelArchitecture,
        cfg: TrainingConfig,
        info: RankInfo,
        device: torch.device | None = None,
        with_optimizer: bool = True,
    ):
        """`with_optimizer=False`: a replica that only computes gradients and takes its weights
        from elsewhere (an elastic hybrid replica): no fp32 main copy, no Adam state."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if (info.tp_size, info.pp_size, info.dp_size) != (
            cfg.tensor_parallel,
            cfg.pipeline_parallel,
            cfg.data_parallel,
        ):
            raise ValueError(
                f"process groups are TP={info.tp_size} PP={info.pp_size} DP={info.dp_size} but the config "
                f"asks for TP={cfg.tensor_parallel} PP={cfg.pipeline_parallel} DP={cfg.data_parallel}"
            )
        if cfg.train_batch_size is None:
            raise ValueError(
                "training.train_batch_size is unset: state it, or start the trainer from a run's "
                "resolved config (LibraConfig.resolved derives it from the job's batch)"
            )
        self.arch, self.cfg, self.info = arch, cfg, info
        self.device = device or torch.device("cpu")
        self.te_names = transformer_engine_usable(self.device)
        """The model is built with Transformer Engine's layer spec (where usable), whose parameter
        names differ from the local spec's."""
        self.dtype = _DTYPES[cfg.dtype]
        self.model = self._build_stage(cfg.recompute)
        """The bare stage: parameter names, export, checkpoints."""
        self.ddp_model = _wrap_in_ddp(self.model, cfg)
        """What runs forward and backward."""
        self.optimizer = _build_optimizer(self.ddp_model, cfg) if with_optimizer else None
        self._forward_backward = get_forward_backward_func()
        self.gate = StalenessGate(cfg.max_staleness, cfg.train_batch_size, tail_staleness=cfg.tail_staleness)
        self.ref_model = None
        self._ref_forward = None
        self._dp_group = ps.get_data_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._vocab_start = info.tp_rank * padded_vocab_size(arch.vocab_size, info.tp_size) // info.tp_size
        self.peer: GradientPeer | None = None
        """Set while this rank exchanges gradients with an elastic hybrid replica
        (`libra.training.hybrid`); None: plain Megatron DP."""
        self.reset_reference()

    def _build_stage(self, recompute: str = "none"):
        return build_gpt_model(
            self.arch,
            self.info.tp_size,
            self.info.pp_size,
            pre_process=self.info.is_first_stage,
            post_process=self.info.is_last_stage,
            dtype=self.dtype,
            device=self.device,
            recompute=recompute,
            transformer_engine=self.te_names,
        )

    @property
    def version(self) -> int:
        return self.gate.version

    # -- weights ---------------------------------------------------------------------------------

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """In a fixed order, the same on every replica of this stage."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def main_grads(self) -> list[torch.Tensor]:
        """This rank's (fp32) gradient of each trainable parameter: views into DDP's grad buffers."""
        return [p.main_grad for p in self.trainable_parameters()]

    def load_hf(self, get_hf: Callable[[str], torch.Tensor]) -> None:
        """Loads full HF tensors (`hf_weights.hf_tensor_reader`) into this rank's shard."""
        shards = hf_to_megatron(
            get_hf,
            self.arch,
            tp_rank=self.info.tp_rank,
            tp_size=self.info.tp_size,
            pp_rank=self.info.pp_rank,
            pp_size=self.info.pp_size,
            te_names=self.te_names,
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
        self.weights_changed()
        self.reset_reference()

    def weights_changed(self) -> None:
        """The model's parameters were written from outside: the optimizer's fp32 main copy (or
        its DP shard of it) takes them over."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def reset_reference(self) -> None:
        """The KL reference policy becomes a frozen copy of the current weights (when KL is on)."""
        if self.cfg.grpo.kl_coef <= 0:
            return
        if self.ref_model is None:
            # A second stage built the same way (models hold process groups: no deepcopy).
            self.ref_model = self._build_stage().requires_grad_(False)
            self._ref_forward = _in_params_dtype(self.ref_model)
        with torch.no_grad():
            for ref, current in zip(self.ref_model.parameters(), self.model.parameters(), strict=True):
                ref.copy_(current)

    def export_hf(self) -> dict[str, torch.Tensor]:
        """The whole model as HF tensors, on every rank (gathers TP shards, then PP stages)."""
        local = {name: p.detach() for name, p in self.model.named_parameters()}
        tp_shards: list[dict[str, torch.Tensor]] = [None] * self.info.tp_size  # type: ignore[list-item]
        dist.all_gather_object(tp_shards, local, group=self._tp_group)
        stage = megatron_to_hf(
            tp_shards, self.arch, pp_rank=self.info.pp_rank, pp_size=self.info.pp_size, te_names=self.te_names
        )
        stages: list[dict[str, torch.Tensor]] = [None] * self.info.pp_size  # type: ignore[list-item]
        dist.all_gather_object(stages, stage, group=self._pp_group)
        return {name: tensor for part in stages for name, tensor in part.items()}

    def publishable_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by the names weight publication's layouts use (the local layer
        spec's, whichever spec the model was built with)."""
        return local_spec_names(dict(self.model.named_parameters()), self.te_names)

    # -- logprobs --------------------------------------------------------------------------------

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Per response token logprob under the current policy (0.0 where the loss mask is 0)."""
        _check_batch(trajectories)
        # Outside a train step: no exchange with a hybrid replica, this rank's DP layout only.
        padded = self._forward_only(trajectories, self.ddp_model, with_peer=False)
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
        return out.cpu()

    @torch.no_grad()
    def _forward_share(
        self, trajectories: Sequence[Trajectory], model, share: tuple[int, int]
    ) -> torch.Tensor:
        """The logprobs of one DP share's rows (zeros elsewhere), on the last stage; on the device,
        where the collectives that gather them run."""
        width = max(len(t.response_token_ids) for t in trajectories)
        out = torch.zeros(len(trajectories), width, dtype=torch.float32, device=self.device)

        def score(rows: _Rows, logits: torch.Tensor) -> torch.Tensor:
            logp, _ = self._logprobs(logits, rows.targets, with_entropy=False)
            for row, index in enumerate(rows.indices):
                start = len(trajectories[index].prompt_token_ids) - 1
                n = len(trajectories[index].response_token_ids)
                out[index, :n] = (logp[row, start : start + n] * rows.mask[row, start : start + n]).float()
            return logits.new_zeros(())

        micro_batches = self._my_micro_batches(trajectories, range(len(trajectories)), share)
        rows = [self._rows(trajectories, mb, {}) for mb in micro_batches]
        self._run_schedule(model, rows, score, forward_only=True)
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
            old = self._forward_only(batch, self.ddp_model) if self.cfg.recompute_old_logprobs else None
            ref = self._forward_only(batch, self._ref_forward) if self.ref_model is not None else None
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
        """Forward/backward over this rank's micro-batches of the mini-batch `indices`, then the
        reduction and the optimizer step. Returns [loss, pg, kl, entropy, clipped, tokens] sums of
        the whole mini-batch (all ranks) and the grad norm before clipping."""
        num_tokens = sum(sum(batch[i].loss_mask) for i in indices)
        self.ddp_model.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

        def backward(share: tuple[int, int]) -> torch.Tensor:
            return self._backward_share(batch, indices, advantages, old, ref, num_tokens, share)

        if self.peer is None:
            return self.reduce_and_step(backward(self._share()))
        stats = (
            backward(self._share())
            if self.peer.computes()
            else torch.zeros(6, dtype=torch.float64, device=self.device)
        )
        # The peer adds the hybrid replica's gradients before the DP reduction and sends the
        # stepped weights back (or, on the hybrid side, sends its gradients and takes the
        # weights); `backward(share)` computes a share here when the replica that owned it failed.
        return self.peer.step(self, stats, backward)

    def reduce_and_step(self, stats: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The core's reduction (DP, tied embedding, QK-norm; the stats' sum) and optimizer step.
        Returns the mini-batch's stats and the grad norm before clipping."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        if self.optimizer is None:
            raise RuntimeError("this replica was built without an optimizer: it cannot step")
        if self.cfg.overlap_grad_reduce:
            self._start_pending_grad_sync()
        finalize_model_grads([self.ddp_model])
        dist.all_reduce(stats, group=self._dp_group)
        dist.all_reduce(stats, group=self._pp_group)
        # bf16 and fp32 have no loss scaler, so Megatron always steps; it computes the norm only
        # to clip with.
        _, grad_norm, _ = self.optimizer.step()
        if self.cfg.grad_clip <= 0:
            grad_norm = self.optimizer.get_grad_norm()
        grad_norm = float(grad_norm)
        if not math.isfinite(grad_norm):
            # The norm is reduced over every rank of the layout: all of them stop here.
            raise RuntimeError(
                f"non-finite gradient norm {grad_norm} at policy version {self.version}: the weights are "
                "no longer usable; resume from the last checkpoint (lower training.lr?)"
            )
        return stats.cpu(), grad_norm

    def _start_pending_grad_sync(self) -> None:
        """With overlap, backward's last micro-batch starts each bucket's DP reduction; a rank that
        ran no backward (an empty share) or deferred it (gradients still to come from a hybrid
        replica) starts the rest here, so that `finish_grad_sync` has something to wait for."""
        # In bucket order: the order backward completes them in (buckets are laid out in reverse
        # parameter order), so every rank issues its collectives in the same order.
        for group in self.ddp_model.bucket_groups + self.ddp_model.expert_parallel_bucket_groups:
            if group.grad_reduce_handle is None:
                group.start_grad_sync()

    def _backward_share(self, batch, indices, advantages, old, ref, num_tokens, share) -> torch.Tensor:
        """Forward/backward of one DP share of the mini-batch `indices`, accumulating into the
        grad buffers; returns that share's [loss, pg, kl, entropy, clipped, tokens] sums (on the
        device: no host synchronisation per micro-batch)."""
        stats = torch.zeros(6, dtype=torch.float64, device=self.device)
        rows = []
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
            rows.append(self._rows(batch, mb, extra))

        def objective(rows: _Rows, logits: torch.Tensor) -> torch.Tensor:
            logp, entropy = self._logprobs(logits, rows.targets, with_entropy=True)
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
            sums = (terms.loss_sum, terms.pg_sum, terms.kl_sum, terms.entropy_sum, terms.clipped_tokens)
            stats.add_(torch.stack([*(x.detach().double() for x in sums), rows.mask.sum().double()]))
            # Scales are of the global mini-batch: micro-batches and DP ranks sum to its loss.
            return terms.objective

        with self._grad_sync_deferred(self.peer is not None and self.peer.defers_reduction()):
            self._run_schedule(self.ddp_model, rows, objective, forward_only=False)
        return stats

    @contextlib.contextmanager
    def _grad_sync_deferred(self, defer: bool) -> Iterator[None]:
        """While a hybrid replica's gradients are still to be added, no micro-batch's backward may
        start the DP reduction (the schedule would let the last one do so)."""
        if not defer:
            yield
            return
        config = self.model.config
        no_sync_func, config.no_sync_func = config.no_sync_func, None
        try:
            with self.ddp_model.no_sync():
                yield
        finally:
            config.no_sync_func = no_sync_func

    def _token_scale(self, trajectory: Trajectory, num_rows: int, num_tokens: int) -> float:
        """Weight of each of `trajectory`'s tokens in a mini-batch of `num_rows` trajectories and
        `num_tokens` masked tokens (`GrpoConfig.loss_aggregation`)."""
        if self.cfg.grpo.loss_aggregation == "sequence_mean":
            return 1.0 / (max(sum(trajectory.loss_mask), 1) * num_rows)
        return 1.0 / max(num_tokens, 1)

    # -- the schedule ----------------------------------------------------------------------------

    def _run_schedule(
        self,
        model,
        rows: list[_Rows],
        on_logits: Callable[[_Rows, torch.Tensor], torch.Tensor],
        forward_only: bool,
    ) -> None:
        """Runs `rows` through Megatron's schedule for this layout (1F1B across the pipeline
        stages); on the last stage `on_logits(rows, logits [B, S, V/TP])` gives each micro-batch's
        objective (backward runs from it unless `forward_only`). A rank with no rows (an empty DP
        share) runs nothing: its gradients stay zero and the reduction still counts it."""
        if not rows:
            return
        positions = {}

        def forward_step(data_iterator, stage):
            micro_batch = next(data_iterator)
            length = micro_batch.tokens.shape[1]
            if length not in positions:
                positions[length] = torch.arange(length, device=self.device)[None, :]
            output = stage(micro_batch.tokens, positions[length].expand_as(micro_batch.tokens), None)

            def loss(logits: torch.Tensor):
                objective = on_logits(micro_batch, logits)
                return objective, micro_batch.mask.sum().to(torch.int), {}

            return output, loss

        self._forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(rows),
            model=[model],
            num_microbatches=len(rows),
            seq_length=rows[0].tokens.shape[1],
            micro_batch_size=rows[0].tokens.shape[0],
            forward_only=forward_only,
        )

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
            tuple(mb.indices),
            tokens.to(self.device),
            targets.to(self.device),
            mask.to(self.device),
            {k: v.to(self.device) for k, v in values.items()},
        )

    def _logprobs(self, logits_BSV: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
        logits = mask_vocab_padding(logits_BSV, self._vocab_start, self.arch.vocab_size)
        if self.cfg.grpo.temperature != 1.0:
            logits = logits / self.cfg.grpo.temperature
        return logprobs_and_entropy(
            logits, targets, self._vocab_start, self._tp_group, self.info.tp_size, with_entropy=with_entropy
        )

    # -- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        """Megatron `dist_checkpointing` (torch_dist): loadable at any other TP/PP/DP. Holds the
        model, the optimizer's fp32 main parameters and Adam state (sharded as the distributed
        optimizer shards them), the KL reference weights (when KL is on), the policy version and
        the staleness gate's counters."""
        from pathlib import Path

        from megatron.core import dist_checkpointing

        from libra.training.checkpoint_strategy import in_thread_save_strategy

        if dist.get_rank() == 0:
            Path(directory).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        # Megatron's default writer forks, which hangs inside the gRPC worker (see the module).
        dist_checkpointing.save(
            self._sharded_state_dict(loading=False), directory, sharded_strategy=in_thread_save_strategy()
        )

    def load_checkpoint(self, directory: str, release_in_flight: bool = True) -> None:
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self._sharded_state_dict(loading=True), directory)
        _load_params(self.model, loaded["model"])
        if self.ref_model is not None:
            _load_params(
                self.ref_model, {k.removeprefix("reference."): v for k, v in loaded["reference"].items()}
            )
        if self.optimizer is not None:
            _load_optimizer_state(self.optimizer, loaded["optimizer"])
            # The checkpoint's param groups came with it: the configured rate and decay hold.
            _set_rate_and_decay(self.optimizer, self.cfg)
        self.gate.load_state_dict(loaded["libra"]["staleness"], release_in_flight=release_in_flight)

    def _sharded_state_dict(self, loading: bool) -> dict:
        model_sd = self.model.sharded_state_dict(prefix="")
        state = {
            "model": model_sd,
            "libra": {"staleness": self.gate.state_dict(), "architecture": self.arch.to_dict()},
        }
        if self.optimizer is not None:
            self._init_optimizer_state()
            # The distributed optimizer's layout that loads at any other TP/PP/DP (its shards are
            # gathered in model space); on the CPU over gloo, which the gather otherwise avoids.
            metadata = {
                "distrib_optim_sharding_type": "fully_reshardable",
                "distrib_optim_fully_reshardable_mem_efficient": self.device.type == "cpu",
            }
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, is_loading=loading, metadata=metadata
            )
        if self.ref_model is not None:
            state["reference"] = self.ref_model.sharded_state_dict(prefix="reference.")
        return state

    def _init_optimizer_state(self) -> None:
        """Adam creates its state at the first step; a checkpoint needs it to exist, both to save
        before one and to load into a fresh optimizer."""
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = optimizer.optimizer
            params = [p for group in inner.param_groups for p in group["params"]]
            if any(len(inner.state[p]) == 0 for p in params):
                optimizer.init_state_fn(inner, optimizer.config)
                if isinstance(inner, torch.optim.Adam):  # AdamW too
                    for p in params:  # torch's Adam counts steps per parameter (TE's, per group)
                        inner.state[p].setdefault("step", torch.tensor(0.0))

    def _inner_optimizers(self) -> list:
        """The torch optimizers inside Megatron's: they step the fp32 main parameters."""
        if self.optimizer is None:
            return []
        return [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def main_parameters(self) -> list[torch.Tensor]:
        """The parameters the optimizer steps: fp32 main copies for a bf16 model (this rank's DP
        shard of them with the distributed optimizer), else the model's own parameters."""
        return [
            p for inner in self._inner_optimizers() for group in inner.param_groups for p in group["params"]
        ]

    def optimizer_state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer (after its first step): main parameters that
        are not the model's own, and Adam's moments."""
        model_storage = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        total = 0
        for inner in self._inner_optimizers():
            for group in inner.param_groups:
                for p in group["params"]:
                    if p.untyped_storage().data_ptr() not in model_storage:
                        total += p.numel() * p.element_size()
                    total += sum(
                        v.numel() * v.element_size()
                        for v in inner.state[p].values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0
                    )
        return total


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

    def defers_reduction(self) -> bool:
        """Whether this step's gradients meet another replica's before the DP reduction (which
        then must not start during backward)."""

    def step(
        self, engine: TrainEngine, stats: torch.Tensor, fill_in: Callable[[tuple[int, int]], torch.Tensor]
    ) -> tuple[torch.Tensor, float]:
        """Completes the optimizer step of a mini-batch whose local gradients are in the grad
        buffers, leaving the stepped weights in the model; returns the summed stats of the whole
        mini-batch and the grad norm before clipping."""


def _wrap_in_ddp(model, cfg: TrainingConfig):
    """Megatron DDP around the stage (and a `Float16Module` for a bf16 one, which hands the last
    stage's logits on in fp32): gradients accumulate in fp32 buffers, reduced over DP in buckets."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=cfg.overlap_grad_reduce,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        ),
        _in_params_dtype(model),
    )
    # The schedules hold back the reduction until the last micro-batch's backward.
    model.config.no_sync_func = ddp.no_sync
    return ddp


def _in_params_dtype(model):
    from megatron.core.transformer.module import Float16Module

    return Float16Module(model.config, model) if model.config.bf16 else model


def _build_optimizer(ddp_model, cfg: TrainingConfig):
    """Megatron's Adam (decoupled weight decay) over DDP's buffers; fp32 main parameters for a
    bf16 model; sharded over DP with the distributed optimizer."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = cfg.dtype == "bfloat16"
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.grad_clip,
            bf16=bf16,
            params_dtype=_DTYPES[cfg.dtype],
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        ),
        [ddp_model],
    )
    _set_rate_and_decay(optimizer, cfg)
    return optimizer


def _set_rate_and_decay(optimizer, cfg: TrainingConfig) -> None:
    """The learning rate is constant: each group's rate and decay are set here (Megatron's groups
    carry multipliers, e.g. no decay on norms, that its LR scheduler would apply)."""
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = cfg.weight_decay * group.get("wd_mult", 1.0)


def _load_optimizer_state(optimizer, state: dict) -> None:
    """Megatron's `optimizer.load_state_dict(state)`, mended for megatron-core 0.16's distributed
    optimizer over torch's Adam (no TE or Apex: the CPU, or a GPU without them):
    - it allocates the state it loads only into an optimizer that holds none (the state made to
      describe the checkpoint goes first);
    - it gives every parameter Adam's `step` from the param groups, then copies every state key
      from the loaded tensors, which carry none (KeyError): the copy runs with `step` set aside;
    - that `step` is one tensor shared by all parameters, which torch's Adam increments once per
      parameter per step (wrong bias correction from the first step on): each gets its own.
    The non-distributed optimizers drop a zero step when saving, which torch's Adam cannot load."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for part in chained:
        part.optimizer.state.clear()
        if not isinstance(part, DistributedOptimizer) and isinstance(part.optimizer, torch.optim.Adam):
            # The non-distributed optimizers save torch Adam's step only once it is nonzero; the
            # states they load need one (a checkpoint taken before the first step).
            inner_state = state.get("optimizer", state)["state"]  # FP32Optimizer does not nest it
            inner_state.setdefault("common_step", torch.tensor(0.0))
    originals = {}
    for part in chained:
        if not isinstance(part, DistributedOptimizer):
            continue
        originals[part] = copy_states = part._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, part=part, copy_states=copy_states):
            group_index, group_order = part.model_param_group_index_map[model_param]
            param_state = part.optimizer.state[
                part.optimizer.param_groups[group_index]["params"][group_order]
            ]
            step = param_state.pop("step", None) if "step" not in tensors else None
            try:
                copy_states(model_param, tensors)
            finally:
                if step is not None:
                    param_state["step"] = step

        part._set_main_param_and_optimizer_states = set_states
    try:
        optimizer.load_state_dict(state)
    finally:
        for part in originals:
            del part._set_main_param_and_optimizer_states  # the class's method again
    for part in chained:
        for param_state in part.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()


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
