"""Config of the OpenAI-compatible endpoint: the `endpoint` section of `LibraConfig`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EndpointConfig:
    """The job's OpenAI-compatible HTTP endpoint in front of its rollout pool (`libra.endpoint`)."""

    serve: bool = False
    """Serve the endpoint during the job (on whenever `endpoint.agent` is set). Sessions the job
    did not open are served, not trained on."""
    agent: str = ""
    """A user's agent (`package.module:function`, async, given a `libra.job.agents.AgentContext`)
    that the job runs for each trajectory in place of the built-in agent loop: it talks to the
    endpoint with any OpenAI client, and the tokens sampled for its session are what the job
    trains on. Its return value (a float, or None) is the reward; see `examples/openai_agent.py`."""
    port: int = 0
    """Port on `control.host` (0: any free port); the URL is written to `<run_dir>/endpoint.url`."""
    served_model_name: str = "libra-policy"
    """The model name `/v1/models` lists and responses carry (requests may name any model)."""
    max_sessions: int = 4096
    """Sessions of outside clients held at once; a request opening one more is refused (HTTP 429).
    The job's own sessions are bounded by its staleness gate."""
    session_idle_s: float = 900.0
    """A session the job did not open is closed after this long without a call."""
    max_n: int = 16
    """Largest `n` (choices per request)."""
    agent_timeout_s: float = 3600.0
    """An agent still running after this long is given up (its trajectory ends as an error):
    the steps that wait for its group (`training.staleness_mode=wait`) and its gate slots are
    not held forever."""

    def __post_init__(self) -> None:
        if self.agent and self.agent.count(":") != 1:
            raise ValueError(f"endpoint.agent must be 'package.module:function', got {self.agent!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"endpoint.port must be 0 (any free port) or a port 1..65535, got {self.port}")
        if not self.served_model_name:
            raise ValueError("endpoint.served_model_name must not be empty")
        for name in ("max_sessions", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"endpoint.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("session_idle_s", "agent_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"endpoint.{name} must be > 0, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return self.serve or bool(self.agent)
