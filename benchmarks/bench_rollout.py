"""Section 7: multi-turn rollout — the engine vs generate-per-turn loops (transformers, tunix).

The same episodes three ways, greedy, float32, the same host tools (BM25 over the pooled HotpotQA
paragraphs): 64 trajectories (16 held-out HotpotQA dev questions x 4) of at most ``--turns`` turns
on SmolLM2-135M-Instruct (text tags, its ChatML template and the short search prompt of
``configs/smollm2_hotpotqa.gin``), in ``full`` and k = 1 context mode:

* (a) ``cached`` — the rollout engine (``mempo_jax/agent/engine.py``): KV cache kept across turns,
  stopped rows refilled, attention over live cache blocks;
* (b) ``transformers`` — ``generate(do_sample=False)`` once per turn on the whole left-padded
  contexts with the closing action tags as ``stop_strings`` and the same ``apply_tools`` (the
  Search-R1-style agent loop), each row cut at its first stop as ours;
* (c) ``tunix`` — google-tunix's ``Sampler`` (JAX; its ``Llama3`` with the same weights, read from
  the same transformers folder) in the same loop (``turn_loop``): re-prefilled every turn, greedy;
  it has no stop strings, so rows run to EOS or ``max_new_tokens`` and are cut as (b)'s. Its
  attention's RoPE is bound to the model's ``rope_theta`` (``common.tunix_same_weights``).

Per engine: generated tokens/s, trajectories/s, the fraction of computed token positions that
were useful (useful = every distinct token of the finished records — prompt, turns, tool results
— processed once; computed = prefill rows x length + decode steps x rows, padding included; above
1 when an engine computes a group's shared prompt once, as the cached engine does), the share of
trajectories identical to (b)'s and to (c)'s, and the ratios to (b) and (c). JAX compile seconds
(backend compiles seen by the ``CompileCounter``, tunix's included) are reported and subtracted
(``*_steady``); transformers compiles nothing. Seconds inside each engine's device programs
(``device_s``: the cached engine's ``extend`` / ``decode``, the peers' whole generate call) and the
rest (``host_s``: prompts, cuts, tools) are printed per run. Then decode at batch 64 (prompt 128,
128 new tokens, no stops): the engine's slot decode and ``generate``.

``--processes N`` (N > 1) then runs the cached engine again as N processes of ``--local_devices``
emulated CPU devices each (``jax.distributed`` on a loopback port), as the trainer does on a pod:
the parameters laid out over all N x local devices (``fsdp``), synced once to each process's own
rollout mesh (``core.rollout_mesh``; ``timing/weight_sync_s``, first and warm call), then each
process rolls out its share of the questions with no cross-process collective; per process and
together: tokens/s (compile subtracted; together = all tokens / the slowest process), and the share
of trajectories equal to the one-process run.

Run: ``python benchmarks/bench_rollout.py [--json out.json] [--small] [--engines cached,transformers,tunix] [--processes 2]``
(``--small``: the toy world of ``tests/toy_agent.py`` and a 1-layer random model exported to
transformers; seconds). Requirements beyond the project's: (b) torch and transformers
(``requirements-test.txt``); (c) ``pip install --no-deps google-tunix==0.1.7 jaxtyping`` (its
sampler and Llama3 need jaxtyping and pillow beside the project's dependencies;
``tunix/__init__.py``, which needs the trainers' extras, is not run). An engine whose packages do
not import is skipped with a printed reason.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from typing import Protocol, Sequence

from common import (REPO, CompileCounter, alternate, free_port, have_transformers, median, parser, setup_platform,
                    shared_data, table, tunix_same_weights, write_json)

GIN = REPO / "configs" / "smollm2_hotpotqa.gin"


def setup_smollm2(checkpoint=None):
    """SmolLM2 on HotpotQA as ``configs/smollm2_hotpotqa.gin`` builds it: ``(fmt, tool_env,
    held-out questions, model_cfg, graphdef, params, engine, checkpoint folder)``."""
    from mempo_jax.config_loader import load_config
    from mempo_jax.run.experiment import load_checkpoint_policy, load_questions, policy_format
    from mempo_jax.run.experiment import make_engine
    from mempo_jax.model import smollm2
    from mempo_jax.tools.search import search_environment

    folder = str(checkpoint or smollm2.convert())
    cwd = os.getcwd()
    os.chdir(REPO)  # the gin file's data paths are relative to the repository
    try:
        hotpotqa = shared_data() / "hotpotqa" / "hotpotqa_dev_distractor_300.rpt.jsonl"  # the recipe's file
        cfg = load_config([str(GIN)], [f"ModelOptions.checkpoint = '{folder}'",
                                       f"ModelOptions.system_prompt_path = '{REPO / 'configs/prompts/mempo_search_short.txt'}'",
                                       f"ExperimentConfig.train_path = '{hotpotqa}'"])
        _, held, _, _, backend, _ = load_questions(cfg)
    finally:
        os.chdir(cwd)
    model_cfg, graphdef, params, tokenizer = load_checkpoint_policy(cfg.model)
    fmt = policy_format(cfg.model, tokenizer)
    return fmt, search_environment(backend, topk=cfg.topk), held, model_cfg, graphdef, params, \
        make_engine(graphdef, model_cfg, fmt), folder


def setup_small():
    """The toy world (single-id tags) and a 1-layer random model: same tuple as ``setup_smollm2``
    with ``folder = None`` (transformers gets the weights by ``save_hf_checkpoint``)."""
    sys.path.insert(0, str(REPO / "tests"))
    from toy_agent import toy_model, toy_world

    from mempo_jax.agent.format import AgentFormat
    from mempo_jax.run.experiment import make_engine

    tok, env, questions = toy_world()
    model_cfg, graphdef, params = toy_model(tok.vocab_size, seed=3)
    fmt = AgentFormat.plain(tok)
    return fmt, env, questions, model_cfg, graphdef, params, make_engine(graphdef, model_cfg, fmt), None


# ------------------------------------------------------------------------------- instrumentation


class Positions:
    """Counts computed token positions (padding included) of each engine's device calls."""

    def __init__(self):
        self.computed = 0
        self.device_s = {}  # seconds in each device program (blocked until ready), compiles included

    def patch_cached(self):
        """Count ``SlotSampler.extend`` (rows x length) and ``decode`` (steps run x slots)."""
        import jax
        import numpy as np

        from mempo_jax.agent.slot_sampler import SlotSampler

        ext, dec = SlotSampler.extend, SlotSampler.decode
        me = self

        def extend(self, params, state, rows, ids, *a, **k):
            me.computed += int(np.shape(ids)[0] * np.shape(ids)[1])
            t0 = time.perf_counter()
            out = jax.block_until_ready(ext(self, params, state, rows, ids, *a, **k))
            me.device_s["extend"] = me.device_s.get("extend", 0.0) + time.perf_counter() - t0
            return out

        def decode(self, params, state, steps, *a, **k):
            before, active = jax.device_get((state.gen, state.active))
            t0 = time.perf_counter()
            out = dec(self, params, state, steps, *a, **k)
            after = np.asarray(jax.device_get(out.gen))
            me.device_s["decode"] = me.device_s.get("decode", 0.0) + time.perf_counter() - t0
            ran = int(np.max(np.where(active, after - before, 0), initial=0))
            rows = k.get("rows")  # decode on a row bucket of the generating slots (engine.decode_rows)
            me.computed += ran * int(np.shape(before)[0] if rows is None else np.shape(rows)[0])
            return out

        SlotSampler.extend, SlotSampler.decode = extend, decode
        return lambda: setattr(SlotSampler, "extend", ext) or setattr(SlotSampler, "decode", dec)


