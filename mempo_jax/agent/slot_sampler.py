"""A slot KV-cache sampler: prefill new tokens into cache slots, decode all slots in chunks.

The device half of the continuous-batching rollout engine (``mempo_jax.agent.engine``). A fixed
number S of cache slots each hold one trajectory's context from position 0; the host decides what
enters which slot. Two jitted programs, both at static shapes and with the state donated (the
cache is updated in place, never copied):

* ``extend(state, rows [R], ids [R, T], counts [R], starts [R], first [R], ...)`` — writes the
  ``counts[r]`` new tokens of slot ``rows[r]`` at positions ``starts[r] …`` (several rows may be
  consecutive chunks of one slot: each layer writes every row before any row attends; a chunk of a
  prefill: the whole context of a new trajectory, or only what a turn appended — the last sampled token and
  the tool result — while the rest stays cached, as the gemma sampler carries its cache across tool
  turns). On a row's last chunk (``first``) it samples the turn's first token and the slot starts
  generating.
* ``decode(state, steps)`` — up to ``steps`` decode steps of every generating slot (a
  ``lax.while_loop`` that exits early when none is left); a slot stops at a stop id, a completed
  stop string (``stop_strings``) or its token budget, and then idles until the host refills it.

The forward pass is the ``Decoder``'s own with a cache; its attention reads the live cache blocks
only (``mempo_jax.model.attention_xla.blocked_attention`` with ``kv_bound``). Both programs are traced
under the rollout mesh's ``activation_sharding`` (rows over ``data``, heads over ``tensor``: the
cache's layout), as the trainer's are under the training mesh's.
Sampling (``agent.decoding``): ``log softmax(logits / temperature)`` log-probs — what the trainer
computes for the same ids at the same temperature (docs/algorithm.md) — top-p, argmax when greedy.
The PRNG key of step j of turn u of trajectory i is ``fold_in(fold_in(fold_in(key, u), j), i)`` — a
pure function of (key, trajectory, turn, step), whatever slot, batch, device or process it runs in
(the rollout numbers a process's trajectories globally, ``Engine.rollout``'s ``traj_offset``).
``generate`` is a one-shot turn of every prompt row (row b = trajectory b, turn 0).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mempo_jax.model.attention_kernels import check_kernels
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.decoder import KVCache, init_cache
from mempo_jax.model.placement import cache_shardings
from mempo_jax.core.rollout_mesh import weight_sync
from mempo_jax.core.sharding import DEFAULT_RULES, activation_sharding, mesh_or_local, param_shardings
from mempo_jax.model.forward import abstract_model, split_model
from mempo_jax.agent.decoding import is_stop as _is_stop, pick as _pick

DEFAULT_BLOCK = 256  # key-block length of the decode / prefill attention (tokens)


def slot_cache_size(max_context_tokens: int, block: int = DEFAULT_BLOCK) -> int:
    """Slots' length C: ``max_context_tokens`` rounded up to a multiple of the attention block,
    the block being ``block`` or, for shorter contexts, the power of two ``>= max_context_tokens``
    (then C is that power of two). Used by ``SlotSampler`` and the memory plan."""
    n = 1
    while n < max_context_tokens:
        n *= 2
    blk = min(int(block), n)
    return -(-int(max_context_tokens) // blk) * blk


class SlotState(NamedTuple):
    """Device state of the slots (all jax arrays; S slots, cache size C, turn budget N).

    Attributes:
      cache: ``KVCache`` ``[layers, S, kv_heads, C, head_dim]``.
      lengths: ``[S]`` int32 tokens written in each slot (positions ``0 … lengths-1``).
      last: ``[S]`` int32 the last sampled token (fed at the next decode step).
      tokens: ``[S, N]`` int32 the current turn's sampled ids (``pad_id`` after its end).
      logps: ``[S, N]`` float32 their log-probs.
      gen: ``[S]`` int32 tokens sampled in the current turn.
      active: ``[S]`` bool, the slot is generating.
      stopped: ``[S]`` bool, its turn ended with a stop (False: budget, or still running).
      fsm: ``[S]`` int32 stop-automaton state.
      turn, traj: ``[S]`` int32 the turn and trajectory index the slot generates (PRNG keys).
    """

    cache: KVCache
    lengths: jax.Array
    last: jax.Array
    tokens: jax.Array
    logps: jax.Array
    gen: jax.Array
    active: jax.Array
    stopped: jax.Array
    fsm: jax.Array
    turn: jax.Array
    traj: jax.Array


class SampleOutput(NamedTuple):
    """What ``SlotSampler.generate`` returns (numpy arrays).

    Attributes:
      tokens: ``[B, N]`` int32 sampled ids, ``pad_id`` after a row stopped.
      logprobs: ``[B, N]`` float32, ``log softmax(logits / temperature)`` of each sampled id
        (temperature 1 when greedy); 0 on padding.
      mask: ``[B, N]`` bool, True on generated tokens including the stop token.
      lengths: ``[B]`` int32 generated tokens per row (``mask.sum(-1)``).
      stopped: ``[B]`` bool, True when the row emitted a stop id or completed a stop string,
        False when it ran out of budget.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray


