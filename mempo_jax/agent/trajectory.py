"""Trajectory records and the context views cut from them (docs/algorithm.md §2).

One trajectory is sampled per rollout row; everything else is a *view* of it:

* ``policy_context(t)`` — what the policy saw before generating turn ``t``: the whole history in
  ``full`` mode, or system + question + the last k turns (their ``<mem>``, ``<think>``, action)
  and the latest tool result in k-step mode.
* ``full_traj(t)`` — system + question + turns ``0..t-1`` with their tool results
  (reference: ``deepcopy(raw_input_ids)`` before turn t); never holds turn t's output.
* ``mem_traj(t)`` — system + question + turn t's ``<mem>…</mem>`` block only.

All views are lists of token ids built from the ids recorded at append time: the sampled ids of
each turn and the encoded tool results. Nothing is decoded and re-encoded (token-in/token-out).
Spans (the ``<mem>`` block of each turn, the generated tokens) are recorded as token offsets.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from mempo_jax.text.protocol import ParsedTurn
from mempo_jax.core.batching import bucket_length, pad_sequences

FULL = 0  # context_steps value meaning "full history" (configs write "full")


def parse_context_steps(value: int | str) -> int:
    """``"full"`` (or ``FULL`` itself, 0) → ``FULL``; an int ``k >= 1``, or its ``mode_name``
    ``"k{k}"`` (``"k1"``), → k.

    Raises:
      ValueError: for anything else (names the value).
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "full":
            return FULL
        if text[:1] == "k" and text[1:].isdigit() and int(text[1:]) >= 1:  # a mode name: "k1"
            text = text[1:]
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"context_steps must be 'full' or an integer >= 1, got {value!r}") from None
    if int(value) < 0:
        raise ValueError(f"context_steps must be 'full' or an integer >= 1, got {value!r}")
    return int(value)


def mode_name(context_steps: int) -> str:
    """``FULL`` → ``"full"``, k → ``"k{k}"`` (the keys of the evaluation summary)."""
    return "full" if context_steps == FULL else f"k{context_steps}"


def find_span(ids: Sequence[int], open_id: int, close_id: int) -> Optional[tuple[int, int]]:
    """Offsets ``[start, end)`` of the first ``open … close`` block in ``ids`` (tags included).

    Returns ``None`` when the block is absent or unclosed. Works on ids, so it agrees with the
    tokens that were sampled and will be trained.
    """
    try:
        start = list(ids).index(open_id)
        end = list(ids).index(close_id, start + 1)
    except ValueError:
        return None
    return start, end + 1


@dataclasses.dataclass
class Turn:
    """One turn of the policy and the environment's answer to it.

    Attributes:
      output_ids: the sampled ids of the turn, stop tag included.
      output_logprobs: the sampler's log-probs of ``output_ids`` (``None`` for scripted turns).
      observation_ids: the encoded ``<information>…</information>`` tool result (empty after an answer).
      parsed: the parsed turn (text view, used only to act; never re-encoded).
      mem_span: ``[start, end)`` of the ``<mem>…</mem>`` block inside ``output_ids``, or ``None``.
      context_len: tokens of the policy context this turn was generated from.
      tool_ok: False when the tool failed or the turn's format was invalid.
    """

    output_ids: list[int]
    output_logprobs: Optional[list[float]]
    observation_ids: list[int]
    parsed: ParsedTurn
    mem_span: Optional[tuple[int, int]]
    context_len: int = 0
    tool_ok: bool = True


@dataclasses.dataclass
class Trajectory:
    """A multi-turn episode for one question.

    Attributes:
      question_id: id of the question (several trajectories share it: a group).
      group_id: integer group index, assigned per question before the n copies are made.
      golds: one alias tuple per objective.
      prompt_ids: system prompt + question ids (BOS first).
      turns: the turns in order.
      done: True once the episode ended (answer, max turns or token budget).
      answer: the text of the final ``<answer>`` (``None`` if none was given).
      end_reason: ``"answer"``, ``"max_turns"`` or ``"budget"``.
    """

    question_id: str
    group_id: int
    golds: tuple[tuple[str, ...], ...]
    prompt_ids: list[int]
    turns: list[Turn] = dataclasses.field(default_factory=list)
    done: bool = False
    answer: Optional[str] = None
    end_reason: str = ""

    def policy_context(self, context_steps: int, t: Optional[int] = None) -> list[int]:
        """Ids the policy sees before generating turn ``t`` (default: the next turn).

        Full mode (``context_steps == FULL``): prompt + every earlier turn and tool result.
        k-step mode: prompt + the outputs of turns ``t-k..t-1`` + the tool result of turn ``t-1``.
        """
        t = len(self.turns) if t is None else t
        if context_steps == FULL:
            return self.full_traj(t)
        ids = list(self.prompt_ids)
        for turn in self.turns[max(0, t - context_steps) : t]:
            ids += turn.output_ids
        if t > 0:
            ids += self.turns[t - 1].observation_ids
        return ids

    def full_traj(self, t: int) -> list[int]:
        """``full_traj[t]``: the whole context before turn ``t`` (never turn t's own output)."""
        ids = list(self.prompt_ids)
        for turn in self.turns[:t]:
            ids += turn.output_ids + turn.observation_ids
        return ids

    def mem_traj(self, t: int) -> Optional[list[int]]:
        """``mem_traj[t]``: prompt + turn t's ``<mem>…</mem>`` block, or ``None`` without a block."""
        span = self.turns[t].mem_span
        if span is None:
            return None
        return list(self.prompt_ids) + self.turns[t].output_ids[span[0] : span[1]]

    def later_observations(self, t: int) -> list[int]:
        """The tool results returned from turn ``t`` on (turns ``t..``'s ``observation_ids``, in
        order, no outputs): what the episode learned after turn t's memory was written."""
        ids: list[int] = []
        for turn in self.turns[t:]:
            ids += turn.observation_ids
        return ids

    @property
    def num_tool_calls(self) -> int:
        """Turns that called search or access."""
        return sum(turn.parsed.action in ("search", "access") and turn.parsed.error is None for turn in self.turns)

    @property
    def format_failures(self) -> int:
        """Turns whose format was invalid."""
        return sum(turn.parsed.error is not None for turn in self.turns)

    def token_stats(self) -> tuple[int, int]:
        """``(TT, PT)``: total tokens over all turns (context + generated, summed) and the peak
        tokens of one context (context + generated of the largest turn). docs/algorithm.md §6."""
        sizes = [turn.context_len + len(turn.output_ids) for turn in self.turns]
        return int(sum(sizes)), int(max(sizes, default=0))