def useful_positions(trajs) -> int:
    """Every distinct token of the finished records once: prompt + each turn's ids + tool results."""
    return sum(len(tr.prompt_ids) + sum(len(t.output_ids) + len(t.observation_ids) for t in tr.turns)
               for tr in trajs)


# --------------------------------------------------------------------- generate-per-turn peers


class Generate(Protocol):
    """One turn of a generate-per-turn engine: the whole contexts in, one row per context out."""

    def __call__(self, contexts: list[list[int]]) -> tuple[list[Sequence[int]], int]:
        """``(rows, computed)``: each row holds the generated ids at least up to its first stop
        (``fmt.codec.first_stop``) or ``max_new_tokens`` ids; ``computed`` is the token positions
        the call ran (padding included)."""


def turn_loop(generate: Generate, trajs, fmt, tool_env, cfg, counter: Positions, program: str):
    """``rollout.rollout`` with ``generate`` once per turn on the whole contexts; each row is cut
    at ``fmt.codec.first_stop`` (the sampler's stop rule) and the same ``apply_tools`` runs.
    ``generate``'s seconds add to ``counter.device_s[program]``, its positions to ``computed``."""
    from mempo_jax.agent.turns import apply_tools, close_episodes, make_turn

    for _ in range(cfg.max_turns):
        runnable, contexts = [], []
        for tr in trajs:
            if tr.done:
                continue
            ctx = tr.policy_context(cfg.context_steps)
            if len(ctx) + cfg.max_new_tokens > cfg.max_context_tokens:
                tr.done, tr.end_reason = True, "budget"
                continue
            runnable.append(tr), contexts.append(list(ctx))
        if not runnable:
            break
        t0 = time.perf_counter()
        rows, computed = generate(contexts)
        counter.device_s[program] = counter.device_s.get(program, 0.0) + time.perf_counter() - t0
        counter.computed += computed
        turns = []
        for tr, ctx, row in zip(runnable, contexts, rows):
            cut = fmt.codec.first_stop(list(row))
            turn = make_turn(fmt, row[: cut or len(row)], None, cut is not None)
            turn.context_len = len(ctx)
            turns.append(turn)
        apply_tools(fmt, tool_env, runnable, turns, cfg)
    return close_episodes(trajs)


