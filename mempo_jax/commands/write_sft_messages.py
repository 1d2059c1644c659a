"""``python -m mempo_jax.commands.write_sft_messages --out FILE [--gin_file F] [--gin_param B] [--split S]``.

Plays the scripted agent (``data/scripted_agent.py``) on the questions of a run config's dataset —
the embedded tiny world or a HotpotQA file (``ExperimentConfig.dataset`` / ``data_path``, split into
training and held-out questions by ``experiment.load_questions``) — against the run's tools and
writes one messages row per question (``data/messages.py``): the assistant contents are exactly the
``render_turn`` text of each turn, the tool contents the raw observation text. The file is what
``SFTConfig.data_path`` reads; ``.parquet`` in the name writes parquet (needs ``pyarrow``).

The generator is seeded by ``ExperimentConfig.seed`` and draws as the trainer's SFT stage does when it
plays the agent in memory (no ``SFTConfig.data_path``), so the file holds the same trajectories that the
default SFT stage trains on. Nothing is tokenised: no tokenizer or model is built.

Exit status: 0 written, 2 bad config or data (one line on stderr; nothing written).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from mempo_jax.commands.cli import command_name
from mempo_jax.config import DEFAULT_GIN
from mempo_jax.config_loader import load_run_config
from mempo_jax.data.messages import write_messages
from mempo_jax.data.scripted_agent import scripted_conversation
from mempo_jax.recipes import gin_file_help
from mempo_jax.run.experiment import load_questions
from mempo_jax.tools.search import search_environment


def _parse_args(argv):
    p = argparse.ArgumentParser(prog=command_name("mempo_jax.commands.write_sft_messages"),
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output file (.jsonl, or .parquet)")
    p.add_argument("--gin_file", action="append", default=None, help=gin_file_help())
    p.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. ExperimentConfig.seed=1")
    p.add_argument("--split", choices=("train", "heldout"), default="train",
                   help="which questions to play (default: train; heldout is for inspection, never train on it)")
    return p.parse_args(argv)


def scripted_conversations(cfg, split: str = "train"):
    """The scripted agent's conversations on a config's questions, as the trainer's SFT stage plays them.

    Args:
      cfg: an ``ExperimentConfig``.
      split: ``"train"`` or ``"heldout"``.

    Returns:
      ``(conversations, questions)``: one ``messages.Conversation`` per question, in question order.

    Raises:
      FileNotFoundError / ValueError: a missing or malformed data file (names it).
    """
    train_q, held_q, _, offices, backend, _ = load_questions(cfg)
    questions = train_q if split == "train" else held_q
    env = search_environment(backend, topk=cfg.topk)
    rng = np.random.default_rng(cfg.seed)  # the SFT stage's generator (its first draws are the agent's)
    return [scripted_conversation(q, offices, env, cfg.sft.agent, rng) for q in questions], questions


def main(argv=None) -> int:
    """CLI entry point; returns the exit status (0 written, 2 bad config or data)."""
    args = _parse_args(argv)
    try:
        cfg = load_run_config(args.gin_file or [DEFAULT_GIN], args.gin_param).experiment
        convs, _ = scripted_conversations(cfg, args.split)
        n = write_messages(args.out, convs)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    turns = sum(len(c.turns) for c in convs)
    answered = sum("<answer>" in c.turns[-1][0] for c in convs)
    print(f"[mempo] {cfg.dataset}: wrote {n} {args.split} conversations ({turns} assistant turns, "
          f"{turns / max(n, 1):.2f} per row, {answered} answered) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
