"""Jitted KV-cache sampler: one prefill, then a ``lax.while_loop`` decode with per-row stops.

Design after the gemma sampler (google-deepmind/gemma ``gm.text.Sampler``): a frozen dataclass
of static options, the whole generation one jitted program, a preallocated KV cache of
``prompt bucket + max_new_tokens`` slots, static shapes. Returned log-probs are
``log softmax(logits / temperature)`` of the sampled ids, i.e. exactly what
``mempo_jax.model.forward.sequence_logprobs`` gives the same ids at the same temperature
(docs/algorithm.md §2 token-in/token-out, §5 "log-probs in the trainer use the same temperature").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mempo_jax.agent.decoding import is_stop as _is_stop, pick
from mempo_jax.model.attention import BLOCK_K
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.decoder import init_cache
from mempo_jax.model.forward import abstract_model, positions_from_mask, split_model
from mempo_jax.model.placement import cache_shardings
from mempo_jax.core.rollout_mesh import weight_sync
from mempo_jax.core.sharding import DEFAULT_RULES, logical_to_sharding, mesh_or_local, param_shardings, replicated


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Static sampling options.

    Attributes:
      max_new_tokens: generation budget N per row (> 0).
      temperature: softmax temperature; 0.0 means greedy (argmax).
      top_p: nucleus mass in (0, 1]; 1.0 disables the filter.

    Raises:
      ValueError: naming the field that is out of range.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"SamplerConfig.max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplerConfig.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplerConfig.top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0``."""
        return self.temperature == 0.0


class SampleOutput(NamedTuple):
    """What ``Sampler.__call__`` returns (all jax arrays).

    Attributes:
      tokens: ``[B, N]`` int32 sampled ids, ``pad_id`` after a row stopped.
      logprobs: ``[B, N]`` float32, log softmax(logits / temperature) of each sampled id
        (temperature 1 when greedy); 0 on padding.
      mask: ``[B, N]`` bool, True on generated tokens including the stop token.
      lengths: ``[B]`` int32 generated tokens per row (``mask.sum(-1)``).
      stopped: ``[B]`` bool, True when the row emitted a stop id, False when it ran out of budget.
    """

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    lengths: jax.Array
    stopped: jax.Array


