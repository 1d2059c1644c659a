"""The evaluation command: a trained run on QA datasets, in every context mode (MEMPO_SPEC §6).

::

    python -m mempo_jax.evaluate --run_dir RUN_DIR [--checkpoint STEP] \\
        --dataset NAME=PATH [--dataset NAME=PATH ...] [--corpus FILE | --retriever_url URL] \\
        [--modes 1,full] [--limit N] [--temperature 0] [--topk K] [--multi_objective K] --out DIR

For every dataset and context mode the policy answers each question once (``evaluate_policy``)
and the command writes ``DIR/eval.json`` (``{dataset: {mode: {em, f1, tt, pt, turns,
format_fail, tool_calls, n}}}``), ``DIR/eval.md`` (a markdown table), ``DIR/eval.png`` (F1 and TT
per dataset and mode), ``DIR/predictions.jsonl`` (one line per question and mode) and
``DIR/eval_meta.json`` (run folder, step, corpus of each dataset, rollout options).

Retrieval (MEMPO_SPEC §7), per dataset:

* ``--retriever_url URL``: a running Search-R1-compatible server (``RemoteSearchBackend``);
* ``--corpus FILE``: a local BM25 index over a Search-R1 / FlashRAG corpus JSONL;
* neither: a file that carries its own passages (HotpotQA / 2Wiki ``context``, MuSiQue
  ``paragraphs``) is searched over its pooled passages; a file without passages (Bamboogle,
  R1-Searcher and FlashRAG QA files) over the union of the passages pooled from the other
  ``--dataset`` files; with none, the command stops and asks for ``--corpus``.

``--checkpoint`` takes a step (with ``--run_dir``) or, as issue #5 writes it, a run folder
(``RUN_DIR``, ``RUN_DIR/checkpoints`` or ``RUN_DIR/checkpoints/STEP``). Bad input (missing run
folder or checkpoint, ``--dataset`` without ``=``, a missing, empty, malformed or non-UTF-8 file,
an ``--out`` that names an existing file or a folder that cannot be written) prints one line on
stderr and exits with status 2, before the model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
from typing import Any, Optional, Sequence

from mempo_jax.agent.rollout import RolloutConfig

DEFAULT_TOPK = 3  # Search-R1 / MemPO reference range 3–5, used when the run folder has no config.gin


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """One ``--dataset NAME=PATH`` argument."""

    name: str
    path: pathlib.Path


def parse_dataset_spec(spec: str) -> DatasetSpec:
    """``"NAME=PATH"`` → ``DatasetSpec`` (split at the first ``=``; the path may contain ``=``).

    Raises:
      ValueError: no ``=``, or an empty name or path.
    """
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--dataset expects NAME=PATH (e.g. bamboogle=data/bamboogle.jsonl), got {spec!r}")
    return DatasetSpec(name.strip(), pathlib.Path(path.strip()))


def checkpoint_steps(run_dir: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints under ``RUN_DIR/checkpoints``, ascending.

    Orbax writes a step to a temporary folder (``N.orbax-checkpoint-tmp-…``) and renames it to
    ``N`` when complete, so only all-digit folder names count.
    """
    ckpt = pathlib.Path(run_dir) / "checkpoints"
    if not ckpt.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt.iterdir() if p.is_dir() and p.name.isdigit())


def resolve_run(run_dir: Optional[str], checkpoint: Optional[str]) -> tuple[pathlib.Path, int]:
    """The run folder and checkpoint step to evaluate, checked on disk.

    Args:
      run_dir: ``--run_dir`` (a folder written by ``python -m mempo_jax.train``) or None.
      checkpoint: ``--checkpoint``: an integer step when ``run_dir`` is given, otherwise a path:
        ``RUN_DIR``, ``RUN_DIR/checkpoints`` or ``RUN_DIR/checkpoints/STEP``.

    Returns:
      ``(run_dir, step)``; ``step`` defaults to the newest complete checkpoint.

    Raises:
      ValueError: neither argument, or a ``--checkpoint`` path that names another run folder.
      FileNotFoundError: the folder, ``tokenizer.model``, ``model_config.json``, any
        checkpoint, or the requested step is missing (the message lists the steps present).
    """
    step: Optional[int] = None
    run: Optional[pathlib.Path] = pathlib.Path(run_dir) if run_dir else None
    if checkpoint is not None:
        if checkpoint.strip().isdigit() and run is not None:
            step = int(checkpoint)
        else:
            p = pathlib.Path(checkpoint)
            if p.name.isdigit() and p.parent.name == "checkpoints":
                p, step = p.parent.parent, int(p.name)
            elif p.name == "checkpoints":
                p = p.parent
            if run is not None and run.resolve() != p.resolve():
                raise ValueError(f"--run_dir {run} and --checkpoint {checkpoint} name different run folders")
            run = p
    if run is None:
        raise ValueError("pass --run_dir RUN_DIR (a folder written by python -m mempo_jax.train)")
    if not run.is_dir():
        raise FileNotFoundError(f"run folder not found: {run}")
    for name in ("tokenizer.model", "model_config.json"):
        if not (run / name).is_file():
            raise FileNotFoundError(f"{run / name} not found: is {run} a run folder of mempo_jax.train?")
    steps = checkpoint_steps(run)
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint under {run / 'checkpoints'}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"checkpoint step {step} not found under {run / 'checkpoints'} (have {steps})")
    return run, step


