"""Tasks: dataset loaders, procedural agentic tasks, rewards, and the tiny-model factory."""
