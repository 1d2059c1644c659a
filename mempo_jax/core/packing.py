"""Sequence packing: many variable-length rows laid end to end in a few fixed-length rows.

A packed row holds several sequences back to back; ``segment_ids`` numbers them 1, 2, … (0 on
padding), RoPE positions restart at 0 per segment (``model.forward.packed_positions``) and the
attention mask keeps each token inside its own segment (``model.forward.LogitsFn.packed``),
so every sequence gets the logits it would get alone (Krell et al. 2021, "Efficient sequence
packing without cross-contamination"; the ``segment_ids`` of t5x / MaxText packed batches).
Rows are assigned to bins by first-fit decreasing (Johnson 1973), ≤ 11/9 OPT + 1 bins.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from jaxtyping import Int, Shaped

from mempo_jax.core.batching import bucket_length


def first_fit_decreasing(sizes: Sequence[int] | Int[np.ndarray, "rows"], capacity: int,
                         weights: Sequence[int] | Int[np.ndarray, "rows"] | None = None,
                         weight_capacity: int | None = None) -> list[list[int]]:
    """Bins of row indices, each bin's ``sizes`` summing to at most ``capacity`` (and its
    ``weights`` to at most ``weight_capacity`` when given): rows longest first, each into the
    first bin where it fits, else a new bin.

    Args:
      sizes: ``[n]`` non-negative ints (tokens per row).
      capacity: tokens per bin.
      weights, weight_capacity: an optional second budget (e.g. answer tokens per packed row).

    Returns:
      Bins as lists of row indices, in the order they were opened; every index appears once.

    Raises:
      ValueError: if one row alone exceeds a capacity.
    """
    sizes = [int(s) for s in sizes]
    weights = [0] * len(sizes) if weights is None else [int(w) for w in weights]
    wcap = 0 if weight_capacity is None else int(weight_capacity)
    for i, (s, w) in enumerate(zip(sizes, weights)):
        if s > capacity or (weight_capacity is not None and w > wcap):
            raise ValueError(f"row {i} ({s} tokens, weight {w}) does not fit a bin of {capacity} (weight {wcap})")
    bins: list[list[int]] = []
    room: list[int] = []
    wroom: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        for b in range(len(bins)):
            if sizes[i] <= room[b] and (weight_capacity is None or weights[i] <= wroom[b]):
                bins[b].append(i)
                room[b] -= sizes[i]
                wroom[b] -= weights[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
            wroom.append(wcap - weights[i])
    return bins


class PackedRows(NamedTuple):
    """One packed batch (numpy).

    Attributes:
      input_ids: ``[R, L]`` int32.
      segment_ids: ``[R, L]`` int32, k ≥ 1 on the k-th sequence of the row, 0 on padding.
      positions: ``[R, L]`` int32, restarting at 0 per segment.
      row_of: ``[R, L]`` int32, the index of the source row each column came from (−1 on padding).
      col_of: ``[R, L]`` int32, the column in the source row (−1 on padding).
    """

    input_ids: Int[np.ndarray, "rows length"]
    segment_ids: Int[np.ndarray, "rows length"]
    positions: Int[np.ndarray, "rows length"]
    row_of: Int[np.ndarray, "rows length"]
    col_of: Int[np.ndarray, "rows length"]


def pack(rows: Sequence[Sequence[int] | Int[np.ndarray, "_"]], bins: Sequence[Sequence[int]], length: int, num_rows: int,
         pad_id: int) -> PackedRows:
    """Lay ``rows`` out as ``bins`` (from ``first_fit_decreasing``) in a ``[num_rows, length]`` batch.

    Args:
      rows: source token-id lists.
      bins: row indices per packed row (at most ``num_rows`` bins).
      length: packed row length L.
      num_rows: packed rows R (extra rows are all padding).
      pad_id: padding id.

    Raises:
      ValueError: if there are more bins than ``num_rows`` or a bin overflows ``length``.
    """
    if len(bins) > num_rows:
        raise ValueError(f"{len(bins)} bins do not fit {num_rows} packed rows")
    ids = np.full((num_rows, length), pad_id, np.int32)
    seg = np.zeros((num_rows, length), np.int32)
    pos = np.zeros((num_rows, length), np.int32)
    row_of = np.full((num_rows, length), -1, np.int32)
    col_of = np.full((num_rows, length), -1, np.int32)
    for r, members in enumerate(bins):
        c = 0
        for k, i in enumerate(members):
            n = len(rows[i])
            if c + n > length:
                raise ValueError(f"packed row {r} overflows {length} tokens")
            ids[r, c : c + n] = rows[i]
            seg[r, c : c + n] = k + 1
            pos[r, c : c + n] = np.arange(n)
            row_of[r, c : c + n] = i
            col_of[r, c : c + n] = np.arange(n)
            c += n
    return PackedRows(ids, seg, pos, row_of, col_of)


def plan_packing(sizes: Sequence[int] | Int[np.ndarray, "rows"], min_length: int, rows_per_call: int, min_rows: int = 1,
                 weights: Sequence[int] | Int[np.ndarray, "rows"] | None = None, weight_fraction: int | None = None,
                 max_doublings: int = 2) -> tuple[int, list[list[list[int]]]]:
    """Pick the packed length and the per-call bins that cost the fewest computed positions.

    Candidates ``L = L0, 2·L0, … (max_doublings times)`` with ``L0 = bucket_length(longest row,
    min_length)`` (raised until every row's weight fits ``L // weight_fraction``); for each, rows
    are packed by ``first_fit_decreasing`` and the bins split into calls of at most
    ``rows_per_call`` rows, each call padded to ``bucket_length(bins, min_rows)`` rows. The cost
    is ``Σ rows × L`` over the calls; ties go to the shorter L.

    Returns:
      ``(L, calls)``: ``calls`` is a list of bin lists (one per device call).
    """
    longest = max((int(s) for s in sizes), default=1)
    length = bucket_length(longest, min_length)
    wcap = None
    if weights is not None and weight_fraction:
        while max((int(w) for w in weights), default=0) > length // weight_fraction:
            length *= 2
    best = None
    for _ in range(max_doublings + 1):
        if weight_fraction and weights is not None:
            wcap = length // weight_fraction
        bins = first_fit_decreasing(sizes, length, weights, wcap)
        calls = [bins[s : s + rows_per_call] for s in range(0, len(bins), rows_per_call)]
        cost = sum(bucket_length(len(c), min_rows) * length for c in calls)
        if best is None or cost < best[0]:
            best = (cost, length, calls)
        length *= 2
    return best[1], best[2]


def pack_token_rows(rows: dict[str, Shaped[np.ndarray, "rows length"]], num_rows: int,
                    pad_id: int = 0) -> dict[str, Shaped[np.ndarray, "packed length"]]:
    """Right-padded training rows packed end to end into ``num_rows`` rows of the same length.

    The PPO update's layout (verl's ``use_remove_padding``): rows go into bins of ``L`` tokens by
    ``first_fit_decreasing`` on their real lengths, bins fill packed rows from the first (the rest
    are all padding, which the update skips), and every ``[R, L]`` array is moved with its tokens.

    Args:
      rows: ``input_ids [R, L] int32``, ``valid [R, L] bool`` (a prefix of each row: right
        padding) and any other ``[R, L]`` arrays (``loss_mask``, log-probs, advantages, ...).
      num_rows: packed rows (``>=`` the bins; ``R`` always suffices).
      pad_id: the id written on padding.

    Returns:
      The same keys as ``[num_rows, L]`` arrays (0 / False / ``pad_id`` on padding; ``valid`` is
      True on every packed token) plus ``segment_ids`` and ``positions`` ``[num_rows, L]`` int32
      (``PackedRows``), which make the model's packed call (``LogitsFn.packed``) give every
      sequence the logits it gets alone.

    Raises:
      ValueError: a row whose ``valid`` is not a prefix, a loss token in column 0 (the first token
        of a packed sequence is predicted by its neighbour's last one) or on padding, an array
        not ``[R, L]``, or more bins than ``num_rows``.
    """
    valid = np.asarray(rows["valid"], bool)
    r, length = valid.shape
    sizes = valid.sum(axis=1)
    if not np.array_equal(valid, np.arange(length)[None, :] < sizes[:, None]):
        raise ValueError("pack_token_rows needs right-padded rows (valid a prefix of every row)")
    loss = np.asarray(rows.get("loss_mask", np.zeros((r, length))))
    if np.any(loss[:, 0] != 0):
        raise ValueError("pack_token_rows: a row has a loss token in column 0")
    if np.any((loss != 0) & ~valid):
        raise ValueError("pack_token_rows: a loss token lies on padding (valid False)")
    for k, v in rows.items():
        if np.shape(v) != (r, length):
            raise ValueError(f"pack_token_rows: {k} has shape {np.shape(v)}, not [rows, length] = {(r, length)}")
    ids = np.asarray(rows["input_ids"])
    bins = [b for b in first_fit_decreasing(sizes, length) if sizes[b].sum() > 0]
    packed = pack([ids[i, : sizes[i]] for i in range(r)], bins, length, num_rows, pad_id)
    on = packed.row_of >= 0
    src_r, src_c = np.where(on, packed.row_of, 0), np.where(on, packed.col_of, 0)
    out = {"input_ids": packed.input_ids, "valid": on, "segment_ids": packed.segment_ids,
           "positions": packed.positions}
    for k, v in rows.items():
        if k not in out:
            v = np.asarray(v)
            out[k] = np.where(on, v[src_r, src_c], np.zeros((), v.dtype)).astype(v.dtype)
    return out