def hf_generate(model, hf_tokenizer, fmt, cfg) -> Generate:
    """transformers ``generate(do_sample=False)`` on the left-padded contexts, stop ids as
    ``eos_token_id`` and, in text mode, the closing tags as ``stop_strings``."""
    import numpy as np
    import torch

    from mempo_jax.text.protocol import STOP_TAGS

    pad = fmt.tokenizer.pad_id
    kw = {"stop_strings": list(STOP_TAGS), "tokenizer": hf_tokenizer} if fmt.codec.mode == "text" else {}

    def generate(contexts):
        length = max(len(c) for c in contexts)
        ids = np.full((len(contexts), length), pad, np.int64)
        mask = np.zeros((len(contexts), length), np.int64)
        for i, c in enumerate(contexts):
            ids[i, length - len(c):], mask[i, length - len(c):] = c, 1
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                                 max_new_tokens=cfg.max_new_tokens, eos_token_id=list(fmt.codec.stop_ids),
                                 pad_token_id=pad, use_cache=True, **kw)
        gen = out[:, length:].numpy()
        return list(gen), len(contexts) * (length + gen.shape[1] - 1)

    return generate


class IdTokenizer:
    """tunix's tokenizer protocol over token ids: ``encode`` passes a context's ids through,
    ``decode`` returns ``""`` (the loop reads ids), no BOS is added."""

    def __init__(self, eos: int, pad: int):
        self.eos, self.pad = eos, pad

    def encode(self, ids, **kw) -> list[int]:
        return list(ids)

    def decode(self, ids, **kw) -> str:
        return ""

    def bos_id(self) -> None:
        return None

    def eos_id(self) -> int:
        return self.eos

    def pad_id(self) -> int:
        return self.pad


