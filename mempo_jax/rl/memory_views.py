"""What the memory reward scores (docs/algorithm.md §3): the views of each ``<mem>`` turn
(``full_traj[t]`` and ``mem_traj[t]``) and the answer Z (gold or generated ids)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from mempo_jax.agent.tags import TagCodec
from mempo_jax.agent.trajectory import FULL, Trajectory, Turn
from mempo_jax.text.protocol import ANSWER, MEM
from mempo_jax.text.stop_strings import byte_offsets


def answer_ids_of(turn: Turn, codec) -> Optional[list[int]]:
    """The sampled ids inside the first ``<answer> … </answer>`` block of ``turn.output_ids``
    (token-in/token-out, docs/algorithm.md §2: the ids that were sampled are the ids that are scored),
    or ``None`` without a closed, non-empty block.

    The one place that cuts the answer out of a turn's ids. ``codec`` is the policy's
    ``TagCodec``: in ``tokens`` mode the ids strictly between the two tag ids; in ``text`` mode
    the tokens whose bytes lie wholly between the end of ``<answer>`` and the start of
    ``</answer>`` (found on the tokens' byte offsets, never by re-tokenising; a token that
    straddles a tag edge, such as ``>Paris``, holds tag bytes and is left out).
    """
    ids = [int(i) for i in turn.output_ids]
    if codec.mode == "tokens":
        span = codec.find_span(ids, ANSWER[0], ANSWER[1])
        inner = [] if span is None else ids[span[0] + 1 : span[1] - 1]
    else:
        vocab = codec.token_bytes(max(int(codec.tokenizer.vocab_size), max(ids, default=-1) + 1))
        data = b"".join(vocab[i] for i in ids)
        op, cl = (t.encode("utf-8") for t in ANSWER)
        lo = data.find(op)
        hi = -1 if lo < 0 else data.find(cl, lo + len(op))
        if hi < 0:
            return None
        off = byte_offsets(vocab, ids)
        inner = [i for k, i in enumerate(ids) if off[k] >= lo + len(op) and off[k + 1] <= hi and off[k + 1] > off[k]]
    return inner or None


def scored_memory_turns(trajs: Sequence[Trajectory], mem_turn: Sequence[tuple[int, int]],
                        include_malformed: bool, trajectories: np.ndarray | None = None) -> np.ndarray:
    """``[M]`` bool: which recorded ``<mem>`` turns get a memory reward. With
    ``include_malformed`` every one; else only turns without a format error
    (``turn.parsed.error is None``; ``MemoryRewardConfig.include_malformed``). With
    ``trajectories`` (``[N]`` bool over ``trajs``, ``MemoryRewardConfig.trajectories``' selection),
    also only turns of the selected trajectories."""
    keep = np.ones((len(mem_turn),), bool)
    if not include_malformed:
        keep = np.asarray([trajs[i].turns[t].parsed.error is None for i, t in mem_turn], bool).reshape(-1)
    if trajectories is not None:
        keep &= np.asarray([bool(trajectories[i]) for i, _ in mem_turn], bool).reshape(-1)
    return keep


def memory_view(tr: Trajectory, t: int, codec=None) -> Optional[list[int]]:
    """``mem_traj[t]`` as the memory reward scores it: system + question + turn t's
    ``<mem>…</mem>`` block ending exactly at ``</mem>`` (``TagCodec.end_at_close``; in text mode
    the span's last token may hold the next tag's first bytes, e.g. SmolLM2's ``><``, and the view
    would read ``…</mem><<think>`` once the scorer's prefix follows). ``None`` without a block.
    ``codec``: the policy's ``TagCodec`` (``None`` or tokens mode: ``mem_traj[t]`` unchanged)."""
    ids = tr.mem_traj(t)
    if ids is None or codec is None:
        return ids
    return codec.end_at_close(ids, MEM[1])


def memory_contexts(trajs: Sequence[Trajectory], mem_turn: Sequence[tuple[int, int]], tokenizer, answer_source: str,
                    *, codec=None, baseline_steps: int = FULL, hindsight: bool = False,
                    continuation: Sequence[int] = ()):
    """``(full_contexts, mem_contexts, answers)`` for every recorded ``<mem>`` turn.

    ``full_traj[t]`` (``baseline_steps = FULL``, the default; else the k-step policy context of
    turn t, ``Trajectory.policy_context``: ``MemoryRewardConfig.baseline = "input"``) /
    ``mem_traj[t]`` views and Z: the gold answer (default; aliases' first
    entries joined by ``"; "``, encoded with a leading space as rendered in turns) or, with
    ``"generated"``, the sampled ids of the trajectory's final ``<answer>`` block
    (``answer_ids_of`` with ``codec``, the policy's ``TagCodec``; default: ``tokenizer``'s tags
    as single ids), gold when the trajectory gave no answer. Never decoded and re-encoded.
    ``hindsight`` (``MemoryRewardConfig.hindsight``): both views of turn t end with
    ``Trajectory.later_observations(t)``, the tool results of turns t.. (none for the answer turn).
    After a tool result the policy writes a ``<mem>`` block, so a memory view that ends with one
    also gets ``continuation``, the never-scored ids the scorer puts on the full view
    (``MemoryRewardScorer.full_prefix``, the empty ``<mem></mem>`` of
    ``MemoryRewardConfig.prefix = "empty_mem"``): the two views then share everything from the
    tool results on and differ only in the history against the memory.

    Raises:
      ValueError: for an unknown ``answer_source``.
    """
    if answer_source not in ("gold", "generated"):
        raise ValueError(f"MemoryRewardConfig.answer must be 'gold' or 'generated', got {answer_source!r}")
    if answer_source == "generated" and codec is None:
        codec = TagCodec(tokenizer, "tokens")
    full, mem, answers = [], [], []
    for tr_i, t in mem_turn:
        tr = trajs[tr_i]
        later = tr.later_observations(t) if hindsight else []
        full.append(tr.policy_context(baseline_steps, t) + later)
        mem.append(memory_view(tr, t, codec) + later + (list(continuation) if later else []))
        z = answer_ids_of(tr.turns[-1], codec) if answer_source == "generated" and tr.answer else None
        answers.append(z if z is not None else gold_answer_ids(tokenizer, tr.golds))
    return full, mem, answers


def gold_answer_ids(tokenizer, golds) -> list[int]:
    """The gold Z of the memory reward (docs/algorithm.md §3): each objective's first alias joined by
    ``"; "``, encoded with a leading space as rendered in turns. ``golds``: one alias tuple per objective."""
    return tokenizer.encode(" " + "; ".join(g[0] for g in golds))


__all__ = ["answer_ids_of", "gold_answer_ids", "memory_contexts", "memory_view", "scored_memory_turns"]
