"""A one-worker sandbox pool for code rewards and demonstration replays, on one event loop."""

from __future__ import annotations

import asyncio
import os

import pytest

from libra.rollout.tools.config import SandboxConfig
from libra.rollout.tools.sandbox import SandboxPool


@pytest.fixture(scope="session")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def pool(loop):
    if os.geteuid() != 0:
        pytest.skip("the sandbox's uid/namespace layers need root")
    pool = loop.run_until_complete(SandboxPool(SandboxConfig(num_workers=1, timeout_s=3.0)).start())
    yield pool
    loop.run_until_complete(pool.close())