def tunix_generate(model, sampler_lib, fmt, cfg, pad: int) -> Generate:
    """tunix's ``Sampler.__call__`` greedy (temperature 0) on the contexts; its KV cache holds
    ``max_context_tokens + max_new_tokens`` positions; prompts are left-padded to its power-of-2
    bucket. tunix stops a row at its ``eos_tokens`` only (no stop strings) and drops that token:
    ``eos_tokens`` is the tokenizer's EOS alone, appended back to rows shorter than
    ``max_new_tokens``; other stops (closing tags, other stop ids) are found by the loop's cut.
    tunix masks every position whose id is ``pad`` (prompt and generated).

    Raises:
      ValueError: a context holds ``pad``.
    """
    import numpy as np

    eos = fmt.tokenizer.eos_id
    sampler = sampler_lib.Sampler(model, IdTokenizer(eos, pad), sampler_lib.CacheConfig(
        cache_size=cfg.max_context_tokens + cfg.max_new_tokens, num_layers=model.config.num_layers,
        num_kv_heads=model.config.num_kv_heads, head_dim=model.config.head_dim))

    def generate(contexts):
        if any(pad in c for c in contexts):
            raise ValueError(f"a context holds the tunix pad id {pad}; tunix would mask it")
        out = sampler(contexts, max_generation_steps=cfg.max_new_tokens, eos_tokens=[eos], temperature=0.0)
        rows = [np.append(t, eos) if len(t) < cfg.max_new_tokens else np.asarray(t) for t in out.tokens]
        bucket = out.padded_prompt_tokens.shape[1]
        return rows, len(contexts) * (bucket + max(len(r) for r in rows) - 1)

    return generate


def unused_id(fmt, contexts) -> int:
    """The smallest id in none of ``contexts`` and not a stop id (tunix's pad)."""
    seen = set(fmt.codec.stop_ids).union(*map(set, contexts))
    return next(i for i in range(len(seen) + 1) if i not in seen)


# ------------------------------------------------------------------------------------------ main


def generated_tokens(trajs) -> int:
    """Tokens the policy generated over every turn of ``trajs``."""
    return sum(len(t.output_ids) for tr in trajs for t in tr.turns)


def traj_key(tr) -> list:
    """A trajectory's ids turn by turn, ``[[output ids, tool-result ids], ...]`` (JSON-ready)."""
    return [[list(map(int, t.output_ids)), list(map(int, t.observation_ids))] for t in tr.turns]


def _same(a, b) -> float:
    """Share of trajectories with the same ids turn by turn (outputs and tool results); ``a`` and
    ``b`` hold trajectories or their ``traj_key``s."""
    def key(tr):
        return tr if isinstance(tr, list) else traj_key(tr)

    return sum(key(x) == key(y) for x, y in zip(a, b)) / max(len(a), 1)


def rollout_config(args):
    """The benchmark's ``RolloutConfig`` (greedy; ``--small``: the toy world's sizes)."""
    from mempo_jax.agent.rollout import RolloutConfig

    small = args.small
    return RolloutConfig(max_turns=args.turns or 4, max_new_tokens=args.new or (10 if small else 64),
                         max_context_tokens=128 if small else 1024, max_observation_tokens=8 if small else 64,
                         temperature=0.0, min_rows_bucket=args.rows_bucket or (4 if small else 64),
                         decode_chunk=args.decode_chunk or (4 if small else 16), prefill_chunk=32)


def bench_questions(args, questions) -> list:
    """The first ``--questions`` held-out questions (default 16; ``--small`` 4), cycled if fewer."""
    n_q = args.questions or (4 if args.small else 16)
    return [questions[i % len(questions)] for i in range(n_q)]


