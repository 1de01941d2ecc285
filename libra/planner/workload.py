"""A synthetic long-tailed agentic request history, for sample configs, the benchmark and tests
(a live run feeds the planner the measured history instead)."""

from __future__ import annotations

import numpy as np

from libra.planner.config import RequestRecord


def synthetic_history(
    num_requests: int = 256,
    seed: int = 0,
    median_output_tokens: int = 2000,
    max_output_tokens: int = 30000,
    median_prompt_tokens: int = 1500,
    max_context_tokens: int = 32768,
    max_turns: int = 12,
    sigma: float = 1.0,
) -> tuple[RequestRecord, ...]:
    """Log-normal output lengths (a few trajectories carry most tokens), prompts that
    grow with the number of turns (each tool return is prefilled), clipped to the context."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(num_requests):
        output = int(np.clip(rng.lognormal(np.log(median_output_tokens), sigma), 16, max_output_tokens))
        turns = int(np.clip(1 + output // 2500 + rng.integers(0, 3), 1, max_turns))
        prompt = int(
            np.clip(rng.lognormal(np.log(median_prompt_tokens), 0.5) * (1 + 0.3 * (turns - 1)), 16, None)
        )
        prompt = min(prompt, max_context_tokens - output)
        records.append(
            RequestRecord(max(prompt, 0), output, turns, tool_time_s=float(rng.exponential(2.0) * turns))
        )
    return tuple(records)