def _row_keys(key, turn, step, traj):
    """``[S]`` keys ``fold_in(fold_in(fold_in(key, turn), step), traj)``."""
    def one(u, j, i):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, u), j), i)

    return jax.vmap(one)(turn, step, traj)


class SlotSampler:
    """Jitted ``extend`` / ``decode`` programs over a slot cache of one model.

    Args:
      graphdef: the policy's graphdef (``split_model``).
      model_cfg: its ``ModelConfig``.
      stop_ids: ids that end a turn (emitted and kept).
      pad_id: written after a turn's end.
      stop_automaton: optional ``StopAutomaton`` (``TagCodec.stop_automaton``), over ``model_cfg.vocab_size`` ids.
      block: key-block length of the attention (tokens).
      mesh, rules: device mesh and logical-axis rules (one process's devices: the rollout mesh,
        ``core.rollout_mesh``): the cache is put on ``placement.cache_shardings`` (slots over the
        batch rule), the parameters on ``param_shardings`` (``place``); ``None``: the one-device
        mesh (``sharding.mesh_or_local``) and ``DEFAULT_RULES``.
      param_dtype: dtype ``place`` casts the floating parameters to (``ExecutionConfig.rollout_dtype``;
        ``None``: as the trainer holds them).
      attention_impl: the attention strategy of prefill and decode (``ExecutionConfig.attention_impl``,
        ``model.attention_kernels.resolve_impl``).

    The programs compile once per (S, C, N, R, T, greedy, top_p < 1) and are shared by samplers
    with equal (graphdef, model_cfg, stops, pad, automaton shape, block, state placement).
    """

    def __init__(self, graphdef: nnx.GraphDef, model_cfg: ModelConfig, stop_ids: Sequence[int], pad_id: int, *,
                 stop_automaton=None, block: int = DEFAULT_BLOCK, mesh=None, rules=None, param_dtype=None,
                 attention_impl: str = "xla"):
        self.graphdef, self.model_cfg = graphdef, model_cfg
        self.attention_impl = attention_impl
        self.param_dtype = None if param_dtype is None else jnp.dtype(param_dtype)
        self.stop_ids = tuple(sorted({int(i) for i in stop_ids}))
        self.pad_id = int(pad_id)
        self.block = int(block)
        self.mesh, self.rules = mesh_or_local(mesh), (DEFAULT_RULES if rules is None else rules)
        check_kernels(attention_impl, model_cfg.head_dim, self.mesh)  # an explicit kernel that cannot run stops here
        self._tables = None
        if stop_automaton is not None:
            if stop_automaton.vocab_size != model_cfg.vocab_size:
                raise ValueError(f"stop_automaton covers {stop_automaton.vocab_size} ids but the model has "
                                 f"{model_cfg.vocab_size} embedding rows")
            self._tables = (jnp.asarray(np.asarray(stop_automaton.next_state, np.int32)),
                            jnp.asarray(np.asarray(stop_automaton.completes, bool)))
        self._placements = {}  # (slots, size) -> state_shardings
        self.param_shardings = param_shardings(split_model(abstract_model(model_cfg))[1], self.mesh, self.rules)

    def place(self, params) -> nnx.State:
        """The policy's parameters on this sampler's mesh (``rollout_mesh.weight_sync``: one
        all-gather over the training mesh when it spans processes, else a ``device_put`` that
        copies nothing already in place), cast to ``param_dtype``. A collective on several
        processes: call it on each."""
        return weight_sync(params, self.param_shardings, self.param_dtype)

    def cache_size(self, max_context_tokens: int) -> int:
        """Slots' length C for contexts of at most ``max_context_tokens`` (``slot_cache_size``)."""
        return slot_cache_size(max_context_tokens, self.block)

    def state_shardings(self, slots: int, size: int) -> SlotState:
        """Where a state of ``slots`` slots of ``size`` positions lives: the cache on
        ``placement.cache_shardings`` (slots over the batch rule, kv heads over ``tensor``), the
        per-slot sampling fields replicated. ``init_state`` places the state so and every program
        returns it so (jit ``out_shardings``): the donated state keeps one placement, and a program
        compiled on another program's output serves ``init_state``'s too (one jit key)."""
        key = (int(slots), int(size))
        if key not in self._placements:  # once per shape: every program call asks
            cache = cache_shardings(self.model_cfg, slots, size, self.mesh, self.rules)
            rep = NamedSharding(self.mesh, PartitionSpec())
            self._placements[key] = SlotState(cache, *([rep] * (len(SlotState._fields) - 1)))
        return self._placements[key]

    def _program(self, which: str, state: SlotState):
        """The jitted ``which`` program for ``state``'s shapes (``_compiled``)."""
        s, size = state.cache.k.shape[1], state.cache.k.shape[3]
        return _compiled(self.graphdef, self.model_cfg, self.stop_ids, self.pad_id, self.block,
                         self._tables is not None, which, self.state_shardings(s, size), tuple(self.rules),
                         self.attention_impl)

    def init_state(self, slots: int, size: int, max_new_tokens: int) -> SlotState:
        """Empty slots: zero cache of ``size`` positions, nothing generating, placed by ``state_shardings``."""
        def z(dtype=jnp.int32):  # distinct buffers: the state is donated leaf by leaf
            return jnp.zeros((slots,), dtype)

        state = SlotState(init_cache(self.model_cfg, slots, size), z(), z(),
                          jnp.full((slots, max_new_tokens), self.pad_id, jnp.int32),
                          jnp.zeros((slots, max_new_tokens), jnp.float32), z(), z(bool), z(bool), z(), z(), z())
        return jax.device_put(state, self.state_shardings(slots, size))

    def extend(self, params, state: SlotState, rows, ids, counts, starts, first, turn, traj, key,
               temperature: float, top_p: float, greedy: bool) -> SlotState:
        """Write new tokens into slots; sample the first token of the rows whose prefill ends here.

        Args:
          params: policy parameters.
          state: the slots (donated: do not reuse the argument).
          rows: ``[R]`` int32 slot per row; ``S`` (or more) marks a padding row. Rows of one slot
            must be consecutive chunks (distinct ``starts``); the last sets the slot's length.
          ids: ``[R, T]`` int32 new tokens, left-aligned; ``counts[r] >= 1`` real ones per real row.
          counts, starts: ``[R]`` int32 real tokens and the cache position of the first one; the
            slot's tokens at positions ``>= starts[r]`` are replaced.
          first: ``[R]`` bool, True on a row's last chunk: its turn starts (token 0 sampled).
          turn, traj: ``[R]`` int32 turn and trajectory index (PRNG keys).
          key: PRNG key of the rollout.
          temperature, top_p, greedy: sampling temperature (1 when greedy), nucleus mass, argmax.

        Returns:
          The new ``SlotState``.
        """
        extra = () if self._tables is None else (self._tables,)
        program = self._program("extend", state)
        return program(params, state, jnp.asarray(rows, jnp.int32), jnp.asarray(ids, jnp.int32),
                       jnp.asarray(counts, jnp.int32), jnp.asarray(starts, jnp.int32), jnp.asarray(first, bool),
                       jnp.asarray(turn, jnp.int32), jnp.asarray(traj, jnp.int32), key,
                       jnp.float32(1.0 if greedy else temperature), jnp.float32(top_p), *extra,
                       greedy=greedy, use_top_p=top_p < 1.0)

    def copy(self, state: SlotState, src, dst) -> SlotState:
        """Copy the cache of slot ``src[r]`` into slot ``dst[r]`` (every position; ``dst >= S``: a
        padding row, nothing copied), so that ``dst`` can prefill from a prefix ``src`` holds (the
        shared system prompt + question of a group's trajectories). State donated; ``lengths`` and
        the sampling state are not changed (the following ``extend`` of ``dst`` sets them).

        Args:
          state: the slots.
          src, dst: ``[R]`` int32 slot indices.
        """
        return self._program("copy", state)(state, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))

    def generate(self, params, prompt_ids, prompt_mask, key, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0) -> SampleOutput:
        """One turn of every row: each prompt prefilled into its own slot, then decoded to its stop
        or ``max_new_tokens`` (a one-shot batched generate; the rollout runs ``extend`` / ``decode``
        itself).

        Args:
          params: parameters on this sampler's mesh (``place``).
          prompt_ids: ``[B, P]`` int32; the real tokens of row b are those where ``prompt_mask``
            is True (left, right or inner padding), at positions ``0 … n_b - 1``.
          prompt_mask: ``[B, P]`` bool, at least one True per row.
          key: PRNG key; step j of row b draws with the key of trajectory b, turn 0, step j
            (``_row_keys``).
          max_new_tokens: budget N (>= 1); temperature (0: greedy), top_p: as ``extend``.

        Returns:
          ``SampleOutput`` of ``[B, N]`` / ``[B]`` numpy arrays.

        Raises:
          ValueError: for a row without a real token, shapes that differ, or an option out of range
            (named).
        """
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        ids, mask = np.asarray(prompt_ids, np.int32), np.asarray(prompt_mask, bool)
        if ids.ndim != 2 or ids.shape != mask.shape:
            raise ValueError(f"prompt_ids {ids.shape} and prompt_mask {mask.shape} must be equal [B, P]")
        counts = mask.sum(axis=1).astype(np.int32)
        if (counts < 1).any():
            raise ValueError("every prompt row needs at least one real token")
        b, n = ids.shape[0], int(max_new_tokens)
        width = 1 << max(int(counts.max()) - 1, 0).bit_length()  # a power of two: few compiled shapes
        rows = np.full((b, width), self.pad_id, np.int32)
        for r in range(b):
            rows[r, : counts[r]] = ids[r][mask[r]]
        greedy = temperature == 0.0
        state = self.init_state(b, self.cache_size(int(counts.max()) + n), n)
        zeros, index = np.zeros((b,), np.int32), np.arange(b, dtype=np.int32)
        state = self.extend(params, state, index, rows, counts, zeros, np.ones((b,), bool), zeros, index, key,
                            temperature, top_p, greedy)
        state = self.decode(params, state, n, key, temperature, top_p, greedy)
        tokens, logps, gen, stopped = jax.device_get((state.tokens, state.logps, state.gen, state.stopped))
        gen = np.asarray(gen, np.int32)
        return SampleOutput(np.asarray(tokens), np.asarray(logps), np.arange(n)[None] < gen[:, None], gen,
                            np.asarray(stopped))

    def decode(self, params, state: SlotState, steps: int, key, temperature: float, top_p: float,
               greedy: bool, rows=None) -> SlotState:
        """Up to ``steps`` decode steps of every active slot (state donated).

        Args:
          rows: optional ``[R]`` int32 slots to decode (``S`` or more: padding), every active slot
            among them: the step then runs on R rows instead of S (the slots' cache is read in
            place; a batch of 64 slots with 24 generating costs a batch of 32). ``None``: all slots.
        """
        extra = () if self._tables is None else (self._tables,)
        rows = None if rows is None else jnp.asarray(rows, jnp.int32)
        program = self._program("decode", state)
        return program(params, state, key, jnp.float32(1.0 if greedy else temperature), jnp.float32(top_p),
                       *extra, rows=rows, steps=int(steps), greedy=greedy, use_top_p=top_p < 1.0)


