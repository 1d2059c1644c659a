"""Metric names with one prefix: TensorBoard tags of the SFT, evaluation and RL records (the real
tensorboardX writer, its event file read back), also for a resumed run folder's old records."""

from __future__ import annotations

import json
import struct

import pytest

from mempo_jax.run.metrics import MetricsWriter, tensorboard_tag


@pytest.mark.parametrize("stage, key, tag", [
    ("sft", "sft/loss", "sft/loss"),
    ("sft", "sft/grad_norm", "sft/grad_norm"),
    ("sft", "copy/loss", "sft/copy/loss"),
    ("eval_rl_k1", "eval/bridge/em", "eval_rl_k1/bridge/em"),
    ("eval_sft_full", "em", "eval_sft_full/em"),
    ("rl", "actor/grad_norm", "actor/grad_norm"),
    ("rl", "mem/reward/mean", "mem/reward/mean"),
])
def test_one_prefix(stage, key, tag):
    assert tensorboard_tag(stage, key) == tag


def _event_tags(tb_dir) -> set[str]:
    """Scalar tags in the TFRecord event files under ``tb_dir`` (length, crc, Event proto, crc)."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in tb_dir.iterdir():
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            tags |= {v.tag for v in event.summary.value}
            pos += 12 + length + 4
    return tags


def test_written_and_mirrored_tags_have_one_prefix(tmp_path):
    run = tmp_path / "run"
    writer = MetricsWriter(run)
    writer.write(1, "sft", {"sft/loss": 2.0, "sft/grad_norm": 1.0})
    writer.write(1, "eval_sft_k1", {"em": 0.5, "eval/bridge/em": 0.25})
    writer.write(1, "rl", {"actor/grad_norm": 0.1})
    writer.close()
    want = {"sft/loss", "sft/grad_norm", "eval_sft_k1/em", "eval_sft_k1/bridge/em", "actor/grad_norm"}
    assert _event_tags(run / "tb") == want
    # a resumed run rebuilds tb/ from metrics.jsonl's lines, which keep their keys
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0] == {"step": 1, "stage": "sft", "sft/loss": 2.0, "sft/grad_norm": 1.0}
    mirrored = tmp_path / "resumed"
    again = MetricsWriter(mirrored)
    again.mirror(records)
    again.close()
    assert _event_tags(mirrored / "tb") == want