def child_main(args) -> dict:
    """One process of ``--processes``: the cached engine on this process's own devices.

    The parameters are laid out over every device of every process (``fsdp``), synced to this
    process's rollout mesh twice (the first call compiles the all-gather), then this process rolls
    out its ``process_slice`` of the questions (trajectory keys offset as in the trainer). Writes
    ``{"process", "rollout_mesh", "modes": {mode: {wall_s, compile_s, generated_tokens,
    weight_sync_s: [first, warm], trajectories: [traj_key]}}}`` to ``args.child``.
    """
    from mempo_jax.core.distributed import maybe_initialize, process_slice

    maybe_initialize()  # before anything touches a device
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from mempo_jax.agent.rollout import new_trajectories
    from mempo_jax.agent.trajectory import parse_context_steps
    from mempo_jax.core import sharding
    from mempo_jax.core.rollout_mesh import rollout_mesh
    from mempo_jax.run.experiment import make_engine

    counter = CompileCounter()
    fmt, env, questions, model_cfg, graphdef, params, _, _ = setup_small() if args.small else setup_smollm2()
    questions = bench_questions(args, questions)
    mesh = sharding.make_mesh(1, jax.device_count(), 1)
    # from host copies: every process holds the same values, placed into the global fsdp layout
    params = sharding.shard_params(jax.tree.map(np.asarray, params), mesh)
    engine = make_engine(graphdef, model_cfg, fmt, mesh=rollout_mesh(mesh, model_cfg.num_heads, model_cfg.num_kv_heads))
    mine = process_slice(len(questions))
    out = {"process": jax.process_index(), "rollout_mesh": dict(engine.mesh.shape), "modes": {}}
    base = rollout_config(args)
    for mode in args.modes.split(","):
        trajs = new_trajectories(fmt, questions[mine], args.group)
        cfg = dataclasses.replace(base, context_steps=parse_context_steps(mode),  # slots for this process's share
                                  min_rows_bucket=min(base.min_rows_bucket, len(trajs)))
        syncs = []
        for _ in range(2):
            t0 = time.perf_counter()
            local = jax.block_until_ready(engine.place(params))
            syncs.append(time.perf_counter() - t0)
        multihost_utils.sync_global_devices(f"bench_rollout {mode}")  # every process starts its rollout together
        mark = counter.count
        t0 = time.perf_counter()
        engine.rollout(local, trajs, fmt, env, cfg, jax.random.PRNGKey(0), traj_offset=mine.start * args.group)
        wall = time.perf_counter() - t0
        gen = generated_tokens(trajs)
        out["modes"][mode] = {"wall_s": wall, "compile_s": counter.seconds_since(mark),
                              "generated_tokens": gen, "weight_sync_s": syncs,
                              "trajectories": [traj_key(tr) for tr in trajs]}
        print(f"[bench_rollout] process {out['process']} {mode}: {len(trajs)} trajectories, {gen} tokens in {wall:.1f} s "
              f"on {out['rollout_mesh']}; weight sync {syncs[0]:.2f} s first, {syncs[1]:.2f} s warm", flush=True)
    multihost_utils.sync_global_devices("bench_rollout done")
    import resource

    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    with open(args.child, "w") as f:
        json.dump(out, f)
    return out


def multiprocess_runs(args) -> list[dict]:
    """``--processes`` children of this script (``child_main``), run at once; their JSON documents
    in process order."""
    n, port = args.processes, free_port()
    flags = ["--group", str(args.group), "--modes", args.modes] + (["--small"] if args.small else [])
    for name in ("turns", "new", "questions", "rows_bucket", "decode_chunk"):
        if getattr(args, name) is not None:
            flags += [f"--{name}", str(getattr(args, name))]
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"process{i}.json") for i in range(n)]
        xla = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.local_devices}".strip()
        procs = [subprocess.Popen([sys.executable, __file__, *flags, "--child", outs[i]],
                                  env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla,
                                           MEMPO_COORDINATOR=f"127.0.0.1:{port}", MEMPO_NUM_PROCESSES=str(n),
                                           MEMPO_PROCESS_ID=str(i)))
                 for i in range(n)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"[bench_rollout] --processes {n}: a process exited with {codes}")
        results = []
        for path in outs:
            with open(path) as f:
                results.append(json.load(f))
    return results