@functools.lru_cache(maxsize=64)
def _compiled(graphdef, model_cfg, stop_ids, pad_id, block, fsm, which, state_shardings, rules, attention_impl):
    """The jitted ``extend``, ``decode`` or ``copy`` program, state donated and returned on
    ``state_shardings`` (``SlotSampler.state_shardings``), the model's activations pinned to
    ``rules`` on that mesh (``activation_sharding``). ``fsm``: the stop-automaton tables come as
    the last positional argument (part of the cache key only)."""
    del model_cfg, fsm  # cache key: the graphdef carries the model, the call the tables
    if which == "copy":
        return jax.jit(_copy_impl, donate_argnums=(0,), out_shardings=state_shardings)
    impl = functools.partial(_extend_impl if which == "extend" else _decode_impl, graphdef, stop_ids, pad_id, block,
                             attention_impl=attention_impl)
    mesh = state_shardings.cache.k.mesh

    @functools.wraps(impl)
    def traced(*args, **kwargs):
        with activation_sharding(mesh, rules):
            return impl(*args, **kwargs)

    traced.__name__ = f"slot_{which}"  # the program's name in profiles and compile logs

    statics = ("greedy", "use_top_p") + (("steps",) if which == "decode" else ())
    return jax.jit(traced, static_argnames=statics, donate_argnums=(1,), out_shardings=state_shardings)


