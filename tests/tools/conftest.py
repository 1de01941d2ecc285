"""One sandbox pool for the whole session, started while secrets sit in the environment (so the
tests that look for them test something), and driven from one event loop."""

from __future__ import annotations

import asyncio
import os

import pytest

from libra.rollout.tools.config import SandboxConfig
from libra.rollout.tools.sandbox import SandboxPool

SECRETS = {"LIBRA_TOKEN": "s3cret-libra-token-7f1d", "AWS_SECRET_ACCESS_KEY": "s3cret-aws-key-99ab"}


@pytest.fixture(scope="session")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def pool(loop):
    saved = {name: os.environ.get(name) for name in SECRETS}
    os.environ.update(SECRETS)
    config = SandboxConfig(
        num_workers=2, timeout_s=3.0, cpu_time_s=3.0, memory_mb=512, max_processes=24, max_output_bytes=8192
    )
    pool = loop.run_until_complete(SandboxPool(config).start())
    yield pool
    loop.run_until_complete(pool.close())
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
