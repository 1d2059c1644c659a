"""Cold-start SFT: trajectories as training rows (docs/algorithm.md §5, reference: SFT on trajectories
that contain ``<mem>`` before RL). The trajectories are the scripted agent's or those of an SFT
messages file (``SFTConfig.data_path``); both are read through ``data/messages.py``.

Each trajectory gives one row per turn in k-step form (the turn's own context + its
output) and, for a ``full_fraction`` share, one whole-history row, so the policy works in both
context modes. Loss: token-mean cross-entropy on generated tokens only (tool results masked).

Copy warm-up rows. A policy trained from scratch must copy entity names from the question and
the tool results into its queries, memory and answers. A tiny transformer forms such copy
circuits (a value path that maps a token to its own logit, plus attention that finds it) very
slowly from the agent data alone, where copy targets are sparse. Mixing in synthetic rows
``BOS s s`` (a random sequence of entity tokens, repeated; loss on the repeat: the classic
induction-head task of Olsson et al., 2022) gives a dense copy signal: on the embedded world the
query-copy log-prob goes from chance (-6) to -2.9 within 500 steps, where agent data alone stays
at chance. ``copy_fraction`` sets how many such rows are added per scripted row.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional, Sequence

import numpy as np

from mempo_jax.agent.trajectory import FULL, Trajectory, build_training_rows
from mempo_jax.core.batching import bucket_length, pad_sequences
from mempo_jax.rl.memory_views import answer_ids_of, gold_answer_ids, memory_view


def sft_rows(trajs: Sequence[Trajectory], context_steps: int, full_fraction: float, pad_id: int,
             rng: np.random.Generator, full_trajs: Optional[Sequence[Trajectory]] = None
             ) -> list[tuple[list[int], list[float]]]:
    """Training rows ``(ids, loss_mask)`` from SFT trajectories (``build_training_rows``).

    Args:
      trajs: finished trajectories (scripted, or read from a messages file).
      context_steps: the k of the k-step rows (``FULL`` gives whole-history rows only).
      full_fraction: share of trajectories that also give a whole-history row.
      pad_id: padding id.
      rng: picks the trajectories for whole-history rows.
      full_trajs: the trajectories whose whole-history rows are used in place of ``trajs[i]``'s
        (same length and order: e.g. a diligent replay of each question,
        ``ScriptedAgentConfig.full_rows``); None: ``trajs``. The same ``rng`` draws
        pick the same indices either way.

    Raises:
      ValueError: ``full_trajs`` of another length than ``trajs``.
    """
    out = []
    if full_trajs is not None and len(full_trajs) != len(trajs):
        raise ValueError(f"sft_rows: {len(full_trajs)} full_trajs for {len(trajs)} trajectories")
    source = list(trajs) if full_trajs is None else list(full_trajs)
    modes = [(context_steps, list(trajs))]
    if context_steps != FULL and full_fraction > 0:
        chosen = [source[i] for i in range(len(trajs)) if rng.random() < full_fraction]
        modes.append((FULL, chosen))
    for steps, group in modes:
        if not group:
            continue
        rows = build_training_rows(group, steps, pad_id)
        for ids, valid, mask in zip(rows.input_ids, rows.valid, rows.loss_mask):
            n = int(valid.sum())
            out.append((ids[:n].tolist(), mask[:n].tolist()))
    return out


def iterate_sft_batches(rows: Sequence[tuple[Sequence[int | np.integer] | np.ndarray, Sequence[float] | np.ndarray]],
                        batch_rows: int, pad_id: int, rng: np.random.Generator):
    """Endless shuffled batches; rows of similar length share a batch (sorted within a window)
    so padding stays small. Rows are ``(ids, loss_mask)`` lists or 1-D arrays (the same batches
    either way). Yields ``{"input_ids", "valid", "loss_mask"}`` ``[batch_rows, L]``."""
    while True:
        order = rng.permutation(len(rows))
        window = batch_rows * 16
        for s in range(0, len(order), window):
            chunk = sorted(order[s : s + window], key=lambda i: len(rows[i][0]))
            batches = [chunk[i : i + batch_rows] for i in range(0, len(chunk), batch_rows)]
            rng.shuffle(batches)
            for b in batches:
                if len(b) < batch_rows:
                    continue
                seqs = [rows[i][0] for i in b]
                length = bucket_length(max(len(x) for x in seqs), 64)
                ids, valid = pad_sequences(seqs, pad_id, length, "right")
                mask = np.zeros(ids.shape, np.float32)
                for j, i in enumerate(b):
                    mask[j, : len(rows[i][1])] = rows[i][1]
                yield {"input_ids": ids, "valid": valid, "loss_mask": mask}


def copy_rows(token_ids: Sequence[int], count: int, bos_id: Optional[int], rng: np.random.Generator,
              min_len: int = 4, max_len: int = 16) -> list[tuple[list[int], list[float]]]:
    """Synthetic induction rows ``(BOS s s, loss on the second s)``.

    Args:
      token_ids: the pool the sequences are drawn from (the world's single-piece entity names).
      count: number of rows.
      bos_id: the BOS id (``None`` for tokenizers without one, e.g. Qwen: the row starts with ``s``).
      rng: numpy generator.
      min_len, max_len: length range of ``s`` (inclusive, exclusive).

    Raises:
      ValueError: for an empty pool.
    """
    if len(token_ids) == 0:
        raise ValueError("copy_rows needs a non-empty token pool")
    pool = np.asarray(sorted(set(int(t) for t in token_ids)), np.int64)
    out = []
    for _ in range(count):
        n = int(rng.integers(min_len, max_len))
        seq = [int(t) for t in rng.choice(pool, n)]
        bos = [] if bos_id is None else [int(bos_id)]
        out.append((bos + seq + seq, [0.0] * (len(bos) + n) + [1.0] * n))
    return out


def reader_rows(trajs: Sequence[Trajectory], tokenizer, codec, answer_prefix: Sequence[int],
                full_prefix: Sequence[int], fraction: float, rng: np.random.Generator,
                full_trajs: Optional[Sequence[Trajectory]] = None) -> list[tuple[list[int], list[float]]]:
    """Memory-reader rows: the two views the memory reward scores, followed by an answer, so that
    ``P(Z | mem_traj[t])`` and ``P(Z | full_traj[t])`` are read on contexts the policy was taught
    to answer from (docs/algorithm.md §3; ``SFTConfig.reader_fraction``).

    For each chosen trajectory (``rng.random() < fraction``, one draw per trajectory) with a
    final answer turn T that wrote a ``<mem>``, two rows, the loss on the answer ids only:

    * memory view: ``mem_traj[T] + answer_prefix + A`` (the scorer's view, ``memory_views.memory_view``),
      A the trajectory's own answer ids
      (``memory_views.answer_ids_of``): the answer its memory supports, so a memory that lost a fact
      teaches a low ``P(gold | mem)`` and a complete one a high one;
    * full view: ``full_traj[T] + full_prefix + answer_prefix + G`` with ``G`` the gold Z
      (``memory_views.gold_answer_ids``), of ``full_trajs[i]`` where given (a diligent replay of the same
      question) else of ``trajs[i]``: the whole history holds every fact a search returned.

    ``answer_prefix`` and ``full_prefix`` are the scorer's (``experiment.answer_prefix_ids``);
    they carry no loss, so the policy's own turns are not taught to write them.

    Args:
      trajs: finished SFT trajectories (scripted or from a messages file).
      tokenizer, codec: the policy's tokenizer and ``TagCodec``.
      answer_prefix, full_prefix: never-scored ids before Z (both views / the full view only).
      fraction: share of trajectories that give their pair of rows, in [0, 1].
      rng: numpy generator (one draw per trajectory, drawn for every trajectory).
      full_trajs: optional, same length and order as ``trajs``.

    Returns:
      ``[(ids, loss_mask)]`` lists, two per chosen trajectory that has an answer and a memory.

    Raises:
      ValueError: ``full_trajs`` of another length than ``trajs``.
    """
    if full_trajs is not None and len(full_trajs) != len(trajs):
        raise ValueError(f"reader_rows: {len(full_trajs)} full_trajs for {len(trajs)} trajectories")
    out = []
    for i, tr in enumerate(trajs):
        if not rng.random() < fraction or not tr.turns:
            continue
        last = len(tr.turns) - 1
        answer, mem = answer_ids_of(tr.turns[last], codec), memory_view(tr, last, codec)
        if answer is None or mem is None:
            continue
        ctx = mem + list(answer_prefix)
        out.append((ctx + answer, [0.0] * len(ctx) + [1.0] * len(answer)))
        src = tr if full_trajs is None else full_trajs[i]
        gold = gold_answer_ids(tokenizer, src.golds)
        ctx = src.full_traj(len(src.turns) - 1) + list(full_prefix) + list(answer_prefix)
        out.append((ctx + gold, [0.0] * len(ctx) + [1.0] * len(gold)))
    return out


def with_copy_warmup(batches: Iterator[dict], token_ids: Sequence[int], warmup_steps: int, batch_rows: int,
                     pad_id: int, bos_id: Optional[int], rng: np.random.Generator) -> Iterator[dict]:
    """``warmup_steps`` batches of copy rows only, then ``batches`` (``SFTConfig.copy_warmup_steps``).

    A curriculum for a model trained from scratch: its copy (induction) circuit forms on dense
    copy rows first, then the agent rows train on top of it. On the embedded world (0.71 M
    parameters, learning rate 1e-3) copy-only batches take the copy loss from 6.0 nats (chance
    over the 420 names) to ~1.0 within 600 steps (0.3 after 900), where copy rows mixed 1:1
    with agent rows at 3e-3 stayed at 5.2–5.8 after 1,000 steps.

    Args:
      batches: the run's batch iterator (``iterate_sft_batches``), drawn from after the warm-up.
      token_ids, bos_id: as ``copy_rows``.
      warmup_steps: copy-only batches first (0: ``batches`` unchanged).
      batch_rows, pad_id: as ``iterate_sft_batches``.
      rng: the warm-up's own generator (so ``batches``' draws are the same with or without it).

    Returns:
      An iterator of ``{"input_ids", "valid", "loss_mask"}`` ``[batch_rows, L]`` batches.
    """
    if warmup_steps == 0:
        return batches
    rows = copy_rows(token_ids, warmup_steps * batch_rows, bos_id, rng)
    warm = itertools.islice(iterate_sft_batches(rows, batch_rows, pad_id, rng), warmup_steps)
    return itertools.chain(warm, batches)