def _copy_impl(state: SlotState, src, dst) -> SlotState:
    """Slot ``src[r]``'s cache into slot ``dst[r]`` (``SlotSampler.copy``)."""
    s = state.lengths.shape[0]
    src = jnp.clip(src, 0, s - 1)
    k = state.cache.k.at[:, dst].set(state.cache.k[:, src], mode="drop")
    v = state.cache.v.at[:, dst].set(state.cache.v[:, src], mode="drop")
    return state._replace(cache=KVCache(k, v))


def _stop_now(tok, fsm_state, stop_ids, tables):
    """(stop ``[R]`` bool, next automaton state ``[R]``) after token ``tok``."""
    stop = _is_stop(tok, stop_ids)
    if tables is None:
        return stop, fsm_state
    next_state, completes = tables
    return stop | completes[fsm_state, tok], next_state[fsm_state, tok]


def _extend_impl(graphdef, stop_ids, pad_id, block, params, state: SlotState, rows, ids, counts, starts, first,
                 turn, traj, key, temperature, top_p, tables=None, *, greedy, use_top_p, attention_impl="xla"):
    model = nnx.merge(graphdef, params)
    s, n = state.tokens.shape
    r, t = ids.shape
    real = rows < s
    write = (jnp.arange(t)[None, :] < counts[:, None]) & real[:, None]
    positions = starts[:, None] + jnp.arange(t)[None, :]
    bound = jnp.max(jnp.where(write, positions, 0)) + 1
    logits, cache = model(ids, positions, cache=state.cache, rows=rows, write=write, kv_bound=bound, block_k=block,
                          logits_at=jnp.maximum(counts - 1, 0), attention_impl=attention_impl)
    logits = logits[:, 0]
    keys = _row_keys(key, turn, jnp.zeros_like(turn), traj)
    tok, lp = _pick(logits, keys, temperature, top_p, greedy, use_top_p)
    stop, fsm = _stop_now(tok, jnp.zeros_like(tok), stop_ids, tables)
    go = real & first
    srow = jnp.where(real, rows, s)  # scatter index; s = dropped
    later = (srow[None, :] == srow[:, None]) & (starts[None, :] > starts[:, None])  # [R, R]: a later chunk, same slot
    last = real & ~jnp.any(later, axis=1)  # the row that sets its slot's length (one per slot)

    def put(arr, val, mask):
        return arr.at[jnp.where(mask, srow, s)].set(val, mode="drop")

    tokens_row = jnp.full((r, n), pad_id, jnp.int32).at[:, 0].set(tok)
    logps_row = jnp.zeros((r, n), jnp.float32).at[:, 0].set(lp)
    return SlotState(
        cache=cache,
        lengths=put(state.lengths, starts + counts, last),
        last=put(state.last, tok, go),
        tokens=put(state.tokens, tokens_row, go),
        logps=put(state.logps, logps_row, go),
        gen=put(state.gen, jnp.ones_like(tok), go),
        active=put(state.active, ~stop & (n > 1), go),
        stopped=put(state.stopped, stop, go),
        fsm=put(state.fsm, fsm, go),
        turn=put(state.turn, turn, go),
        traj=put(state.traj, traj, go),
    )


