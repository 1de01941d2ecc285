"""Simulator validation on a hand-made run folder (the format `libra run` writes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra.sim.validation import read_run, validate_run

GROUPS, GROUP_SIZE, STEPS = 12, 4, 4
TRAIN_S = 2.0


def write_run(folder: Path) -> Path:
    """A tiny Llama served by 2 instances, 1 train rank; 12 groups of 4 two-turn trajectories;
    every step trains 8 trajectories in exactly 2 s; decode runs at 20 ms per step at batch 4."""
    model = folder / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "vocab_size": 512,
                "dtype": "float32",
            }
        )
    )
    run = folder / "run"
    run.mkdir()
    traces, samples = [], []
    for g in range(GROUPS):
        for i in range(GROUP_SIZE):
            trajectory_id = f"g{g}-{i}"
            turns = [
                {
                    "output_tokens": 30 + i,
                    "tool": "python",
                    "payload_tokens": 20,
                    "status": "success",
                    "tool_latency_s": 0.01,
                },
                {"output_tokens": 10},
            ]
            traces.append(
                {
                    "trajectory_id": trajectory_id,
                    "prompt_id": f"p{g}",
                    "group_id": f"g{g}",
                    "prompt_tokens": 50,
                    "turns": turns,
                }
            )
            samples.append({"trajectory_id": trajectory_id, "finished_s": g + i / 10})
    (run / "trajectories.jsonl").write_text("".join(json.dumps(t) + "\n" for t in reversed(traces)))
    (run / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    batch = GROUPS * GROUP_SIZE // (STEPS + 2)
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "step": s,
                    "num_trajectories": batch,
                    "step_time_s": 3.0,
                    "train_time_s": TRAIN_S - 0.1,
                    "publish_time_s": 0.1,
                    "logprob_abs_diff": float("nan"),
                }
            )
            + "\n"
            for s in range(1, STEPS + 1)
        )
    )
    (run / "occupancy.jsonl").write_text(
        "".join(
            json.dumps({"time_s": t, "buckets": {"short": 8, "long": 0}, "tokens_per_s": 2 * 4 / 0.02}) + "\n"
            for t in range(10)
        )
    )
    (run / "events.jsonl").write_text(
        json.dumps(
            {"kind": "started", "message": "2 rollout instances, 1 train rank(s)", "model": str(model)}
        )
        + "\n"
    )
    return run


def test_read_run(tmp_path: Path) -> None:
    record = read_run(write_run(tmp_path))
    assert (record.num_rollout_instances, record.num_train_ranks) == (2, 1)
    assert len(record.traces) == GROUPS * GROUP_SIZE and len(record.steps) == STEPS
    assert record.model.num_layers == 2 and record.model.bytes_per_param == 4
    assert record.occupancy[0] == (8, 400.0)
    assert record.finish_order[:2] == ("g0-0", "g0-1")


def test_replay_is_calibrated_on_the_run(tmp_path: Path) -> None:
    report = validate_run(write_run(tmp_path), max_staleness=1, skip_steps=1)
    # Training takes 2 s on every step, so the fit prices every held-out step at 2 s.
    assert all(e.predicted_s == pytest.approx(TRAIN_S, rel=1e-6) for e in report.calibration.train_errors)
    # (The simulated step adds the weight publication over the slot's link: under a millisecond.)
    assert [s.train_s for s in report.sim.steps] == pytest.approx([TRAIN_S] * STEPS, rel=1e-3)
    assert report.measured_step_s == [3.0] * (STEPS - 1)
    assert len(report.predicted_step_s) == STEPS - 1
    # A step can take no less than its training; the replay trains on the run's own trajectories.
    assert all(p >= TRAIN_S - 1e-9 for p in report.predicted_step_s)
    assert report.sim.started >= STEPS * 8
    assert report.relative_error == pytest.approx(report.predicted_mean_s / 3.0 - 1.0)


def test_not_a_run_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no trajectories.jsonl"):
        read_run(tmp_path)