def pooled_passages(path: str | os.PathLike) -> Optional[list]:
    """The passages a QA file carries, pooled into a corpus, or None when it carries none.

    HotpotQA / 2WikiMultihopQA ``context`` → ``pool_hotpotqa_contexts``; MuSiQue ``paragraphs`` →
    ``pool_musique_paragraphs`` (ids ``"0"``, ``"1"``, …, deduplicated by (title, text)).
    FlashRAG / Search-R1 and question–answer files return None.

    Raises:
      ValueError: an empty or malformed file (naming file, line and field).
    """
    from mempo_jax.data.qa_formats import detect_format
    from mempo_jax.tools.corpus import pool_hotpotqa_contexts, pool_musique_paragraphs

    fmt = detect_format(path)
    if fmt in ("hotpotqa", "2wikimultihopqa"):
        return pool_hotpotqa_contexts(path)
    if fmt == "musique":
        return pool_musique_paragraphs(path)
    return None


def merge_passages(pools: Sequence[Sequence]) -> list:
    """Union of several pooled corpora: deduplicated by (title, text), renumbered ``"0"``, ``"1"``, …
    in first-seen order (each pool numbers its own passages from 0, so ids would collide)."""
    from mempo_jax.tools.corpus import Document

    out, seen = [], set()
    for pool in pools:
        for d in pool:
            if (d.title, d.text) not in seen:
                seen.add((d.title, d.text))
                out.append(Document(str(len(out)), d.title, d.text))
    return out


def plan_corpora(specs: Sequence[DatasetSpec], corpus: Optional[str], retriever_url: Optional[str]):
    """One search backend per dataset (see the module doc for the rule) and a description of each.

    Args:
      specs: the datasets; their files must exist.
      corpus: ``--corpus`` file (Search-R1 corpus JSONL) or None.
      retriever_url: ``--retriever_url`` or None (exclusive with ``corpus``).

    Returns:
      ``({name: backend}, {name: description})``; backends are ``BM25Index`` or
      ``RemoteSearchBackend`` (datasets may share one object).

    Raises:
      ValueError: a dataset without passages and no corpus anywhere (asks for ``--corpus``), an
        unreachable retriever, or a malformed corpus / data file.
      FileNotFoundError: a missing ``--corpus`` file.
    """
    from mempo_jax.tools.bm25 import BM25Index
    from mempo_jax.tools.corpus import load_corpus_jsonl
    from mempo_jax.tools.remote import RemoteSearchBackend
    from mempo_jax.tools.search import ToolError

    if retriever_url:
        backend = RemoteSearchBackend(retriever_url)
        try:
            backend.search(["test"], 1)
        except ToolError as e:
            raise ValueError(f"--retriever_url {retriever_url}: the retrieval server does not answer "
                             f"POST /retrieve ({e.reason})") from None
        return {s.name: backend for s in specs}, {s.name: f"retriever {backend.url}" for s in specs}
    if corpus:
        if not pathlib.Path(corpus).is_file():
            raise FileNotFoundError(f"--corpus: no such file: {corpus}")
        index = BM25Index(load_corpus_jsonl(corpus))
        return {s.name: index for s in specs}, {s.name: f"corpus {corpus} ({len(index)} passages)" for s in specs}
    pools = {s.name: pooled_passages(s.path) for s in specs}
    own = {n: p for n, p in pools.items() if p}
    backends, notes = {}, {}
    for name, pool in own.items():
        backends[name] = BM25Index(pool)
        notes[name] = f"own passages ({len(pool)})"
    missing = [s.name for s in specs if s.name not in own]
    if missing:
        if not own:
            raise ValueError(f"dataset {missing[0]!r} carries no passages and no corpus was given: pass "
                             "--corpus FILE (Search-R1 corpus JSONL) or --retriever_url URL, or add a "
                             "--dataset that carries passages (HotpotQA, 2Wiki, MuSiQue) to pool from")
        union = merge_passages(list(own.values()))
        index = BM25Index(union)
        for name in missing:
            backends[name] = index
            notes[name] = f"pooled from {'+'.join(own)} ({len(union)} passages)"
    return {s.name: backends[s.name] for s in specs}, {s.name: notes[s.name] for s in specs}