def multiprocess_rows(args, results: list[dict], trajs_by_mode: dict) -> list:
    """One row per mode of ``multiprocess_runs``: all processes' tokens over the slowest one's
    steady seconds, weight-sync seconds (the slowest process's first and warm call), each
    process's peak RSS, and the share of trajectories equal to the one-process cached run
    (``trajs_by_mode[mode]``, when it ran)."""
    n = args.processes
    rows = []
    for mode in args.modes.split(","):
        per = [r["modes"][mode] for r in results]
        gen = sum(p["generated_tokens"] for p in per)
        steady = max(max(p["wall_s"] - p["compile_s"] for p in per), 1e-9)
        trajs = [t for p in per for t in p["trajectories"]]
        row = {"mode": mode, "engine": f"cached, {n} processes x {args.local_devices} devices", "processes": n,
               "rollout_mesh": results[0]["rollout_mesh"], "generated_tokens": gen, "trajectories": len(trajs),
               "wall_s": max(p["wall_s"] for p in per), "compile_s": max(p["compile_s"] for p in per),
               "tok_s_steady": gen / steady, "traj_s_steady": len(trajs) / steady,
               "per_process_tok_s_steady": [p["generated_tokens"] / max(p["wall_s"] - p["compile_s"], 1e-9) for p in per],
               "weight_sync_s": max(p["weight_sync_s"][0] for p in per),
               "weight_sync_warm_s": max(p["weight_sync_s"][1] for p in per),
               "peak_rss_gib": [r["peak_rss_gib"] for r in results]}
        if mode in trajs_by_mode:
            row["same_as_one_process"] = _same(trajs, trajs_by_mode[mode])
        rows.append(row)
    print(table(f"Cached engine on {n} processes x {args.local_devices} emulated CPU devices (rollout on each "
                f"process's own devices; tokens/s with compile subtracted)",
                ["mode", "rollout mesh", "tok/s", "per process tok/s", "weight sync s (first / warm)",
                 "same as 1 process", "compile s", "peak RSS GiB per process"],
                [[r["mode"], " x ".join(f"{k} {v}" for k, v in r["rollout_mesh"].items()), r["tok_s_steady"],
                  " / ".join(f"{x:.1f}" for x in r["per_process_tok_s_steady"]),
                  f"{r['weight_sync_s']:.2f} / {r['weight_sync_warm_s']:.2f}", r.get("same_as_one_process", "-"),
                  r["compile_s"], " / ".join(f"{x:.1f}" for x in r["peak_rss_gib"])] for r in rows]))
    return rows


