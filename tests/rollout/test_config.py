"""Rollout config validation: each bad value raises ValueError naming its option."""

from __future__ import annotations

import pytest

from libra.rollout import AgentLoopConfig, InstanceConfig, SamplingSpec


@pytest.mark.parametrize(
    ("cls", "kwargs", "option"),
    [
        (InstanceConfig, {"dtype": "int8"}, "rollout.instance.dtype"),
        (InstanceConfig, {"max_model_len": 0}, "rollout.instance.max_model_len"),
        (InstanceConfig, {"tensor_parallel_size": 0}, "rollout.instance.tensor_parallel_size"),
        (InstanceConfig, {"stats_window_s": 0}, "rollout.instance.stats_window_s"),
        (AgentLoopConfig, {"max_turns": 0}, "rollout.agent.max_turns"),
        (AgentLoopConfig, {"top_p": 0}, "rollout.agent.top_p"),
        (AgentLoopConfig, {"temperature": -1}, "rollout.agent.temperature"),
        (AgentLoopConfig, {"temperature": 2.5}, "rollout.agent.temperature must be in"),
        (AgentLoopConfig, {"stream_chunk_tokens": -1}, "rollout.agent.stream_chunk_tokens"),
        (AgentLoopConfig, {"tool_timeout_s": 0}, "rollout.agent.tool_timeout_s"),
        (AgentLoopConfig, {"no_instance_wait_s": -1}, "rollout.agent.no_instance_wait_s"),
        (SamplingSpec, {"max_tokens": 0}, "max_tokens"),
        (SamplingSpec, {"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_values_name_the_option(cls, kwargs, option):
    with pytest.raises(ValueError, match=option.replace(".", r"\.")):
        cls(**kwargs)
