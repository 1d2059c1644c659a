"""Which question groups of an RL step are trained on (``RLConfig.filter_groups``).

A group whose outcome rewards are all equal has outcome advantage exactly 0 (GRPO's per-group
normalisation, docs/algorithm.md §4): in MemPO only its memory advantages and the KL term move
the policy. ``"outcome_std"`` drops such groups before the memory reward, the log-probs and the
update, so the step's compute goes to groups whose outcome ranks its trajectories: DAPO's dynamic
sampling (Yu et al. 2025, §3.3) without its resampling of new groups; verl's ``filter_groups``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Bool, Int, Real

from mempo_jax.core.registry import Registry

GROUP_FILTERS: Registry[Callable[[np.ndarray, np.ndarray], np.ndarray]] = Registry("RL group filter")


def uniform_groups(rewards: Real[ArrayLike, "trajectories"],
                   group_ids: Int[ArrayLike, "trajectories"]) -> Bool[np.ndarray, "trajectories"]:
    """``[N]`` bool: True where the trajectory's group has all-equal outcome rewards (a group of
    one included), i.e. where ``advantage.outcome_advantage`` is 0 for groups of two or more."""
    rewards, group_ids = np.asarray(rewards), np.asarray(group_ids)
    out = np.zeros(rewards.shape, bool)
    for g in np.unique(group_ids):
        member = group_ids == g
        out[member] = np.ptp(rewards[member]) == 0
    return out


def zero_std_group_share(rewards: Real[ArrayLike, "trajectories"], group_ids: Int[ArrayLike, "trajectories"]) -> float:
    """The share of groups whose rewards are all equal: the groups that ``advantage.outcome_advantage``
    gives exactly 0 (for groups of two or more; docs/algorithm.md §4). 0.0 for no trajectories.

    Args:
      rewards: ``[N]`` outcome rewards.
      group_ids: ``[N]`` group (question) index of each trajectory.
    """
    return group_share(uniform_groups(rewards, group_ids), group_ids)


def group_share(mask: Bool[ArrayLike, "trajectories"], group_ids: Int[ArrayLike, "trajectories"]) -> float:
    """The share of groups for which ``mask`` (``[N]`` bool, equal within each group, e.g.
    ``uniform_groups`` or ``kept_trajectories``) holds. 0.0 for no trajectories."""
    first = np.unique(np.asarray(group_ids), return_index=True)[1]
    return float(np.mean(np.asarray(mask)[first])) if len(first) else 0.0


@GROUP_FILTERS.register("none")
def _all_groups(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """Every trajectory (docs/algorithm.md §4: each group is trained on)."""
    return np.ones(np.shape(rewards), bool)


@GROUP_FILTERS.register("outcome_std")
def _groups_with_outcome_spread(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """The trajectories of groups whose outcome rewards are not all equal."""
    return ~uniform_groups(rewards, group_ids)


def kept_trajectories(name: str, rewards: Real[ArrayLike, "trajectories"],
                      group_ids: Int[ArrayLike, "trajectories"]) -> Bool[np.ndarray, "trajectories"]:
    """``[N]`` bool: the trajectories that filter ``name`` (a name in ``GROUP_FILTERS``) keeps.
    Whole groups are kept or dropped.

    Raises:
      ValueError: an unknown ``name``, listing the known ones.
    """
    return np.asarray(GROUP_FILTERS.get(name)(np.asarray(rewards), np.asarray(group_ids)), bool).reshape(-1)