def load_questions(path: str | os.PathLike, limit: int = 0, multi_objective: int = 1, seed: int = 0) -> list:
    """The questions of one dataset file (``qa_formats.load_dataset``, format sniffed).

    Args:
      path: the data file.
      limit: keep the first ``limit`` items (0 = all), counted after composition.
      multi_objective: ``k > 1`` joins ``k`` questions into one prompt (``multi_objective.compose``,
        each question used at most once, seeded); the answer is ``;``-separated, scored per part.
      seed: composition seed.

    Returns:
      ``QAExample`` list (file order, or the composition's order).

    Raises:
      ValueError: a malformed file, ``limit < 0`` or ``multi_objective`` out of ``[1, #questions]``.
    """
    from mempo_jax.data.multi_objective import compose
    from mempo_jax.data.qa_formats import load_dataset

    if limit < 0:
        raise ValueError(f"--limit must be >= 0, got {limit}")
    examples = load_dataset(path)
    if multi_objective > 1:
        examples = compose(examples, multi_objective, seed)
    elif multi_objective < 1:
        raise ValueError(f"--multi_objective must be >= 1, got {multi_objective}")
    return examples[:limit] if limit else examples


def run_rollout_options(run_dir: pathlib.Path):
    """The rollout options and ``topk`` the run was trained with, read from ``RUN_DIR/config.gin``.

    Returns:
      ``(RolloutConfig, topk, note)``: defaults (``RolloutConfig()``, ``DEFAULT_TOPK``) when the file
      is absent or unreadable by this version; ``note`` says which was used.
    """
    path = run_dir / "config.gin"
    if not path.is_file():
        return RolloutConfig(), DEFAULT_TOPK, "defaults (no config.gin)"
    from mempo_jax.config import load_config

    try:
        cfg = load_config([str(path)])
    except ValueError as e:
        print(f"[evaluate] warning: {path} unreadable ({e}); using default rollout options", file=sys.stderr)
        return RolloutConfig(), DEFAULT_TOPK, "defaults (config.gin unreadable)"
    return cfg.rl.rollout, cfg.topk, str(path)


def make_sample_fn(graphdef, model_cfg, tokenizer):
    """The rollout's ``sample_fn`` over the jitted KV-cache sampler (as ``experiment.build_experiment``):
    stops at EOS and the closing action tags."""
    from mempo_jax.agent.protocol import STOP_TAGS
    from mempo_jax.sampling import Sampler, SamplerConfig

    stop_ids = [tokenizer.eos_id] + [tokenizer.piece_id(t) for t in STOP_TAGS]
    sampler = Sampler(graphdef, model_cfg, stop_ids, tokenizer.pad_id)

    def sample_fn(p, ids, mask, key, max_new_tokens, temperature, top_p):
        return sampler(p, ids, mask, key, SamplerConfig(int(max_new_tokens), float(temperature), float(top_p)))

    return sample_fn


