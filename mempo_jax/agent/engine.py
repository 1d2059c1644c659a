"""The cached rollout engine: KV cache kept across turns, stopped rows refilled (continuous batching).

Host half of the engine (device half: ``mempo_jax.agent.slot_sampler``). Every trajectory owns one of a
fixed number of cache slots (``Slot``: its owner, cached ids, running context) from its first turn
to its end. A cycle (``rollout_cached``):

1. ``admit``: free slots take waiting trajectories, and every slot whose trajectory needs a turn
   gets a prefill of *only what its cache lacks*: the longest common prefix of the cached ids and
   the new policy context stays (in ``full`` mode the whole previous context and the sampled turn:
   the prefill is the turn's last token and the tool result; in k-step mode the system prompt and
   question). A trajectory's first prefill copies the system prompt + question from a slot that
   holds them (``SlotSampler.copy``: the n trajectories of a group prefill their shared prompt
   once) and writes only its last prompt token;
2. ``SlotSampler.extend`` writes the prefills in rows of ``prefill_chunk`` tokens (every slot's
   rows together, a power-of-two row bucket a call) and samples each turn's first token;
3. ``SlotSampler.decode`` runs ``decode_chunk`` steps of every generating slot (on a row bucket of
   the generating slots only, ``decode_rows``);
4. ``end_turns``: slots whose turn ended leave the decode batch; their turns are parsed and
   answered by the tool environment in one batched call (``turns.apply_tools``; the engine names
   no tool), and at the next cycle their next turn — or, when their episode ended, another
   trajectory — enters with its prefill.

A row that stops therefore never waits for the longest row of its turn, and no context is
prefilled twice. The recorded turns (ids, log-probs, ``<mem>`` spans, tool results, context
lengths, end reasons) are those of re-prefilling every context every turn on the same policy:
greedy float32 gives the same tokens (``tests/agent/test_engine.py``); the PRNG key of a sampled
token is a pure function of (key, trajectory index, turn, step) (``slot_sampler`` module docstring).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import numpy as np

from mempo_jax.core.batching import bucket_length
from mempo_jax.agent.slot_sampler import DEFAULT_BLOCK, SampleOutput, SlotSampler
from mempo_jax.agent.turns import apply_tools, close_episodes, make_turn

MIN_EXTEND_ROWS = 8  # smallest row bucket of a prefill call


def num_slots(cfg, num_trajectories: int) -> int:
    """Cache slots of a rollout: ``cfg.num_slots`` when set (> 0), else
    ``bucket_length(num_trajectories, cfg.min_rows_bucket)``."""
    return int(cfg.num_slots) if cfg.num_slots > 0 else bucket_length(max(num_trajectories, 1), cfg.min_rows_bucket)


def _extend_rows_floor(slots: int) -> int:
    """Smallest row bucket of a prefill call and of a decode chunk (``decode_rows``):
    ``MIN_EXTEND_ROWS``, at most ``bucket(slots)``."""
    return min(MIN_EXTEND_ROWS, bucket_length(slots, 1))


def decode_rows(generating: Sequence[int], slots: int) -> Optional[np.ndarray]:
    """The rows of a decode chunk: ``None`` (every slot) when the generating slots' row bucket
    ``bucket_length(n, _extend_rows_floor(slots))`` reaches the slot count, else that many slot
    indices (the generating ones, then ``slots``: padding)."""
    n = bucket_length(max(len(generating), 1), _extend_rows_floor(slots))
    if n >= slots:
        return None
    rows = np.full((n,), slots, np.int32)
    rows[: len(generating)] = generating
    return rows


def extend_shapes(cfg, slots: int) -> list[tuple[int, int]]:
    """Every ``(rows, length)`` a prefill call can run at: rows ``bucket_length(n,
    _extend_rows_floor(slots))`` for ``1 <= n <= slots``, length ``cfg.prefill_chunk`` (the row) or 1
    (a call whose every row is one token: the followers' last prompt token after their copy)."""
    low = _extend_rows_floor(slots)
    widths = sorted({1, cfg.prefill_chunk})
    return [(r, w) for r in sorted({bucket_length(n, low) for n in range(1, slots + 1)}) for w in widths]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclasses.dataclass
class Slot:
    """The host state of one cache slot."""

    owner: Optional[int] = None  # index in ``trajs`` of the trajectory holding the slot; None: free
    cached: list[int] = dataclasses.field(default_factory=list)  # host mirror of the ids in its cache
    context: list[int] = dataclasses.field(default_factory=list)  # the policy context of its running turn
    generating: bool = False  # its turn is being sampled


class Prefill(NamedTuple):
    """One slot's pending prefill: ``ids`` written from cache position ``start``; ``traj`` (global
    index) and ``turn`` key the first sampled token."""

    slot: int
    traj: int
    turn: int
    ids: list[int]
    start: int


def _donor(s: int, prompt: Sequence[int], slots: list[Slot], followers: dict[int, int]) -> Optional[int]:
    """A slot other than ``s`` whose cache holds ``prompt`` at its start once this cycle's
    non-follower prefills ran (a follower's own copy runs later: never a donor), or ``None``."""
    prompt = list(prompt)
    return next((d for d, slot in enumerate(slots) if d != s and slot.owner is not None and d not in followers
                 and slot.cached[: len(prompt)] == prompt), None)


def admit(slots: list[Slot], queue: collections.deque, trajs: list, cfg, traj_offset: int
          ) -> tuple[list[Prefill], dict[int, int]]:
    """The refill policy of a cycle: every free slot takes the next queued trajectory; every owned
    slot not generating starts its trajectory's next turn, unless the next context and a turn's
    budget exceed ``cfg.max_context_tokens`` (the episode ends with ``end_reason`` ``"budget"`` and
    the slot is free for the next trajectory, in a further pass). Slots are visited in order. A
    started slot's cache keeps the longest common prefix of its cached ids and the new context (at
    most all but one id: the fed id's logits start the turn); one that keeps nothing copies its
    prompt from a donor slot when one holds it.

    Returns:
      ``(prefills, followers)``: the started slots' prefills (what each cache lacks) and
      ``slot -> donor slot`` of the slots whose prompt is copied.
    """
    prefills, followers = [], {}
    changed = True
    while changed:
        changed = False
        for s, slot in enumerate(slots):
            if slot.owner is None and queue:
                slot.owner, slot.cached = queue.popleft(), []
            if slot.owner is None or slot.generating:
                continue
            tr = trajs[slot.owner]
            ctx = tr.policy_context(cfg.context_steps)
            if len(ctx) + cfg.max_new_tokens > cfg.max_context_tokens:
                tr.done, tr.end_reason = True, "budget"
                slot.owner, changed = None, True
                continue
            keep = min(_common_prefix(slot.cached, ctx), len(ctx) - 1)
            donor = _donor(s, tr.prompt_ids, slots, followers) if keep == 0 else None
            if donor is not None:  # the shared prompt is (or will be, after phase 1) in slot donor
                keep = min(len(tr.prompt_ids), len(ctx) - 1)
                followers[s] = donor
            prefills.append(Prefill(s, traj_offset + slot.owner, len(tr.turns), ctx[keep:], keep))
            slot.context, slot.cached, slot.generating = ctx, list(ctx), True
    return prefills, followers


def _run_prefills(sampler: SlotSampler, params, state, prefills: list[Prefill], cfg, slots: int, key, greedy: bool):
    """All pending prefills, cut into rows of ``cfg.prefill_chunk`` tokens (a slot's prefill spans
    as many rows as it needs), at most ``bucket(slots)`` rows a call, rows in call order. Rows of
    one slot in one call are consecutive chunks: every layer writes all rows' keys/values before
    any row attends, so a chunk sees the chunks before it. Padding is only the tail of each
    prefill's last row and the row bucket of the last call (a row per slot padded to the longest
    prefill computed 2.6x the real tokens of SmolLM2's tool results)."""
    low = _extend_rows_floor(slots)
    pieces = [(p, o) for p in prefills for o in range(0, len(p.ids), cfg.prefill_chunk)]  # (prefill, offset) a row
    most = bucket_length(slots, low)
    for c in range(0, len(pieces), most):
        call = pieces[c: c + most]
        rows_n = bucket_length(len(call), low)
        width = 1 if all(len(p.ids) - o == 1 for p, o in call) else cfg.prefill_chunk
        rows = np.full((rows_n,), slots, np.int32)
        ids = np.full((rows_n, width), sampler.pad_id, np.int32)
        counts = np.ones((rows_n,), np.int32)
        starts, first = np.zeros((rows_n,), np.int32), np.zeros((rows_n,), bool)
        turn, traj = np.zeros((rows_n,), np.int32), np.zeros((rows_n,), np.int32)
        for r, (p, o) in enumerate(call):
            piece = p.ids[o: o + cfg.prefill_chunk]
            rows[r], counts[r], starts[r] = p.slot, len(piece), p.start + o
            ids[r, : len(piece)] = piece
            first[r] = o + len(piece) >= len(p.ids)
            turn[r], traj[r] = p.turn, p.traj
        state = sampler.extend(params, state, rows, ids, counts, starts, first, turn, traj, key,
                               cfg.temperature, cfg.top_p, greedy)
    return state


def end_turns(state, slots: list[Slot], trajs: list, fmt, tool_env, cfg) -> None:
    """The turns that stopped in the last decode chunk: each is recorded (``make_turn``) on its
    trajectory and answered (``apply_tools``: one batched call of the tool environment); its
    slot's cache mirror grows by the turn's ids (the last one was never fed), and a slot whose
    episode ended is freed."""
    active, gen, stopped = jax.device_get((state.active, state.gen, state.stopped))
    ended = [s for s, slot in enumerate(slots) if slot.generating and not active[s]]
    if not ended:
        return
    tokens, logps = jax.device_get((state.tokens, state.logps))
    turns = []
    for s in ended:
        n, slot = int(gen[s]), slots[s]
        turn = make_turn(fmt, tokens[s, :n], logps[s, :n], bool(stopped[s]))
        turn.context_len = len(slot.context)
        turns.append(turn)
        slot.cached = slot.context + [int(x) for x in tokens[s, : n - 1]]
    apply_tools(fmt, tool_env, [trajs[slots[s].owner] for s in ended], turns, cfg)
    for s in ended:
        slots[s].generating = False
        if trajs[slots[s].owner].done:
            slots[s].owner = None


def rollout_cached(sampler: SlotSampler, params, trajs: list, fmt, tool_env, cfg, key: jax.Array,
                   progress: Optional[Callable[[int, int], None]] = None, traj_offset: int = 0) -> list:
    """``Engine.rollout`` on ``sampler``'s programs: the trajectories are finished in place and returned.

    Args:
      sampler: the policy's ``SlotSampler``; every program runs on its (host-local) mesh.
      params: the policy parameters, placed by ``sampler.place`` first (a no-op when they are already
        on the sampler's mesh; with params on a mesh spanning processes, a collective).
      trajs, fmt, tool_env, cfg, key: as ``Engine.rollout``.
      progress: optional callback ``(turn, generating slots)`` once per cycle.
      traj_offset: global index of ``trajs[0]`` (this process's first trajectory): trajectory i
        draws its keys as trajectory ``traj_offset + i``.
    """
    params = sampler.place(params)
    n_slots, greedy = num_slots(cfg, len(trajs)), cfg.temperature == 0.0
    state = sampler.init_state(n_slots, sampler.cache_size(cfg.max_context_tokens), cfg.max_new_tokens)
    queue = collections.deque(i for i, tr in enumerate(trajs) if not tr.done)
    slots = [Slot() for _ in range(n_slots)]
    while True:
        prefills, followers = admit(slots, queue, trajs, cfg, traj_offset)
        generating = [s for s, slot in enumerate(slots) if slot.generating]
        if not generating:
            return close_episodes(trajs)
        if progress is not None:
            progress(max(len(trajs[slots[s].owner].turns) for s in generating), len(generating))
        if prefills:
            state = _prefill_phases(sampler, params, state, prefills, followers, cfg, n_slots, key, greedy)
        state = sampler.decode(params, state, cfg.decode_chunk, key, cfg.temperature, cfg.top_p, greedy,
                               rows=decode_rows(generating, n_slots))
        end_turns(state, slots, trajs, fmt, tool_env, cfg)


def _prefill_phases(sampler: SlotSampler, params, state, prefills: list[Prefill], followers: dict[int, int], cfg,
                    slots: int, key: jax.Array, greedy: bool):
    """Runs this cycle's ``prefills`` in two phases and returns the new slot state: phase 1 every
    prefill but the followers'; phase 2 copies each follower's shared prompt from its donor slot
    (``followers``: slot -> donor slot) in one padded copy, then runs the followers' prefills."""
    first = [p for p in prefills if p.slot not in followers]
    if first:
        state = _run_prefills(sampler, params, state, first, cfg, slots, key, greedy)
    if followers:
        n = bucket_length(len(followers), _extend_rows_floor(slots))
        src, dst = np.zeros((n,), np.int32), np.full((n,), slots, np.int32)
        src[: len(followers)], dst[: len(followers)] = list(followers.values()), list(followers)
        state = sampler.copy(state, src, dst)
        state = _run_prefills(sampler, params, state, [p for p in prefills if p.slot in followers], cfg,
                              slots, key, greedy)
    return state


def warm_engine(sampler: SlotSampler, params, cfg, num_trajectories: int, key: jax.Array) -> int:
    """Compile every program a ``rollout_cached`` of ``num_trajectories`` can run (each prefill
    shape of ``extend_shapes`` and the decode chunk) on dummy tokens; returns the number of shapes."""
    params = sampler.place(params)
    slots = num_slots(cfg, num_trajectories)
    size = sampler.cache_size(cfg.max_context_tokens)
    greedy = cfg.temperature == 0.0
    state = sampler.init_state(slots, size, cfg.max_new_tokens)
    shapes = extend_shapes(cfg, slots)
    for r, t in shapes:
        zeros = np.zeros((r,), np.int32)
        state = sampler.extend(params, state, np.arange(r, dtype=np.int32) % slots, np.ones((r, t), np.int32),
                               np.ones((r,), np.int32), zeros, np.ones((r,), bool), zeros, zeros, key,
                               cfg.temperature, cfg.top_p, greedy)
    copies = sorted({r for r, _ in shapes})
    for r in copies:
        state = sampler.copy(state, np.zeros((r,), np.int32), np.full((r,), slots, np.int32))
    decodes = sorted({r for r, _ in shapes if r < slots})
    for r in decodes + [None]:
        rows = None if r is None else np.full((r,), slots, np.int32)
        state = sampler.decode(params, state, cfg.decode_chunk, key, cfg.temperature, cfg.top_p, greedy, rows=rows)
    jax.block_until_ready(state.lengths)
    return len(shapes) + len(copies) + len(decodes) + 1


class RolloutEngine:
    """The policy's rollout engine: a ``SlotSampler`` (device half) driven by ``rollout_cached``
    (host half). What ``Engine.rollout`` runs and what the trainer, the evaluation command and the
    benchmarks build (``experiment.make_engine``).

    Args:
      graphdef, model_cfg: the policy model (``split_model``).
      stop_ids: ids that end a turn (EOS, end-of-turn ids, single-token closing tags).
      pad_id: written after a turn's end.
      stop_automaton: optional ``StopAutomaton`` (closing tags written as several tokens).
      mesh, rules: the rollout mesh (this process's devices, ``core.rollout_mesh``) and rules;
        ``None``: one device, ``DEFAULT_RULES``.
      block: key-block length of the cache attention (tokens).
      param_dtype: the rollout copy's dtype (``ExecutionConfig.rollout_dtype``; ``None``: the trainer's).
      attention_impl: the attention strategy (``ExecutionConfig.attention_impl``).
    """

    def __init__(self, graphdef, model_cfg, stop_ids: Sequence[int], pad_id: int, *, stop_automaton=None,
                 mesh=None, rules=None, block: int = DEFAULT_BLOCK, param_dtype=None, attention_impl: str = "xla"):
        self.sampler = SlotSampler(graphdef, model_cfg, stop_ids, pad_id, stop_automaton=stop_automaton, block=block,
                                   mesh=mesh, rules=rules, param_dtype=param_dtype, attention_impl=attention_impl)

    @property
    def mesh(self):
        """The rollout mesh."""
        return self.sampler.mesh

    def place(self, params):
        """``SlotSampler.place``: the parameters on the rollout mesh (the weight sync)."""
        return self.sampler.place(params)

    def rollout(self, params, trajs: list, fmt, tool_env, cfg, key: jax.Array,
                progress: Optional[Callable[[int, int], None]] = None, traj_offset: int = 0) -> list:
        """``rollout_cached`` on this engine's sampler."""
        return rollout_cached(self.sampler, params, trajs, fmt, tool_env, cfg, key, progress, traj_offset)

    def warm(self, params, cfg, num_trajectories: int, key: jax.Array) -> int:
        """``warm_engine`` on this engine's sampler."""
        return warm_engine(self.sampler, params, cfg, num_trajectories, key)

    def __call__(self, params, prompt_ids, prompt_mask, key, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0) -> SampleOutput:
        """One turn of every prompt row (``SlotSampler.generate`` with the parameters placed first)."""
        return self.sampler.generate(self.place(params), prompt_ids, prompt_mask, key, max_new_tokens,
                                     float(temperature), float(top_p))


__all__ = ["Prefill", "RolloutEngine", "Slot", "admit", "decode_rows", "end_turns", "extend_shapes", "num_slots",
           "rollout_cached", "warm_engine"]
