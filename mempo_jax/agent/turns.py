"""The host side of one turn (``engine.rollout_cached``; the tests' reference loop too): record a
sampled turn (parse it, find its ``<mem>`` span) and answer it (an answer ends the episode; every
other turn goes to the tool environment in one batched call, which answers a malformed turn with an
error observation, docs/algorithm.md §1)."""

from __future__ import annotations

from typing import Optional, Sequence

from mempo_jax.agent.format import AgentFormat
from mempo_jax.agent.trajectory import Trajectory, Turn
from mempo_jax.text.protocol import ANSWER_ACTION, ParsedTurn, parse_turn


def make_turn(fmt: AgentFormat, output_ids: Sequence[int], logprobs: Optional[Sequence[float]], stopped: bool) -> Turn:
    """Record one generated turn: parse its text, locate its ``<mem>`` span on the ids
    (``fmt.mem_span``: by id in tokens mode, by token byte offsets in text mode).

    The parser reads ``fmt.codec.turn_text(ids)`` with the codec's actions: the decoded ids, in text
    mode cut right after the first closing action tag (a stop token such as ``>.`` carries text past the tag that the
    policy did not choose to write). The recorded ids are the sampled ones, unchanged. A turn that
    ran out of its token budget without a stop tag is a format failure.
    """
    ids = [int(i) for i in output_ids]
    parsed = parse_turn(fmt.codec.turn_text(ids), fmt.codec.actions)
    if not stopped and parsed.error is None:
        parsed = ParsedTurn(parsed.mem, parsed.think, None, None, "turn ended without a closing action tag")
    span = fmt.mem_span(ids)
    return Turn(ids, None if logprobs is None else [float(x) for x in logprobs], [], parsed, span)


def apply_tools(fmt: AgentFormat, tool_env, trajs: Sequence[Trajectory], turns: Sequence[Turn], cfg) -> None:
    """Append each turn to its trajectory and answer it: an answer ends the episode; every other
    turn goes to ``tool_env.execute_batch`` (one call; ``tools.environment.ToolEnvironment``: a
    tool call gets its tool's result, a malformed turn an error observation, and the episode goes
    on: docs/algorithm.md §1); an episode ends after ``cfg.max_turns`` turns."""
    pending = []
    for tr, turn in zip(trajs, turns):
        tr.turns.append(turn)
        if turn.parsed.error is None and turn.parsed.action == ANSWER_ACTION:
            tr.done, tr.answer, tr.end_reason = True, (turn.parsed.argument or "").strip(), "answer"
        else:
            pending.append(turn)
    if pending:
        results = tool_env.execute_batch([t.parsed for t in pending])
        for turn, res in zip(pending, results):
            turn.tool_ok = bool(res.ok)
            turn.observation_ids = fmt.observation_ids(res.observation, cfg.max_observation_tokens)
    for tr in trajs:
        if not tr.done and len(tr.turns) >= cfg.max_turns:
            tr.done, tr.end_reason = True, "max_turns"


def close_episodes(trajs: Sequence[Trajectory]) -> Sequence[Trajectory]:
    """End every trajectory still open when a rollout stops turning (its turn budget is spent):
    ``done`` with ``end_reason`` ``"max_turns"`` unless one was already set. Returns ``trajs``."""
    for tr in trajs:
        if not tr.done:
            tr.done, tr.end_reason = True, tr.end_reason or "max_turns"
    return trajs
