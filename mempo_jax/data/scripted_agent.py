"""A scripted agent that writes cold-start (SFT) trajectories in the tag protocol.

The reference MemPO run starts RL from an SFT model trained on trajectories that contain
``<mem>``. Here a scripted agent plays the embedded world: it searches each hop's entity, reads
the fact from the real retrieved passage, keeps facts in ``<mem>`` and answers. It is imperfect on
purpose, so that the SFT policy leaves room for RL:

* **lazy memory** (probability ``lazy_prob`` per trajectory): each ``<mem>`` keeps only the newest
  fact, dropping what earlier hops found. A bridge question then loses the birth city and
  guesses an office head; a multi-objective question answers ``unknown`` for forgotten parts.
* **duplicate search** (probability ``duplicate_prob`` per hop): the same search is issued twice.

Observations come from the real tool environment, so SFT data shows real retrieval results.

The agent plays in text (``scripted_conversation``: a messages conversation, the layout of an SFT
trajectory file, ``data/messages.py``); ``scripted_trajectory`` reads it back through the same
converter as a user's file, so the embedded default and a user's data take one path.
``python -m mempo_jax.commands.write_sft_messages`` writes the conversations to a file.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from mempo_jax.agent.format import AgentFormat
from mempo_jax.text.protocol import parse_turn, render_turn
from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.agent.trajectory import Trajectory
from mempo_jax.data.messages import Conversation, conversation_trajectory
from mempo_jax.core.validation import check

_FACT_RE = re.compile(r"^\((\d+)\) (.+)$")


FULL_ROWS = ("same", "diligent", "recall")  # the values of ScriptedAgentConfig.full_rows


@dataclasses.dataclass(frozen=True)
class ScriptedAgentConfig:
    """Imperfections of the scripted agent.

    Attributes:
      lazy_prob: probability that a trajectory keeps only the newest fact in ``<mem>``.
      duplicate_prob: probability that a hop's search is issued twice.
      full_rows: where the whole-history SFT rows (``SFTConfig.full_fraction``) come from.
        ``"same"`` (default): the same, possibly lazy, trajectory as its k-step rows, so a lazy
        trajectory teaches the full-history view to guess although its context holds the facts.
        ``"diligent"``: a diligent replay of the same question (``lazy_prob = 0``, its own random
        stream): the full-history view answers from what it has seen, but never sees a lazy
        memory in its history. ``"recall"``: a replay with the same laziness (own stream) whose
        answer turn recalls every fact its searches returned (``scripted_conversation(recall=True)``):
        lazy memories in the history, the right answer at the end, so the full-history view learns
        to answer from the history whatever its memories kept, and only the k-step (memory) view
        pays for lazy memory (laziness the memory reward can see, ``P(Z | mem)``
        below ``P(Z | full)``, and RL can undo).
      think_search: the ``<think>`` text of a search turn (a space is put before it).
      think_answer: the ``<think>`` text of the answer turn. The defaults name the action; a
        pretrained model fine-tuned on them can learn to answer with the word itself
        (``<think> answer</think><answer> answer</answer>``), which wording that is no tag word
        avoids. Neither may contain a tag piece (``ValueError`` naming the field).
    """

    lazy_prob: float = 0.6
    duplicate_prob: float = 0.15
    full_rows: str = "same"
    think_search: str = "search"
    think_answer: str = "answer"

    def __post_init__(self):
        for name in ("lazy_prob", "duplicate_prob"):
            check(self, name, float, lo=0.0, hi=1.0)
        check(self, "full_rows", str, choices=FULL_ROWS)
        for name, value in (("think_search", self.think_search), ("think_answer", self.think_answer)):
            check(self, name, str)
            try:
                render_turn("m", value, "answer", "a")
            except ValueError as e:
                raise ValueError(f"ScriptedAgentConfig.{name}: {e}") from None


def _answer(question, facts: Sequence[str]) -> str:
    """The answer the agent can give from its memory: remembered objectives, else a guess."""
    remembered = {}
    for f in facts:
        m = _FACT_RE.match(f)
        if m:
            remembered[int(m.group(1))] = m.group(2)
    parts = []
    for j in range(len(question.golds)):
        parts.append(remembered.get(j + 1, "unknown"))
    return "; ".join(parts)


def scripted_conversation(question, world_offices: dict, tool_env, cfg: ScriptedAgentConfig,
                          rng: np.random.Generator, system: str | None = None, recall: bool = False) -> Conversation:
    """Play one question with the scripted agent, as text: a messages conversation.

    Each assistant turn is exactly ``render_turn(" " + mem, " " + think, action, " " + argument)``
    (a space opens every block's content, so names inside tags tokenise as they do in running text,
    ``"▁Name"``; consumers strip the content); each search is run on ``tool_env`` and its raw
    observation text (not wrapped, not cut) is the tool message after the turn.

    Args:
      question: a ``world.Question`` (``hops`` give the plan).
      world_offices: company name → {city: office head}, for the lazy agent's guesses.
      tool_env: the tool environment (real BM25 search).
      cfg: the agent's imperfections.
      rng: numpy generator (seeded by the caller); draws, in order: lazy or not, then per hop a
        duplicate draw and, for a lazy bridge's last hop, the guessed head.
      system: the system message (``None``: the run's ``AgentFormat.system_prompt`` applies when read).
      recall: the answer turn's memory and answer use every fact the searches returned (the
        right answer), whatever the earlier memories kept, and a lazy bridge's last hop guesses
        nothing (``ScriptedAgentConfig.full_rows = "recall"``); the draws are the same.

    Returns:
      A ``messages.Conversation`` (id and golds of the question).

    Raises:
      ValueError: from ``render_turn`` when a fact or query contains a protocol tag piece.
    """
    lazy = rng.random() < cfg.lazy_prob
    facts: list[str] = []
    seen: list[str] = []  # every fact the searches returned (recall)
    turns: list[tuple[str, str | None]] = []

    def emit(mem: str, think: str, action: str, argument: str) -> None:
        text = render_turn(" " + mem, " " + think, action, " " + argument)
        observation = None
        if action != "answer":
            observation = tool_env.execute_batch([parse_turn(text)])[0].observation
        turns.append((text, observation))

    for hop_i, (query, new_facts) in enumerate(question.hops):
        mem = "; ".join(facts) if facts else "none"
        repeats = 2 if rng.random() < cfg.duplicate_prob else 1
        for _ in range(repeats):
            emit(mem, cfg.think_search, "search", query)
        new = list(new_facts)
        if question.kind == "bridge" and hop_i == len(question.hops) - 1 and lazy:
            # The birth city was forgotten: guess one of the company's office heads.
            heads = sorted(world_offices[query].values())
            guess = [f"(1) {heads[int(rng.integers(len(heads)))]}"]
            new = new if recall else guess
        seen += new
        facts = [new[-1]] if lazy else facts + new
    if recall:
        facts = seen
    emit("; ".join(facts), cfg.think_answer, "answer", _answer(question, facts))
    return Conversation(system, question.question, tuple(turns), str(question.id), tuple(question.golds))


def scripted_trajectory(question, world_offices: dict, fmt: AgentFormat, tool_env, cfg: ScriptedAgentConfig,
                        rollout_cfg: RolloutConfig, rng: np.random.Generator, group_id: int = 0) -> Trajectory:
    """Play one question with the scripted agent: ``scripted_conversation`` read back through
    ``messages.conversation_trajectory`` — the same path as an SFT messages file.

    Args:
      question, world_offices, tool_env, cfg, rng: as ``scripted_conversation``.
      fmt: the run's ``AgentFormat`` (prompt, tag codec, observation wrapper).
      rollout_cfg: ``max_observation_tokens`` and ``context_steps`` (the turns' ``context_len``).
      group_id: group index recorded on the trajectory.

    Returns:
      A finished ``Trajectory`` whose turns carry ids, ``<mem>`` spans and observations.
    """
    conv = scripted_conversation(question, world_offices, tool_env, cfg, rng)
    return conversation_trajectory(conv, fmt, rollout_cfg.max_observation_tokens, rollout_cfg.context_steps,
                                   group_id)