def main(argv=None) -> dict:
    """Run the rollout and decode comparisons; print the tables; return (and write) the JSON."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=None, help="max turns (default 4)")
    p.add_argument("--new", type=int, default=None, help="max new tokens per turn (default 64)")
    p.add_argument("--questions", type=int, default=None, help="questions (default 16; x --group trajectories)")
    p.add_argument("--group", type=int, default=4, help="trajectories per question")
    p.add_argument("--modes", default="full,1", help="context modes")
    p.add_argument("--engines", default="cached,transformers")
    p.add_argument("--no_decode", action="store_true", help="skip the batch-64 decode table")
    p.add_argument("--decode_only", action="store_true", help="only the batch-64 decode table")
    p.add_argument("--decode_new", type=int, default=None, help="decode table: new tokens (default 128)")
    p.add_argument("--decode_prompt", type=int, default=None, help="decode table: prompt tokens (default 128)")
    p.add_argument("--rows_bucket", type=int, default=None,
                   help="RolloutConfig.min_rows_bucket (default 64: today's default; the SmolLM2 recipe binds 16)")
    p.add_argument("--profile", type=int, default=0,
                   help="print cProfile's top N functions by own time per engine run (slows Python code)")
    p.add_argument("--decode_chunk", type=int, default=None,
                   help="RolloutConfig.decode_chunk of the cached engine (default 16; small: 4)")
    p.add_argument("--processes", type=int, default=1,
                   help="also run the cached engine as this many processes (jax.distributed on loopback), each on "
                        "its own --local_devices emulated CPU devices")
    p.add_argument("--local_devices", type=int, default=4, help="emulated CPU devices per process of --processes")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one process of --processes: its JSON path
    args = p.parse_args(argv)
    setup_platform(args.device)
    if args.child is not None:
        return child_main(args)
    import jax
    import numpy as np

    from mempo_jax.agent.rollout import new_trajectories
    from mempo_jax.agent.trajectory import parse_context_steps

    small = args.small
    # the processes run first, while this one holds no model (each child loads its own copy)
    multi_runs = multiprocess_runs(args) if args.processes > 1 and not args.decode_only else None
    counter = CompileCounter()
    fmt, env, questions, model_cfg, graphdef, params, engine_obj, folder = setup_small() if small else setup_smollm2()
    questions = bench_questions(args, questions)
    n_q = len(questions)
    engines = args.engines.split(",")
    hf = hf_tok = None
    tmp = tempfile.TemporaryDirectory()
    hf_folder = folder or tmp.name
    if folder is None:
        from mempo_jax.model.hf_io import save_hf_checkpoint

        save_hf_checkpoint(hf_folder, model_cfg, params)
    if "transformers" in engines:
        if not have_transformers():
            print("[bench_rollout] torch/transformers not installed: no transformers loop")
            engines.remove("transformers")
        else:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            hf = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
            hf_tok = None if folder is None else AutoTokenizer.from_pretrained(folder)
    base = rollout_config(args)
    peers = {}  # generate-per-turn engines: name -> (Generate, device program name)
    if hf is not None:
        peers["transformers"] = (hf_generate(hf, hf_tok, fmt, base), "generate")
    if "tunix" in engines:
        try:
            model, sampler_lib = tunix_same_weights(model_cfg, params, hf_folder)
        except (ImportError, ValueError) as e:
            print(f"[bench_rollout] no tunix sampler: {e}")
            engines.remove("tunix")
        else:
            pad = unused_id(fmt, [tr.prompt_ids for tr in new_trajectories(fmt, questions, 1)])
            peers["tunix"] = (tunix_generate(model, sampler_lib, fmt, base, pad), "sampler")
    rows, one_process = [], {}  # one_process: mode -> the cached engine's trajectories
    for mode in [] if args.decode_only else args.modes.split(","):
        cfg = dataclasses.replace(base, context_steps=parse_context_steps(mode))
        done = {}
        for engine in engines:
            trajs = new_trajectories(fmt, questions, args.group)
            pos = Positions()
            mark = counter.count
            profile = cProfile.Profile() if args.profile else None
            t0 = time.perf_counter()
            if profile:
                profile.enable()
            if engine in peers:
                generate, program = peers[engine]
                turn_loop(generate, trajs, fmt, env, cfg, pos, program)
            else:
                restore = pos.patch_cached()
                try:
                    engine_obj.rollout(params, trajs, fmt, env, cfg, jax.random.PRNGKey(0))
                finally:
                    restore()
            wall = time.perf_counter() - t0
            if profile:
                profile.disable()
                print(f"[bench_rollout] {mode} {engine}: cProfile, top {args.profile} by own time")
                pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
            compile_s = counter.seconds_since(mark)
            gen = generated_tokens(trajs)
            steady = max(wall - compile_s, 1e-9)
            done[engine] = trajs
            if engine == "cached":
                one_process[mode] = trajs
            row = {"mode": mode, "engine": engine, "wall_s": wall, "compile_s": compile_s,
                   "generated_tokens": gen, "trajectories": len(trajs),
                   "turns_mean": float(np.mean([len(tr.turns) for tr in trajs])),
                   "tok_s": gen / wall, "tok_s_steady": gen / steady, "traj_s_steady": len(trajs) / steady,
                   "useful_fraction": useful_positions(trajs) / max(pos.computed, 1), "computed_positions": pos.computed,
                   "device_s": dict(pos.device_s), "host_s": wall - sum(pos.device_s.values())}
            rows.append(row)
            split = ", ".join(f"{k} {v:.1f} s" for k, v in row["device_s"].items())
            print(f"[bench_rollout] {mode} {engine}: {gen} tokens in {wall:.1f} s (compile {compile_s:.1f} s; {split}; "
                  f"host {row['host_s']:.1f} s) -> {row['tok_s_steady']:.1f} tok/s steady, useful "
                  f"{row['useful_fraction']:.2f}", flush=True)
        by = {r["engine"]: r for r in rows if r["mode"] == mode}
        for peer in ("transformers", "tunix"):
            if peer not in done:
                continue
            for engine, row in by.items():
                row[f"same_as_{peer}"] = _same(done[engine], done[peer])
                if engine != peer:
                    row[f"speedup_vs_{peer}"] = row["tok_s_steady"] / by[peer]["tok_s_steady"]
                    print(f"[bench_rollout] {mode} {engine}: same trajectories as {peer} {row[f'same_as_{peer}']:.2f}, "
                          f"{row[f'speedup_vs_{peer}']:.2f}x its tok/s", flush=True)
    print(table("Multi-turn rollout, greedy (generated tokens/s with JAX compile time subtracted)",
                ["mode", "engine", "tok/s", "x transformers", "x tunix", "traj/s", "useful", "same as transformers",
                 "same as tunix", "compile s", "turns"],
                [[r["mode"], r["engine"], r["tok_s_steady"], r.get("speedup_vs_transformers", "-"),
                  r.get("speedup_vs_tunix", "-"), r["traj_s_steady"], r["useful_fraction"],
                  r.get("same_as_transformers", "-"), r.get("same_as_tunix", "-"), r["compile_s"], r["turns_mean"]]
                 for r in rows]))
    decode = [] if args.no_decode else decode_table(model_cfg, graphdef, params, hf, small, args)
    multi = [] if multi_runs is None else multiprocess_rows(args, multi_runs, one_process)
    results = {"rollout": rollout_summary(rows), "rows": rows, "decode": decode, "multiprocess": multi}
    tmp.cleanup()
    config = {"small": small, "min_rows_bucket": base.min_rows_bucket, "turns": base.max_turns, "max_new_tokens": base.max_new_tokens,
              "trajectories": n_q * args.group, "group": args.group, "checkpoint": folder, "dtype": "float32",
              "processes": args.processes, "local_devices": args.local_devices}
    return write_json(args.json, "rollout", config, results)


def rollout_summary(rows) -> dict:
    """Target ratios per mode: cached / transformers (>= 3) and cached / tunix (>= 2)."""
    out = {}
    for r in rows:
        if r["engine"] == "cached":
            out[r["mode"]] = {k: r[k] for k in ("speedup_vs_transformers", "speedup_vs_tunix") if k in r}
    full = out.get("full", {})
    out["targets_full"] = {"vs_transformers_ge_3": full.get("speedup_vs_transformers", 0) >= 3,
                           "vs_tunix_ge_2": full.get("speedup_vs_tunix", 0) >= 2}
    return out


def decode_table(model_cfg, graphdef, params, hf, small, args) -> list:
    """Decode at batch 64: prompt 128 (small: 16), 128 new tokens (small: 8), no stops; tokens/s =
    64 x new / wall of the whole call (prefill included): the engine's slot decode, transformers
    ``generate``."""
    import jax
    import numpy as np

    from mempo_jax.agent.slot_sampler import SlotSampler

    b, prompt, new = 64, args.decode_prompt or (16 if small else 128), args.decode_new or (8 if small else 128)
    ids = np.random.default_rng(0).integers(1, model_cfg.vocab_size, (b, prompt)).astype(np.int32)
    slots = SlotSampler(graphdef, model_cfg, (), 0)
    key = jax.random.PRNGKey(0)
    size = slots.cache_size(prompt + new)
    zeros = np.zeros((b,), np.int32)
    got = {}

    def cached():
        st = slots.init_state(b, size, new)
        st = slots.extend(params, st, np.arange(b, dtype=np.int32), ids, np.full((b,), prompt, np.int32), zeros,
                          np.ones((b,), bool), zeros, np.arange(b, dtype=np.int32), key, 1.0, 1.0, True)
        st = slots.decode(params, st, new, key, 1.0, 1.0, True)
        got["cached"] = np.asarray(jax.block_until_ready(st.tokens))

    fns = {"cached": cached}
    if hf is not None:
        import torch

        t_ids = torch.tensor(ids, dtype=torch.long)

        def theirs():
            with torch.no_grad():
                out = hf.generate(input_ids=t_ids, attention_mask=torch.ones_like(t_ids), do_sample=False,
                                  max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0)
            got["transformers"] = out[:, prompt:].numpy()

        fns["transformers"] = theirs
    times = alternate(fns, 2 if small else 1)
    row = {"batch": b, "prompt": prompt, "new_tokens": new}
    for k, v in times.items():
        row[f"{k}_tok_s"] = b * new / median(v)
    if hf is not None:
        row["cached_over_transformers"] = row["cached_tok_s"] / row["transformers_tok_s"]
        row["first_tokens_equal_transformers"] = float(np.mean(got["cached"][:, :8] == got["transformers"][:, :8]))
    print(table(f"Decode, batch {b}, prompt {prompt}, {new} new tokens (tokens/s = batch x new / wall)",
                list(row), [list(row.values())]))
    return [row]


if __name__ == "__main__":
    main(sys.argv[1:])