def _decode_impl(graphdef, stop_ids, pad_id, block, params, state: SlotState, key, temperature, top_p, tables=None,
                 rows=None, *, steps, greedy, use_top_p, attention_impl="xla"):
    model = nnx.merge(graphdef, params)
    s, n = state.tokens.shape
    fields = ("lengths", "last", "tokens", "logps", "gen", "active", "stopped", "fsm", "turn", "traj")
    full = {f: v for f, v in state._asdict().items() if f in fields}
    if rows is None:
        sub, gather = full, None
    else:  # the rows' sampling state; padding rows (>= s) read slot 0, inactive
        gather = jnp.clip(rows, 0, s - 1)
        sub = {f: v[gather] for f, v in full.items()}
        sub["active"] = sub["active"] & (rows < s)
    r = sub["last"].shape[0]
    idx = jnp.arange(r)

    def cond(carry):
        i, _, st = carry
        return (i < steps) & jnp.any(st["active"])

    def body(carry):
        i, cache, st = carry
        act = st["active"]
        pos = st["lengths"]
        bound = jnp.max(jnp.where(act, pos, 0)) + 1
        logits, cache = model(st["last"][:, None], pos[:, None], cache=cache, rows=rows, write=act[:, None],
                              kv_bound=bound, block_k=block, logits_at=jnp.zeros((r,), jnp.int32),
                              attention_impl=attention_impl)
        logits = logits[:, 0]
        keys = _row_keys(key, st["turn"], st["gen"], st["traj"])
        tok, lp = _pick(logits, keys, temperature, top_p, greedy, use_top_p)
        stop, fsm = _stop_now(tok, st["fsm"], stop_ids, tables)
        col = jnp.where(act, st["gen"], n)  # out of range -> dropped
        gen = st["gen"] + act
        return i + 1, cache, dict(
            st,
            lengths=pos + act,
            last=jnp.where(act, tok, st["last"]),
            tokens=st["tokens"].at[idx, col].set(tok, mode="drop"),
            logps=st["logps"].at[idx, col].set(lp, mode="drop"),
            gen=gen,
            active=act & ~stop & (gen < n),
            stopped=st["stopped"] | (act & stop),
            fsm=jnp.where(act, fsm, st["fsm"]),
        )

    _, cache, sub = jax.lax.while_loop(cond, body, (jnp.int32(0), state.cache, sub))
    if rows is None:
        return SlotState(cache=cache, **sub)
    dst = jnp.where(rows < s, rows, s)  # padding rows dropped
    return SlotState(cache=cache, **{f: v.at[dst].set(sub[f], mode="drop") for f, v in full.items()})


__all__ = ["DEFAULT_BLOCK", "SampleOutput", "SlotSampler", "SlotState", "slot_cache_size"]
