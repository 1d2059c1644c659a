"""The evaluation command: a trained run, or any Hugging Face checkpoint, on QA datasets, in every
context mode (docs/algorithm.md §6).

::

    python -m mempo_jax.commands.evaluate (--run_dir RUN_DIR [--checkpoint STEP] | --hf_checkpoint DIR) \\
        --dataset NAME=PATH [--dataset NAME=PATH ...] [--corpus FILE | --retriever_url URL] \\
        [--modes 1,full] [--limit N] [--temperature 0] [--topk K] [--multi_objective K] --out DIR

``--hf_checkpoint DIR`` evaluates a Hugging Face folder (``config.json``, safetensors,
``tokenizer.json`` + ``tokenizer_config.json``: e.g. Qwen2.5-7B-Instruct zero-shot, a released
MemPO checkpoint, or ``RUN_DIR/hf_export`` of our trainer) exactly as a run folder: the policy is
``experiment.load_checkpoint_policy`` of it. An export of this project carries its run's protocol
(``run.export_protocol``: ``mempo_protocol.json`` and the system prompt): the policy is prompted
with that prompt, tags, chat template and tool layout, and rolled out with the run's turn and
token budgets and top-k. Any other folder gets ``--tags`` ``text`` (its own tokenization, closing
tags stop the turn when written as text; ``tokens``: the tags as added tokens, as a
``ModelOptions.tags = "tokens"`` run adds them), ``RolloutConfig()``'s options and top-k 3. The
flags below override any of them; ``--dtype bfloat16`` halves its memory.

For every dataset and context mode the policy answers each question once (``evaluate_policy``)
and the command writes ``DIR/eval.json`` (``{dataset: {mode: {em, f1, tt, pt, turns,
format_fail, tool_calls, n}}}``), ``DIR/eval.md`` (a markdown table), ``DIR/eval.png`` (EM, F1, format-fail rate and TT
per dataset and mode), ``DIR/predictions.jsonl`` (one line per question and mode) and
``DIR/eval_meta.json`` (run folder, step, corpus of each dataset, rollout options).

Retrieval (docs/algorithm.md §7), per dataset:

* ``--retriever_url URL``: a running Search-R1-compatible server (``RemoteSearchBackend``);
* ``--corpus FILE``: a local BM25 index over a corpus (``tools.corpus.CORPUS_LAYOUTS``);
* neither: a file that carries its own passages (HotpotQA / 2Wiki ``context``, MuSiQue
  ``paragraphs``) is searched over its pooled passages; a file without passages (Bamboogle,
  R1-Searcher and FlashRAG QA files) over the union of the passages pooled from the other
  ``--dataset`` files; with none, the command stops and asks for ``--corpus``.

``--checkpoint`` takes a step (with ``--run_dir``) or a run folder
(``RUN_DIR``, ``RUN_DIR/checkpoints`` or ``RUN_DIR/checkpoints/STEP``). A run folder trained from
a Hugging Face checkpoint holds ``hf_tokenizer/`` instead of ``tokenizer.model``; both load. Bad
input (missing run folder, checkpoint or HF folder files, ``--dataset`` without ``=``, a missing, empty,
malformed or non-UTF-8 file, an ``--out`` that names an existing file or a folder that cannot be
written) prints one line on stderr and exits with status 2, before the model is loaded.
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
from mempo_jax.commands.cli import command_name
from mempo_jax.core.paths import is_remote, run_path
from mempo_jax.run.backends import plan_corpora
from mempo_jax.run.eval_report import format_table, write_chart
from mempo_jax.run.export_protocol import PROMPT_FILE, PROTOCOL_FILE, ExportProtocol
from mempo_jax.run.run_folder import (CHECKPOINT_FOLDERS, DEFAULT_TOPK, checkpoint_steps, run_policy_format,
                                      run_rollout_options)


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


def resolve_run(run_dir: Optional[str], checkpoint: Optional[str]) -> tuple[pathlib.Path, int, str]:
    """The run folder, checkpoint step and checkpoint folder to evaluate, checked on disk.

    Args:
      run_dir: ``--run_dir`` (a folder written by ``python -m mempo_jax.commands.train``, local or
        ``gs://…``) or None.
      checkpoint: ``--checkpoint``: an integer step when ``run_dir`` is given, otherwise a path:
        ``RUN_DIR``, ``RUN_DIR/checkpoints`` or ``RUN_DIR/checkpoints/STEP`` (RL), or
        ``RUN_DIR/sft_checkpoint`` or ``RUN_DIR/sft_checkpoint/STEP`` (the SFT policy).

    Returns:
      ``(run_dir, step, folder)``; ``step`` defaults to the newest complete checkpoint of
      ``folder`` (one of ``CHECKPOINT_FOLDERS``; ``"checkpoints"`` unless the path names SFT's).

    Raises:
      ValueError: neither argument, or a ``--checkpoint`` path that names another run folder.
      FileNotFoundError: the folder, its tokenizer (``tokenizer.model`` or ``hf_tokenizer/``),
        ``model_config.json``, any checkpoint, or the requested step is missing (the message lists
        the steps present).
    """
    step: Optional[int] = None
    folder = "checkpoints"
    run = run_path(run_dir) if run_dir else None
    if checkpoint is not None:
        if checkpoint.strip().isdigit() and run is not None:
            step = int(checkpoint)
        else:
            p = run_path(checkpoint)
            if p.name.isdigit() and p.parent.name in CHECKPOINT_FOLDERS:
                p, step, folder = p.parent.parent, int(p.name), p.parent.name
            elif p.name in CHECKPOINT_FOLDERS:
                p, folder = p.parent, p.name
            if run is not None and not _same_folder(run, p):
                raise ValueError(f"--run_dir {run} and --checkpoint {checkpoint} name different run folders")
            run = p
    if run is None:
        raise ValueError("pass --run_dir RUN_DIR (a folder written by python -m mempo_jax.commands.train) or "
                         "--hf_checkpoint DIR (a Hugging Face checkpoint folder)")
    if not run.is_dir():
        raise FileNotFoundError(f"run folder not found: {run}")
    from mempo_jax.run.checkpoint import run_tokenizer_path

    if run_tokenizer_path(run) is None:
        raise FileNotFoundError(f"{run / 'tokenizer.model'} (or hf_tokenizer/tokenizer.json) not found: is {run} a run "
                                "folder of mempo_jax.commands.train?")
    if not (run / "model_config.json").is_file():
        raise FileNotFoundError(f"{run / 'model_config.json'} not found: is {run} a run folder of mempo_jax.commands.train?")
    steps = checkpoint_steps(run, folder)
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint under {run / folder}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"checkpoint step {step} not found under {run / folder} (have {steps})")
    return run, step, folder


def _same_folder(a, b) -> bool:
    """Whether two run folders (local or ``gs://…``) are the same one."""
    if is_remote(a) or is_remote(b):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return pathlib.Path(a).resolve() == pathlib.Path(b).resolve()


def resolve_hf_checkpoint(path: str) -> pathlib.Path:
    """The ``--hf_checkpoint`` folder, checked before the (slow) model load.

    Raises:
      FileNotFoundError: the folder, its ``config.json``, its ``tokenizer.json`` or any
        ``*.safetensors`` file is missing (one line naming the path).
    """
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"--hf_checkpoint: no such folder: {folder}")
    for name in ("config.json", "tokenizer.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"--hf_checkpoint: {folder / name} not found (a Hugging Face checkpoint folder "
                                    "holds config.json, *.safetensors and tokenizer.json)")
    if not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"--hf_checkpoint: no *.safetensors file in {folder}")
    return folder


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


def _parse_args(argv):
    p = argparse.ArgumentParser(prog=command_name("mempo_jax.commands.evaluate"), description=__doc__.split("\n\n")[0])
    p.add_argument("--run_dir", help="run folder of python -m mempo_jax.commands.train (tokenizer.model, model_config.json, checkpoints/)")
    p.add_argument("--checkpoint", help="checkpoint STEP (default: newest), or a run folder / its checkpoints/STEP; "
                   "RUN_DIR/sft_checkpoint[/STEP] evaluates the SFT policy")
    p.add_argument("--hf_checkpoint", metavar="DIR",
                   help="a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json) instead of --run_dir")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="parameter and activation dtype of an --hf_checkpoint (default float32)")
    p.add_argument("--tags", default=None, choices=("text", "tokens"),
                   help="how an --hf_checkpoint writes the protocol tags: as text (its own tokenization) or as added "
                        "tokens (ModelOptions.tags); default: its mempo_protocol.json's, else text")
    p.add_argument("--dataset", action="append", default=[], metavar="NAME=PATH", help="QA file (repeatable)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--corpus", help="corpus for a local BM25 index: rows {id, contents} (Search-R1), {id, title, text}, "
                     "or a HippoRAG JSON array of {title, text}")
    src.add_argument("--retriever_url", help="Search-R1-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--modes", default="1,full", help="context modes: k >= 1 (or k1, k2, …) and/or full (default 1,full)")
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


@dataclasses.dataclass
class _Inputs:
    """The evaluation's inputs, checked (``_check_inputs``)."""

    specs: list
    modes: list
    questions: dict
    hf_dir: Optional[pathlib.Path]
    run_dir: Optional[pathlib.Path]
    step: Optional[int]
    folder: str  # the run folder's checkpoint folder: "checkpoints" (RL) or "sft_checkpoint"
    rollout: RolloutConfig  # the run's (or export's) rollout options, before this command's overrides
    topk: int
    options_from: str
    protocol: Optional[ExportProtocol] = None  # an --hf_checkpoint export's mempo_protocol.json


def _check_inputs(args) -> _Inputs:
    """Every input, checked before the (slow) model load.

    Raises:
      ValueError / FileNotFoundError: one line naming the bad argument or file.
    """
    from mempo_jax.agent.trajectory import parse_context_steps
    from mempo_jax.run.resume import check_output_folder

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
    check_output_folder(args.out, "--out")  # an existing file or a read-only folder fails now, not after the work
    hf_dir = run_dir = step = protocol = None
    folder = "checkpoints"
    if args.hf_checkpoint:
        if args.run_dir or args.checkpoint:
            raise ValueError("--hf_checkpoint evaluates a Hugging Face folder; do not also pass --run_dir / --checkpoint")
        hf_dir = resolve_hf_checkpoint(args.hf_checkpoint)
        protocol = ExportProtocol.read(hf_dir)  # an export of this project: the run's budgets and top-k
        if protocol is None:
            base, run_topk, options_from = RolloutConfig(), DEFAULT_TOPK, "defaults (--hf_checkpoint)"
        else:
            base, run_topk, options_from = protocol.rollout, protocol.topk, str(hf_dir / PROTOCOL_FILE)
    else:
        run_dir, step, folder = resolve_run(args.run_dir, args.checkpoint)
    questions = {s.name: load_questions(s.path, args.limit, args.multi_objective, args.seed) for s in specs}
    for name, qs in questions.items():
        if not qs:
            raise ValueError(f"--dataset {name}: no questions to evaluate")
    if run_dir is not None:
        base, run_topk, options_from = run_rollout_options(run_dir)
    return _Inputs(specs, modes, questions, hf_dir, run_dir, step, folder, base, args.topk or run_topk, options_from,
                   protocol)


def load_eval_policy(args, hf_dir: Optional[pathlib.Path], run_dir: Optional[pathlib.Path], step: Optional[int],
                     folder: str = "checkpoints", protocol: Optional[ExportProtocol] = None):
    """The policy to evaluate (``experiment.make_policy``, as the trainer's): a Hugging Face folder
    (``--dtype``, ``--tags``) or a run folder's checkpoint (of ``folder``: ``checkpoints`` or
    ``sft_checkpoint``), prompted as it was trained; ``protocol``: the export's, read by ``_check_inputs``."""
    from mempo_jax.run.checkpoint import load_policy
    from mempo_jax.config import ModelOptions
    from mempo_jax.run.experiment import load_checkpoint_policy, make_policy, policy_format

    if hf_dir is not None:
        dtypes = (("dtype", args.dtype), ("param_dtype", args.dtype))
        if protocol is None:
            options = ModelOptions(checkpoint=str(hf_dir), overrides=dtypes, tags=args.tags or "text")
        else:  # prompted as the run was: its system prompt, tags, chat template and tool layout
            options = ModelOptions(checkpoint=str(hf_dir), overrides=dtypes, tags=args.tags or protocol.tags,
                                   chat_template=protocol.chat_template, tool_layout=protocol.tool_layout,
                                   system_prompt_path=str(hf_dir / PROMPT_FILE))
        model_cfg, graphdef, params, tokenizer = load_checkpoint_policy(options)
        fmt = policy_format(options, tokenizer)
    else:
        tokenizer, model_cfg, graphdef, params = load_policy(run_dir, step, folder)
        fmt = run_policy_format(run_dir, tokenizer)
    return make_policy(model_cfg, graphdef, params, tokenizer, fmt)


def _evaluate_all(args, inputs: _Inputs, policy, rollout, backends) -> tuple[dict, list]:
    """Every dataset in every mode: ``({dataset: {mode: metrics}}, prediction records)``."""
    import jax
    from tqdm.auto import tqdm

    from mempo_jax.agent.trajectory import mode_name
    from mempo_jax.run.evaluation import evaluate_policy, prediction_records
    from mempo_jax.tools.search import search_environment

    results: dict[str, dict[str, Any]] = {}
    records = []
    key = jax.random.PRNGKey(args.seed)
    bar = tqdm(total=sum(len(q) for q in inputs.questions.values()) * len(inputs.modes), desc="evaluate", unit="q")
    for d, spec in enumerate(inputs.specs):
        env = search_environment(backends[spec.name], topk=inputs.topk)
        qs = inputs.questions[spec.name]
        results[spec.name] = {}
        for mode in inputs.modes:
            name = mode_name(mode)
            bar.set_description(f"{spec.name} {name}")
            done = bar.n

            def progress(n, done=done):
                bar.update(done + n - bar.n)

            # the same key in every mode: at temperature 0 the modes differ only by their context
            res = evaluate_policy(policy.engine, policy.params, qs, policy.fmt, env, rollout, mode,
                                  args.temperature, jax.random.fold_in(key, d), chunk=args.batch_size,
                                  progress=progress)
            m = dict(res.metrics)
            m["tool_calls"] = float(sum(t.num_tool_calls for t in res.trajectories) / len(res.trajectories))
            results[spec.name][name] = m
            records += prediction_records(qs, res, name, spec.name)
    bar.close()
    return results, records


def _write_outputs(args, inputs: _Inputs, results: dict, records: list, rollout, corpus_notes: dict,
                   vocab_size: int) -> pathlib.Path:
    """``eval.json``, ``eval_meta.json``, ``predictions.jsonl``, ``eval.md`` and ``eval.png`` under ``--out``."""
    from mempo_jax.core.paths import write_json_atomic, write_text_atomic

    out, hf_dir, run_dir, step = pathlib.Path(args.out), inputs.hf_dir, inputs.run_dir, inputs.step
    meta = {
        "run_dir": None if run_dir is None else str(run_dir), "checkpoint_step": step,
        "checkpoint_folder": None if run_dir is None else inputs.folder,
        "hf_checkpoint": None if hf_dir is None else str(hf_dir), "datasets": {s.name: str(s.path) for s in inputs.specs},
        "corpus": corpus_notes, "topk": inputs.topk, "temperature": args.temperature, "seed": args.seed,
        "limit": args.limit, "multi_objective": args.multi_objective, "rollout_options_from": inputs.options_from,
        "vocab_size": vocab_size,
        # as evaluate_policy runs it: the temperature is --temperature's, context_steps each mode's
        "rollout": {k: v for k, v in dataclasses.asdict(dataclasses.replace(rollout, temperature=args.temperature)).items()
                    if k != "context_steps"},
    }
    write_json_atomic(out / "eval.json", results)
    write_json_atomic(out / "eval_meta.json", meta)
    write_text_atomic(out / "predictions.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    table = format_table(results)
    if hf_dir is not None:
        policy_name, chart_title = f"the Hugging Face checkpoint {hf_dir}", f"{hf_dir.name} (HF checkpoint, {args.dtype})"
    else:
        sft = inputs.folder == "sft_checkpoint"
        policy_name = f"{run_dir} ({'SFT checkpoint' if sft else 'checkpoint'} {step})"
        chart_title = f"{run_dir.name} @ {'sft ' if sft else ''}{step}"
    corpus_lines = "\n".join(f"- {n}: {c}" for n, c in corpus_notes.items())
    write_text_atomic(out / "eval.md", (
        f"# Evaluation of {policy_name}\n\n{table}\n\n"
        f"EM/F1: SQuAD-normalised, max over gold aliases; TT: tokens processed per question (every "
        f"turn's context + output, summed); PT: the largest single context + output; format fail: share "
        f"of episodes with a malformed turn or no answer. Temperature {args.temperature}, top-{inputs.topk} "
        f"search{f', {args.multi_objective} questions per prompt' if args.multi_objective > 1 else ''}.\n\n"
        f"Retrieval corpus:\n{corpus_lines}\n"))
    write_chart(results, out / "eval.png", chart_title)
    print("\n" + table + f"\n\n[evaluate] -> {out / 'eval.json'}, {out / 'eval.md'}, {out / 'eval.png'}", flush=True)
    return out


def run(args) -> dict:
    """Evaluate (see module doc); returns ``{dataset: {mode: metrics}}`` as written to ``eval.json``.

    Raises:
      ValueError / FileNotFoundError: bad input (one-line message); checked before the model loads.
    """
    inputs = _check_inputs(args)
    flags = vars(args)
    overrides = {k: flags[k] for k in ("max_turns", "max_new_tokens", "max_context_tokens",
                                       "max_observation_tokens") if flags[k] is not None}
    backends, corpus_notes = plan_corpora(inputs.specs, args.corpus, args.retriever_url)

    from mempo_jax.core.batching import bucket_length
    from mempo_jax.run.context import setup_compilation_cache

    setup_compilation_cache()
    policy = load_eval_policy(args, inputs.hf_dir, inputs.run_dir, inputs.step, inputs.folder, inputs.protocol)
    largest = min(args.batch_size, max(len(q) for q in inputs.questions.values()))
    # fewer padded rows for small evaluations; one row bucket floor for every dataset and mode
    overrides["min_rows_bucket"] = min(inputs.rollout.min_rows_bucket, bucket_length(largest, 1))
    rollout = dataclasses.replace(inputs.rollout, **overrides)
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    results, records = _evaluate_all(args, inputs, policy, rollout, backends)
    _write_outputs(args, inputs, results, records, rollout, corpus_notes, policy.tokenizer.vocab_size)
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
