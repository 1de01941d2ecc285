"""The scripted model's build (`scripted_model.py`): the model the agent-loop tests decode follows
every dialog of its script greedily, with `MIN_MARGIN` to spare at every scripted token, as saved
and loaded again; a build that cannot get there fails naming the dialog and writes nothing."""

from __future__ import annotations

import pytest

from tests.rollout.scripted_model import (
    ScriptedModelError,
    dialogs,
    first_failure,
    scripted_chat,
    train_scripted_model,
)


def test_the_saved_model_reproduces_every_dialog(model_dirs, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs.scripted, dtype=torch.float32).eval()
    chat = scripted_chat(tokenizer)
    assert first_failure(model, chat, dialogs(chat)) is None


def test_a_build_that_does_not_reproduce_its_dialogs_fails_and_writes_nothing(model_dirs, tmp_path):
    out = tmp_path / "scripted"
    with pytest.raises(
        ScriptedModelError, match=r"after 0 steps: dialog '.+', turn 0: greedy decoding produced"
    ):
        train_scripted_model(model_dirs.random, out, max_steps=0)
    assert not out.exists()