def format_table(results: dict) -> str:
    """Markdown table, one row per (dataset, mode): n, EM, F1, TT, PT, turns, tool calls, format fail."""
    lines = ["| dataset | mode | n | EM | F1 | TT | PT | turns | tool calls | format fail |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, modes in results.items():
        for mode, m in modes.items():
            lines.append(f"| {name} | {mode} | {m['n']} | {m['em']:.3f} | {m['f1']:.3f} | {m['tt']:.0f} | "
                         f"{m['pt']:.0f} | {m['turns']:.2f} | {m['tool_calls']:.2f} | {m['format_fail']:.3f} |")
    return "\n".join(lines)


def write_chart(results: dict, path: str | os.PathLike, title: str = "") -> None:
    """PNG with two grouped bar charts: F1 and TT (tokens per question) per dataset, one bar per mode.

    Uses the matplotlib Agg backend (no display needed).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(results)
    modes = list(dict.fromkeys(m for r in results.values() for m in r))
    x = np.arange(len(names))
    width = 0.8 / max(len(modes), 1)
    fig, axes = plt.subplots(1, 2, figsize=(max(6.0, 2.2 * len(names) + 3), 3.6))
    for ax, key, label in ((axes[0], "f1", "F1"), (axes[1], "tt", "TT (tokens / question)")):
        for j, mode in enumerate(modes):
            vals = [results[n].get(mode, {}).get(key, np.nan) for n in names]
            bars = ax.bar(x + (j - (len(modes) - 1) / 2) * width, vals, width, label=mode)
            ax.bar_label(bars, fmt="%.2f" if key == "f1" else "%.0f", fontsize=7)
        ax.set_xticks(x, names)
        ax.set_ylabel(label)
        ax.set_title(label)
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(title="context")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write_text_atomic(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m mempo_jax.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--run_dir", help="run folder of python -m mempo_jax.train (tokenizer.model, model_config.json, checkpoints/)")
    p.add_argument("--checkpoint", help="checkpoint STEP (default: newest), or a run folder / its checkpoints/STEP")
    p.add_argument("--dataset", action="append", default=[], metavar="NAME=PATH", help="QA file (repeatable)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--corpus", help="Search-R1 corpus JSONL ({id, contents}) for a local BM25 index")
    src.add_argument("--retriever_url", help="Search-R1-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--modes", default="1,full", help="context modes: k >= 1 and/or full (default 1,full)")
    p.add_argument("--limit", type=int, default=0, help="first N questions per dataset (0 = all)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--topk", type=int, default=None, help="passages per search (default: the run's, else 3)")
    p.add_argument("--multi_objective", type=int, default=1, metavar="K", help="join K questions per prompt")
    p.add_argument("--max_turns", type=int, default=None, help="override the run's RolloutConfig.max_turns")
    p.add_argument("--max_new_tokens", type=int, default=None, help="override tokens generated per turn")
    p.add_argument("--max_context_tokens", type=int, default=None, help="override the context token budget")
    p.add_argument("--max_observation_tokens", type=int, default=None, help="override tool-result tokens")
    p.add_argument("--batch_size", type=int, default=128, help="questions per rollout batch")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (sampling, multi-objective composition)")
    p.add_argument("--out", required=True, help="output folder (eval.json, eval.md, eval.png)")
    return p.parse_args(argv)


def run(args) -> dict:
    """Evaluate (see module doc); returns ``{dataset: {mode: metrics}}`` as written to ``eval.json``.

    Raises:
      ValueError / FileNotFoundError: bad input (one-line message); checked before the model loads.
    """
    # ---- check every input before the (slow) model load ----------------------------------
    from mempo_jax.agent.trajectory import mode_name, parse_context_steps

    if not args.dataset:
        raise ValueError("pass at least one --dataset NAME=PATH")
    specs = [parse_dataset_spec(s) for s in args.dataset]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--dataset names must be unique, got {names}")
    for s in specs:
        if not s.path.is_file():
            raise FileNotFoundError(f"--dataset {s.name}: no such file: {s.path}")
    modes = [parse_context_steps(m) for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise ValueError(f"--modes needs at least one mode (k >= 1 or full), got {args.modes!r}")
    if args.topk is not None and args.topk < 1:
        raise ValueError(f"--topk must be >= 1, got {args.topk}")
    if args.batch_size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {args.batch_size}")
    from mempo_jax.resume import check_output_folder

    check_output_folder(args.out, "--out")  # an existing file or a read-only folder fails now, not after the work
    run_dir, step = resolve_run(args.run_dir, args.checkpoint)
    questions = {s.name: load_questions(s.path, args.limit, args.multi_objective, args.seed) for s in specs}
    for name, qs in questions.items():
        if not qs:
            raise ValueError(f"--dataset {name}: no questions to evaluate")
    base, run_topk, options_from = run_rollout_options(run_dir)
    overrides = {k: getattr(args, k) for k in ("max_turns", "max_new_tokens", "max_context_tokens",
                                               "max_observation_tokens") if getattr(args, k) is not None}
    topk = args.topk or run_topk
    backends, corpus_notes = plan_corpora(specs, args.corpus, args.retriever_url)

    # ---- the policy ----------------------------------------------------------------------
    import jax
    from tqdm.auto import tqdm

    from mempo_jax.batching import bucket_length
    from mempo_jax.checkpoint import load_policy
    from mempo_jax.evaluation import evaluate_policy
    from mempo_jax.metrics import write_json_atomic
    from mempo_jax.rewards import outcome_reward
    from mempo_jax.tools.search import ToolEnvironment

    jax.config.update("jax_compilation_cache_dir", os.environ.get(
        "MEMPO_XLA_CACHE", str(pathlib.Path.home() / ".cache" / "mempo_jax" / "xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    tokenizer, model_cfg, graphdef, params = load_policy(run_dir, step)
    sample_fn = make_sample_fn(graphdef, model_cfg, tokenizer)
    largest = min(args.batch_size, max(len(q) for q in questions.values()))
    # fewer padded rows for small evaluations; one row bucket floor for every dataset and mode
    overrides["min_rows_bucket"] = min(base.min_rows_bucket, bucket_length(largest, 1))
    base = dataclasses.replace(base, **overrides)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    records = []
    key = jax.random.PRNGKey(args.seed)
    bar = tqdm(total=sum(len(q) for q in questions.values()) * len(modes), desc="evaluate", unit="q")
    for d, spec in enumerate(specs):
        env = ToolEnvironment(backends[spec.name], topk=topk)
        qs = questions[spec.name]
        results[spec.name] = {}
        for mode in modes:
            name = mode_name(mode)
            bar.set_description(f"{spec.name} {name}")
            done = bar.n

            def progress(n, done=done):
                bar.update(done + n - bar.n)

            # the same key in every mode: at temperature 0 the modes differ only by their context
            res = evaluate_policy(sample_fn, params, qs, tokenizer, env, base, mode, args.temperature,
                                  jax.random.fold_in(key, d), chunk=args.batch_size, progress=progress)
            m = dict(res.metrics)
            m["tool_calls"] = float(sum(t.num_tool_calls for t in res.trajectories) / len(res.trajectories))
            results[spec.name][name] = m
            for q, tr in zip(qs, res.trajectories):
                tt, pt = tr.token_stats()
                records.append({
                    "dataset": spec.name, "mode": name, "id": q.id, "question": q.question,
                    "golds": [list(g) for g in q.golds], "answer": tr.answer,
                    "em": outcome_reward(tr.answer, tr.golds, "em"), "f1": outcome_reward(tr.answer, tr.golds, "f1"),
                    "turns": len(tr.turns), "tool_calls": tr.num_tool_calls,
                    "format_failures": tr.format_failures, "tt": tt, "pt": pt, "end": tr.end_reason,
                })
    bar.close()

    # ---- outputs -------------------------------------------------------------------------
    meta = {
        "run_dir": str(run_dir), "checkpoint_step": step, "datasets": {s.name: str(s.path) for s in specs},
        "corpus": corpus_notes, "topk": topk, "temperature": args.temperature, "seed": args.seed,
        "limit": args.limit, "multi_objective": args.multi_objective, "rollout_options_from": options_from,
        "vocab_size": tokenizer.vocab_size,
        # as evaluate_policy runs it: the temperature is --temperature's, context_steps each mode's
        "rollout": {k: v for k, v in dataclasses.asdict(dataclasses.replace(base, temperature=args.temperature)).items()
                    if k != "context_steps"},
    }
    write_json_atomic(out / "eval.json", results)
    write_json_atomic(out / "eval_meta.json", meta)
    _write_text_atomic(out / "predictions.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    table = format_table(results)
    corpus_lines = "\n".join(f"- {n}: {c}" for n, c in corpus_notes.items())
    _write_text_atomic(out / "eval.md", (
        f"# Evaluation of {run_dir} (checkpoint {step})\n\n{table}\n\n"
        f"EM/F1: SQuAD-normalised, max over gold aliases; TT: tokens processed per question (every "
        f"turn's context + output, summed); PT: the largest single context + output; format fail: share "
        f"of episodes with a malformed turn or no answer. Temperature {args.temperature}, top-{topk} "
        f"search{f', {args.multi_objective} questions per prompt' if args.multi_objective > 1 else ''}.\n\n"
        f"Retrieval corpus:\n{corpus_lines}\n"))
    write_chart(results, out / "eval.png", f"{run_dir.name} @ {step}")
    print("\n" + table + f"\n\n[evaluate] -> {out / 'eval.json'}, {out / 'eval.md'}, {out / 'eval.png'}", flush=True)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point. Returns 0, or 2 after one ``error: …`` line on stderr for bad input."""
    args = _parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
