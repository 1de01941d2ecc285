"""The OpenAI-compatible endpoint: the job's rollout pool behind `/v1/chat/completions`,
`/v1/completions` and `/v1/models`, for agents written against any OpenAI client.

It owns the sessions (`sessions`: each a trajectory, or several segments when a client rewrote
its history) and their exact tokens; a turn runs through the agent loop's `model_turn`, so the
router, weight versions and partial rollout treat these trajectories like built-in ones
(`service`). `messages` renders chat messages to tokens and model turns back; `requests` and
`responses` are the JSON edge; `server` the HTTP server (aiohttp), behind the run's bearer token.
"""
