"""The multi-turn reference the engine is tested against: every turn, every unfinished context
re-prefilled from scratch by a one-shot ``sample_fn`` (no cache kept across turns, no refill).

``ReferenceEngine(sample_fn)`` is a ``rollout.Engine``: ``sample_fn(params, ids [B, P] left-padded,
mask [B, P], key, max_new_tokens, temperature, top_p) -> SampleOutput`` (a ``RolloutEngine`` itself,
or a scripted fake). Turn ``t`` samples with ``fold_in(key, t)``, trajectory i as row i.
"""

from __future__ import annotations

import jax

from mempo_jax.agent.turns import apply_tools, close_episodes, make_turn
from mempo_jax.core.batching import bucket_length, pad_sequences

MIN_PROMPT_BUCKET = 128  # smallest prompt-length bucket (tokens)


class ReferenceEngine:
    """Re-prefill-every-turn multi-turn rollout over a one-shot ``sample_fn``."""

    def __init__(self, sample_fn):
        self.sample_fn = sample_fn

    def place(self, params):
        return params

    def warm(self, params, cfg, num_trajectories, key) -> int:
        return 0

    def rollout(self, params, trajs, fmt, tool_env, cfg, key, progress=None, traj_offset=0):
        for t in range(cfg.max_turns):
            runnable, contexts = [], []
            for tr in (tr for tr in trajs if not tr.done):
                ctx = tr.policy_context(cfg.context_steps)
                if len(ctx) + cfg.max_new_tokens > cfg.max_context_tokens:
                    tr.done, tr.end_reason = True, "budget"
                    continue
                runnable.append(tr)
                contexts.append(ctx)
            if not runnable:
                break
            if progress is not None:
                progress(t, len(runnable))
            rows = bucket_length(len(contexts), cfg.min_rows_bucket)
            length = bucket_length(max(len(c) for c in contexts), MIN_PROMPT_BUCKET)
            ids, mask = pad_sequences(contexts + [contexts[0][:1]] * (rows - len(contexts)), fmt.tokenizer.pad_id,
                                      length, side="left")
            out = self.sample_fn(params, ids, mask, jax.random.fold_in(key, t), cfg.max_new_tokens, cfg.temperature,
                                 cfg.top_p)
            tokens, logprobs, lengths, stopped = jax.device_get((out.tokens, out.logprobs, out.lengths, out.stopped))
            turns = []
            for i, ctx in enumerate(contexts):
                turn = make_turn(fmt, tokens[i, : int(lengths[i])], logprobs[i, : int(lengths[i])], bool(stopped[i]))
                turn.context_len = len(ctx)
                turns.append(turn)
            apply_tools(fmt, tool_env, runnable, turns, cfg)
        return close_episodes(trajs)