class Sampler:
    """Batched autoregressive sampler over ``(graphdef, params)`` of a ``Decoder``.

    Args:
      graphdef: from ``mempo_jax.model.forward.split_model``.
      model_cfg: the model's ``ModelConfig`` (cache shapes).
      stop_ids: ids that end a row (EOS, end-of-turn, single-token closing tags); the stop id
        itself is emitted and masked in.
      pad_id: id written after a row stopped.
      mesh: the device mesh (default ``sharding.local_mesh()``: one device is the smallest mesh).
        The program declares its shardings: params by their logical-axis rules, prompts ``[B, P]`` and outputs ``[B, N]`` / ``[B]`` over the
        ``batch`` rule, key and scalars replicated, and the KV cache is constrained to
        ``cache_shardings`` (rows over data × fsdp, kv heads over tensor when they divide).
        Inputs are put on those shardings before the call.
      rules: logical → mesh axis rules.
      stop_automaton: optional ``mempo_jax.text.stop_strings.StopAutomaton`` over the model's
        ``vocab_size`` ids: a row also stops at the first token that completes one of its stop
        strings in the decoded output (a closing tag written as several tokens, or ending inside
        a token such as ``>\\n``). Each row carries an automaton state (0 at its first generated
        token, advanced by the prefill's token too); the ``[S, V]`` tables are arguments of the
        program (not constants), so samplers with equal table shapes share one compilation.
        ``None`` (default): the program is exactly the one without the option.

    Compiles once per (B, P, N, greedy, top_p < 1) (``program``); temperature and top_p values are
    traced. The jitted program is shared by every ``Sampler`` with equal (graphdef, model_cfg, stop_ids,
    pad_id, mesh, rules, automaton table shape), so building samplers per rollout call costs no
    recompilation.

    Raises:
      ValueError: if ``stop_automaton`` covers another number of ids than ``model_cfg.vocab_size``.
    """

    def __init__(self, graphdef: nnx.GraphDef, model_cfg: ModelConfig, stop_ids: Sequence[int], pad_id: int,
                 *, mesh=None, rules=DEFAULT_RULES, stop_automaton=None):
        self.graphdef = graphdef
        self.model_cfg = model_cfg
        self.stop_ids = tuple(sorted({int(i) for i in stop_ids}))
        self.pad_id = int(pad_id)
        self.mesh, self.rules = mesh_or_local(mesh), tuple(rules)
        self.stop_automaton = stop_automaton
        self._tables = None
        if stop_automaton is not None:
            if stop_automaton.vocab_size != model_cfg.vocab_size:
                raise ValueError(f"stop_automaton covers {stop_automaton.vocab_size} ids but the model has "
                                 f"{model_cfg.vocab_size} embedding rows")
            tables = (np.asarray(stop_automaton.next_state, np.int32), np.asarray(stop_automaton.completes, bool))
            self._tables = jax.device_put(tables, replicated(self.mesh))
        self._fsm_shape = None if stop_automaton is None else tuple(stop_automaton.next_state.shape)
        self.param_shardings = param_shardings(split_model(abstract_model(model_cfg))[1], self.mesh, self.rules)

    def slot_sampler(self):
        """The ``mempo_jax.agent.slot_sampler.SlotSampler`` of the same model, stops, padding, stop
        automaton and mesh (built once per ``Sampler``): the cached rollout engine's device half."""
        if getattr(self, "_slot_sampler", None) is None:
            from mempo_jax.agent.slot_sampler import SlotSampler

            self._slot_sampler = SlotSampler(self.graphdef, self.model_cfg, self.stop_ids, self.pad_id,
                                             stop_automaton=self.stop_automaton, mesh=self.mesh, rules=self.rules)
        return self._slot_sampler

    def __call__(
        self,
        params: nnx.State,
        prompt_ids: jax.Array,
        prompt_mask: jax.Array,
        key: jax.Array,
        cfg: SamplerConfig,
    ) -> SampleOutput:
        """Generate up to ``cfg.max_new_tokens`` tokens per row.

        Args:
          params: model parameters (any sharding; jit propagates it).
          prompt_ids: ``[B, P]`` int32, left-padded to the caller's bucket P (right or inner
            padding also works: the first token is predicted from each row's last real token).
          prompt_mask: ``[B, P]`` bool, True on real prompt tokens; every row needs at least one.
          key: a PRNG key; step i of row b uses ``fold_in(fold_in(key, i), b)``.
          cfg: static options.

        Returns:
          ``SampleOutput`` with ``[B, N]`` arrays, ``N = cfg.max_new_tokens``.

        Raises:
          ValueError: if ``prompt_ids`` and ``prompt_mask`` shapes differ or are not 2-D.
        """
        if prompt_ids.ndim != 2 or prompt_ids.shape != prompt_mask.shape:
            raise ValueError(f"prompt_ids {prompt_ids.shape} and prompt_mask {prompt_mask.shape} must be equal [B, P]")
        temperature = 1.0 if cfg.greedy else cfg.temperature
        b, p = prompt_ids.shape
        generate = self.program(b, p, cfg)
        rows = logical_to_sharding(("batch", None), self.mesh, self.rules, (b, p))
        rep = replicated(self.mesh)
        params = weight_sync(params, self.param_shardings)
        ids, mask = jax.device_put((_as(prompt_ids, np.int32), _as(prompt_mask, np.bool_)), rows)
        key, temp, top_p = jax.device_put((key, np.float32(temperature), np.float32(cfg.top_p)), rep)
        extra = () if self._tables is None else (self._tables,)
        return generate(params, ids, mask, key, temp, top_p, *extra)

    def program(self, batch: int, prompt_len: int, cfg: SamplerConfig):
        """The jitted program of a ``[batch, prompt_len]`` call with ``cfg`` (shared by every equal
        sampler; ``_compiled_generate``)."""
        return _compiled_generate(self.graphdef, self.model_cfg, self.stop_ids, self.pad_id, self.mesh, self.rules,
                                  (batch, prompt_len, cfg.max_new_tokens, cfg.greedy, cfg.top_p < 1.0),
                                  fsm_shape=self._fsm_shape)


# ----------------------------------------------------------------------------------- internals


def _cache_size(prompt_len: int, max_new_tokens: int) -> int:
    """Positions of a slot of the generate program: ``prompt_len + max_new_tokens`` rounded up to a
    multiple of the attention's key block (``attention.BLOCK_K``) when longer than one block."""
    size = prompt_len + max_new_tokens
    return size if size <= BLOCK_K else -(-size // BLOCK_K) * BLOCK_K


def _as(x, dtype):
    """``x`` in ``dtype``: a ``jax.Array`` stays one (it may span processes), anything else numpy."""
    return x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x, dtype)


@functools.lru_cache(maxsize=32)
def _compiled_generate(graphdef, model_cfg, stop_ids, pad_id, mesh, rules, static, fsm_shape=None):
    """The jitted generate program on ``mesh``, built for one ``static = (B, P, N, greedy,
    use_top_p)`` (bound here: jit takes no keyword arguments with in_shardings); it declares in/out
    shardings and constrains the KV cache. With ``fsm_shape`` (the ``[S, V]`` stop-automaton
    tables) it takes the tables as a last argument ``(next_state, completes)``."""
    impl = functools.partial(_generate_impl, graphdef, model_cfg, stop_ids, pad_id)
    if fsm_shape is not None:
        impl = functools.partial(_generate_with_automaton, impl)
    b, p, n, greedy, use_top_p = static
    impl = functools.partial(impl, max_new_tokens=n, greedy=greedy, use_top_p=use_top_p,
                             cache_sharding=cache_shardings(model_cfg, b, _cache_size(p, n), mesh, rules))
    params = param_shardings(split_model(abstract_model(model_cfg))[1], mesh, rules)
    ids = logical_to_sharding(("batch", None), mesh, rules, (b, p))
    rows = logical_to_sharding(("batch",), mesh, rules, (b,))
    rep = replicated(mesh)
    in_shardings = (params, ids, ids, rep, rep, rep) + (() if fsm_shape is None else ((rep, rep),))
    return jax.jit(impl, in_shardings=in_shardings, out_shardings=SampleOutput(ids, ids, ids, rows, rows))


