"""Padding to static shapes: power-of-two length buckets so jit compiles a handful of programs.

Static shapes (docs/algorithm.md §2): pad to buckets (powers of two) so jit compiles a handful
of programs, not one per batch.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from jaxtyping import Bool, Int


def bucket_length(n: int, minimum: int = 16) -> int:
    """Smallest power of two ``>= max(n, minimum)``.

    Args:
      n: a length in tokens (or rows), ``>= 0``.
      minimum: the smallest bucket; a power of two.

    Raises:
      ValueError: if ``n`` is negative.
    """
    if n < 0:
        raise ValueError(f"length must be >= 0, got {n}")
    size = max(int(minimum), 1)
    while size < n:
        size *= 2
    return size


def length_buckets(minimum: int, bound: int) -> list[int]:
    """Every bucket ``bucket_length`` can return for lengths up to ``bound``:
    ``[minimum, 2·minimum, …, bucket_length(bound, minimum)]`` (the shapes to precompile)."""
    out = [max(int(minimum), 1)]
    while out[-1] < bound:
        out.append(out[-1] * 2)
    return out


def pad_sequences(
    seqs: Sequence[Sequence[int | np.integer] | np.ndarray],
    pad_id: int,
    length: int | None = None,
    side: str = "right",
) -> tuple[Int[np.ndarray, "rows length"], Bool[np.ndarray, "rows length"]]:
    """Stack variable-length id lists into one padded array.

    Args:
      seqs: ``batch`` lists (or 1-D integer arrays) of token ids.
      pad_id: id written into padding slots.
      length: target length; default ``bucket_length(max len)``.
      side: ``"right"`` (training, scoring) or ``"left"`` (sampler prompts).

    Returns:
      ``(ids [batch, length] int32, mask [batch, length] bool)``; mask is True on real tokens.

    Raises:
      ValueError: if a sequence is longer than ``length`` or ``side`` is unknown.
    """
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    longest = max((len(s) for s in seqs), default=0)
    if length is None:
        length = bucket_length(longest)
    if longest > length:
        raise ValueError(f"a sequence of {longest} tokens does not fit length {length}")
    ids = np.full((len(seqs), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(seqs), length), dtype=bool)
    for i, s in enumerate(seqs):
        n = len(s)
        if n == 0:
            continue
        if side == "right":
            ids[i, :n] = s
            mask[i, :n] = True
        else:
            ids[i, length - n :] = s
            mask[i, length - n :] = True
    return ids, mask
