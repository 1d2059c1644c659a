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
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from mempo_jax.agent.protocol import MEM, parse_turn, render_turn
from mempo_jax.agent.rollout import RolloutConfig, build_prompt, encode_observation
from mempo_jax.agent.trajectory import Trajectory, Turn, find_span
from mempo_jax.validation import check

_FACT_RE = re.compile(r"^\((\d+)\) (.+)$")


@dataclasses.dataclass(frozen=True)
class ScriptedAgentConfig:
    """Imperfections of the scripted agent.

    Attributes:
      lazy_prob: probability that a trajectory keeps only the newest fact in ``<mem>``.
      duplicate_prob: probability that a hop's search is issued twice.
    """

    lazy_prob: float = 0.6
    duplicate_prob: float = 0.15

    def __post_init__(self):
        for name in ("lazy_prob", "duplicate_prob"):
            check(self, name, float, lo=0.0, hi=1.0)


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


def scripted_trajectory(question, world_offices: dict, tokenizer, tool_env, cfg: ScriptedAgentConfig,
                        rollout_cfg: RolloutConfig, rng: np.random.Generator, group_id: int = 0) -> Trajectory:
    """Play one question with the scripted agent.

    Args:
      question: a ``world.Question`` (``hops`` give the plan).
      world_offices: company name → {city: office head}, for the lazy agent's guesses.
      tokenizer: the project tokenizer.
      tool_env: the tool environment (real BM25 search).
      cfg: the agent's imperfections.
      rollout_cfg: observation length limit.
      rng: numpy generator (seeded by the caller).
      group_id: group index recorded on the trajectory.

    Returns:
      A finished ``Trajectory`` whose turns carry ids, ``<mem>`` spans and observations.
    """
    tr = Trajectory(question.id, group_id, tuple(question.golds), build_prompt(tokenizer, question.question))
    lazy = rng.random() < cfg.lazy_prob
    facts: list[str] = []
    mem_open, mem_close = tokenizer.piece_id(MEM[0]), tokenizer.piece_id(MEM[1])

    def emit(mem: str, think: str, action: str, argument: str) -> Turn:
        # A space opens every block's content, so names inside tags tokenise as they do in
        # running text ("▁Name"); consumers strip the content.
        text = render_turn(" " + mem, " " + think, action, " " + argument)
        ids = tokenizer.encode(text)
        ctx_len = len(tr.policy_context(rollout_cfg.context_steps))
        turn = Turn(ids, None, [], parse_turn(text), find_span(ids, mem_open, mem_close), context_len=ctx_len)
        if action != "answer":
            res = tool_env.execute_batch([turn.parsed])[0]
            turn.observation_ids = encode_observation(tokenizer, res.observation, rollout_cfg.max_observation_tokens)
            turn.tool_ok = bool(res.ok)
        tr.turns.append(turn)
        return turn

    for hop_i, (query, new_facts) in enumerate(question.hops):
        mem = "; ".join(facts) if facts else "none"
        repeats = 2 if rng.random() < cfg.duplicate_prob else 1
        for _ in range(repeats):
            emit(mem, "search", "search", query)
        new = list(new_facts)
        if question.kind == "bridge" and hop_i == len(question.hops) - 1 and lazy:
            # The birth city was forgotten: guess one of the company's office heads.
            heads = sorted(world_offices[query].values())
            new = [f"(1) {heads[int(rng.integers(len(heads)))]}"]
        facts = [new[-1]] if lazy else facts + new
    emit("; ".join(facts), "answer", "answer", _answer(question, facts))
    tr.done, tr.answer, tr.end_reason = True, tr.turns[-1].parsed.argument, "answer"
    return tr