def _generate_with_automaton(impl, params, prompt_ids, prompt_mask, key, temperature, top_p, tables, *,
                             max_new_tokens, greedy, use_top_p, cache_sharding=None):
    """``_generate_impl`` with the stop automaton's tables as one positional argument."""
    return impl(params, prompt_ids, prompt_mask, key, temperature, top_p, max_new_tokens=max_new_tokens,
                greedy=greedy, use_top_p=use_top_p, cache_sharding=cache_sharding, fsm_tables=tables)


def _pick(logits, step, key, temperature, top_p, greedy, use_top_p):
    """``[B, V]`` logits → (token ``[B]`` int32, its log-prob ``[B]`` float32); row b of step i
    draws with ``fold_in(fold_in(key, i), b)`` (``decoding.pick``)."""
    step_key = jax.random.fold_in(key, step)
    row_keys = jax.vmap(lambda b: jax.random.fold_in(step_key, b))(jnp.arange(logits.shape[0]))
    return pick(logits, row_keys, temperature, top_p, greedy, use_top_p)


def _generate_impl(graphdef, model_cfg, stop_ids, pad_id, params, prompt_ids, prompt_mask, key, temperature,
                   top_p, *, max_new_tokens, greedy, use_top_p, cache_sharding=None, fsm_tables=None):
    model = nnx.merge(graphdef, params)
    b, p = prompt_ids.shape
    n = max_new_tokens
    plen = jnp.sum(prompt_mask, axis=-1).astype(jnp.int32)

    # Prefill: row b is cache slot b; its real prompt tokens at positions [0, plen) (padding not written).
    cache = init_cache(model_cfg, b, _cache_size(p, n))
    if cache_sharding is not None:
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding)
    last = jnp.max(jnp.where(prompt_mask, jnp.arange(p)[None], 0), axis=-1)
    # LM head on each row's last prompt token only (not a [B, P, vocab] tensor).
    logits, cache = model(prompt_ids, positions_from_mask(prompt_mask), cache=cache, write=prompt_mask,
                          kv_bound=jnp.max(plen), logits_at=last)
    last_logits = logits[:, 0]

    pick = functools.partial(_pick, key=key, temperature=temperature, top_p=top_p, greedy=greedy,
                             use_top_p=use_top_p)
    tok0, lp0 = pick(last_logits, 0)
    tokens = jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(tok0)
    logps = jnp.zeros((b, n), jnp.float32).at[:, 0].set(lp0)
    valid = jnp.zeros((b, n), bool).at[:, 0].set(True)
    done = _is_stop(tok0, stop_ids)
    if fsm_tables is not None:  # stop strings: per-row automaton state, advanced by every token
        next_state, completes = fsm_tables
        fsm0 = jnp.zeros((b,), jnp.int32)
        done = done | completes[fsm0, tok0]
        fsm0 = next_state[fsm0, tok0]

    def cond(state):
        i, done = state[0], state[4]
        return (i < n) & ~jnp.all(done)

    def body(state):
        # Feed token i-1 (position plen+i-1), sample token i.
        i, tokens, logps, valid, done, cache = state[:6]
        prev = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)  # [B, 1]
        logits, cache = model(prev, (plen + i - 1)[:, None], cache=cache, kv_bound=jnp.max(plen) + i)
        tok, lp = pick(logits[:, 0], i)
        active = ~done
        tok = jnp.where(active, tok, pad_id)
        lp = jnp.where(active, lp, 0.0)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, tok[:, None], i, axis=1)
        logps = jax.lax.dynamic_update_slice_in_dim(logps, lp[:, None], i, axis=1)
        valid = jax.lax.dynamic_update_slice_in_dim(valid, active[:, None], i, axis=1)
        if fsm_tables is None:
            done = done | (active & _is_stop(tok, stop_ids))
            return i + 1, tokens, logps, valid, done, cache
        fsm = state[6]
        done = done | (active & (_is_stop(tok, stop_ids) | completes[fsm, tok]))
        return i + 1, tokens, logps, valid, done, cache, next_state[fsm, tok]

    state = (jnp.int32(1), tokens, logps, valid, done, cache)
    if fsm_tables is not None:
        state = state + (fsm0,)
    _, tokens, logps, valid, done = jax.lax.while_loop(cond, body, state)[:5]
    return SampleOutput(tokens, logps, valid, jnp.sum(valid, axis=-1).astype(jnp.int32), done)