@dataclasses.dataclass
class TrainingRows:
    """Trajectories cut into training sequences (docs/algorithm.md §5), right-padded.

    Attributes:
      input_ids: ``[rows, seq]`` int32.
      valid: ``[rows, seq]`` bool — real tokens.
      loss_mask: ``[rows, seq]`` float32 — 1 on generated tokens, 0 on prompt, tool results, pad.
      old_logprobs: ``[rows, seq]`` float32 — sampler log-probs on generated tokens, else 0.
      traj_index: ``[rows]`` int32 — which trajectory each row comes from.
      mem_rows, mem_starts, mem_ends: ``[M]`` int32 — each turn's ``<mem>`` span in row coordinates.
      mem_turn: ``[M]`` list of ``(traj index, turn index)`` matching the spans.
    """

    input_ids: np.ndarray
    valid: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    traj_index: np.ndarray
    mem_rows: np.ndarray
    mem_starts: np.ndarray
    mem_ends: np.ndarray
    mem_turn: list[tuple[int, int]]


def build_training_rows(
    trajs: Sequence[Trajectory], context_steps: int, pad_id: int, max_len: Optional[int] = None
) -> TrainingRows:
    """Cut trajectories into training rows.

    Full mode: one row per trajectory — the whole sequence (prompt + every turn and tool result);
    loss on generated tokens only. k-step mode: one row per turn — the turn's own policy context
    followed by its output. ``<mem>`` spans are mapped into row coordinates.

    Args:
      trajs: finished trajectories.
      context_steps: ``FULL`` or k.
      pad_id: padding id.
      max_len: pad length (default: power-of-two bucket of the longest row). Rows longer than it
        are cut on the left of the context is never done: a ``ValueError`` is raised instead.

    Raises:
      ValueError: if a row exceeds ``max_len``.
    """
    seqs, masks, olds, owners = [], [], [], []
    mem_rows, mem_starts, mem_ends, mem_turn = [], [], [], []

    def add_turn_tokens(ids, mask, old, turn: Turn, row: int, ti: int, tr_i: int):
        offset = len(ids)
        ids += turn.output_ids
        mask += [1.0] * len(turn.output_ids)
        old += list(turn.output_logprobs) if turn.output_logprobs is not None else [0.0] * len(turn.output_ids)
        if turn.mem_span is not None:
            mem_rows.append(row)
            mem_starts.append(offset + turn.mem_span[0])
            mem_ends.append(offset + turn.mem_span[1])
            mem_turn.append((tr_i, ti))

    for tr_i, tr in enumerate(trajs):
        if context_steps == FULL:
            row = len(seqs)
            ids, mask, old = list(tr.prompt_ids), [0.0] * len(tr.prompt_ids), [0.0] * len(tr.prompt_ids)
            for ti, turn in enumerate(tr.turns):
                add_turn_tokens(ids, mask, old, turn, row, ti, tr_i)
                ids += turn.observation_ids
                mask += [0.0] * len(turn.observation_ids)
                old += [0.0] * len(turn.observation_ids)
            seqs.append(ids), masks.append(mask), olds.append(old), owners.append(tr_i)
        else:
            for ti, turn in enumerate(tr.turns):
                row = len(seqs)
                ctx = tr.policy_context(context_steps, ti)
                ids, mask, old = list(ctx), [0.0] * len(ctx), [0.0] * len(ctx)
                add_turn_tokens(ids, mask, old, turn, row, ti, tr_i)
                seqs.append(ids), masks.append(mask), olds.append(old), owners.append(tr_i)

    longest = max((len(s) for s in seqs), default=1)
    length = max_len if max_len is not None else bucket_length(longest)
    if longest > length:
        raise ValueError(f"a training row of {longest} tokens exceeds max_len {length}")
    input_ids, valid = pad_sequences(seqs, pad_id, length, side="right")
    loss_mask = np.zeros(input_ids.shape, np.float32)
    old_logprobs = np.zeros(input_ids.shape, np.float32)
    for i, (m, o) in enumerate(zip(masks, olds)):
        loss_mask[i, : len(m)] = m
        old_logprobs[i, : len(o)] = o
    return TrainingRows(
        input_ids=input_ids,
        valid=valid,
        loss_mask=loss_mask,
        old_logprobs=old_logprobs,
        traj_index=np.asarray(owners, np.int32),
        mem_rows=np.asarray(mem_rows, np.int32),
        mem_starts=np.asarray(mem_starts, np.int32),
        mem_ends=np.asarray(mem_ends, np.int32),
        mem_turn=mem_turn,
    )
