"""The main job: ``python -m mempo_jax.commands.train --run_dir DIR [--gin_file F] [--gin_param B] [--resume]``.

Stages (the default ``configs/tiny_world.gin`` runs all of them on CPU in minutes):

1. build the world (or read real data), the BM25 tools, the tokenizer and the model;
2. cold-start SFT on the scripted agent's trajectories, or on an SFT trajectory file
   (``SFTConfig.data_path``, messages rows; both go through ``data/messages.py``);
3. evaluation of the SFT policy on held-out questions in every context mode;
4. MemPO RL (rollout → outcome + memory rewards → grouped advantages → PPO), with a progress bar,
   ``metrics.jsonl``, TensorBoard events and sample rollouts in ``rollouts.jsonl``;
5. evaluation after RL; the before/after table is printed and written to ``summary.json``
   with the bootstrap 95 % CI of the k = 1 EM gain. A run from a Hugging Face checkpoint
   (``ModelOptions.checkpoint``) then exports the RL policy to ``RUN_DIR/hf_export``
   (``mempo_jax.run.export``: config, safetensors, tokenizer with its tags and chat template).

Data: the tiny world, or QA files (``ExperimentConfig.train_path`` / ``eval_path`` in any format
``mempo_jax.data.qa_formats`` reads) searched over ``corpus_path`` (local BM25), a
``retriever_url`` (``/retrieve`` server, checked before RUN_DIR is touched) or the files' own
context paragraphs. ``SFTConfig.steps = 0`` starts RL from the initial policy (a checkpoint's),
which is then also the frozen reference.

Checkpoints, resume and preemption (docs/resume.md). Orbax checkpoints are saved asynchronously
every ``CheckpointConfig.every_steps`` steps and at the end of each stage: SFT to
``RUN_DIR/sft_checkpoint`` (its final step is the frozen reference policy of RL, restored from
there), RL to ``RUN_DIR/checkpoints`` (policy params, optimizer state, and in the metadata the
grain iterator state, the metric-log offsets, the fault counters and the RNG stream). The stage
evaluations are kept in ``eval_sft.json`` / ``eval_rl.json``. A run folder holding a checkpoint
is resumed from its newest durable point (``--resume`` insists on one); the logs are cut back to
it, and every random draw is a pure function of (seed, stage, step), so the resumed run is the
uninterrupted one, bit for bit on CPU. SIGTERM saves a checkpoint and exits 0 within
``CheckpointConfig.grace_s``. ``RUN_DIR`` may be ``gs://BUCKET/PREFIX`` (every file through
``mempo_jax.core.paths``; docs/resume.md, *A run folder on Cloud Storage*). Exit status: 0 done or preempted, 2 bad config or input,
3 numerical faults, 4 grace period exceeded, 5 another process of a multi-process run was lost
(``DistributedConfig.peer_timeout_s``; the line names it and the last complete checkpoint).

Meshes and several processes (docs/tpu_pod.md). The run is always on a mesh ``(data, fsdp,
tensor)``: the smallest, ``(1, 1, 1)``, unless the config binds ``MeshConfig`` (the pod recipes)
or several processes run (``distributed.maybe_initialize`` joins them first: ``$MEMPO_MULTIHOST=1``
on a TPU slice, or ``$MEMPO_COORDINATOR`` / ``$MEMPO_NUM_PROCESSES`` / ``$MEMPO_PROCESS_ID``).
Policy, reference, optimizer state, KV cache and batches are placed by ``MeshConfig.rules``;
``ExecutionConfig`` holds the micro-batch and chunk rows (``python -m mempo_jax.commands.plan`` reads the
same). Each process rolls out, calls the tools for and evaluates its share of a step's questions
and feeds its share of each SFT batch; ``mempo_jax.run.lockstep`` runs every device program on the
global batch (pass-throughs on one process). Process 0 alone writes the logs, evaluation files,
``summary.json`` and run artefacts; every process calls the orbax saves and restores. A SIGTERM
on any process is acted on by all at the next step boundary.

The stages are functions of a ``RunContext`` (``mempo_jax.run.context.open_run`` builds and
checks it; ``mempo_jax.run.stages`` holds them); ``main(argv, hooks=FaultHooks(...))`` injects the
test faults (the command line never does).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import jax
import jax.numpy as jnp

from mempo_jax.commands.cli import command_name
from mempo_jax.config import DEFAULT_GIN
from mempo_jax.config_loader import load_run_config
from mempo_jax.recipes import gin_file_help


def _parse_args(argv):
    p = argparse.ArgumentParser(prog=command_name("mempo_jax.commands.train"), description=__doc__.split("\n\n")[0])
    p.add_argument("--run_dir", required=True, help="output folder (metrics, summary, checkpoints): a local path or gs://BUCKET/PREFIX")
    p.add_argument("--gin_file", action="append", default=None, help=gin_file_help())
    p.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. RLConfig.steps=10")
    p.add_argument("--cache_dir", default=None, help="tokenizer cache (default $MEMPO_CACHE, else RUN_DIR/.cache; for a gs:// RUN_DIR "
                   "~/.cache/mempo_jax/runs/<hash>)")
    p.add_argument("--resume", action="store_true",
                   help="require a checkpoint in RUN_DIR (a run folder holding one is always resumed)")
    return p.parse_args(argv)


def _initialize_distributed(config=None, run_dir=None) -> bool:
    """``distributed.maybe_initialize(config=...)`` once per interpreter (before any JAX device use),
    then the lost-process watch of a multi-process run (``distributed.watch_peers``)."""
    global _DISTRIBUTED, _PEER_WATCH
    if _DISTRIBUTED is None:
        from mempo_jax.core.distributed import DistributedConfig, maybe_initialize, watch_peers

        config = config or DistributedConfig()
        _DISTRIBUTED = maybe_initialize(config=config)
        _PEER_WATCH = watch_peers(config, run_dir) if _DISTRIBUTED else None
    return _DISTRIBUTED


_DISTRIBUTED = None
_PEER_WATCH = None


def run(args, hooks=None) -> dict:
    """Run every stage, resuming from the newest durable point of ``RUN_DIR``.

    Args:
      args: the parsed command line.
      hooks: test-only ``faults.FaultHooks`` (default: none).

    Returns:
      The summary written to ``RUN_DIR/summary.json``.

    Raises:
      ValueError / FileNotFoundError: bad config, data, tokenizer or run folder (one line, raised
        before anything in the run folder changes); also a mesh that does not fit the devices,
        a batch that does not divide over it, or processes that see different run folders.
      Preempted: a SIGTERM arrived; the state is saved (``main`` exits 0).
      NumericalFault: too many non-finite steps; the last good checkpoint is kept (``main`` exits 3).
    """
    run_cfg = load_run_config(args.gin_file or [DEFAULT_GIN], args.gin_param)  # touches no device
    cfg = run_cfg.experiment
    _initialize_distributed(cfg.distributed, args.run_dir)  # joins the other processes, before any device use
    from mempo_jax.run import stages
    from mempo_jax.data.messages import read_messages
    from mempo_jax.run.experiment import check_qa_inputs
    from mempo_jax.run.faults import FaultHooks
    from mempo_jax.run.context import open_run, setup_compilation_cache
    from mempo_jax.model.lora import reference_params, split_trainable

    setup_compilation_cache()
    check_qa_inputs(cfg)  # QA files, corpus, retriever: a bad one stops the run before RUN_DIR changes
    # An SFT trajectory file is read and validated before the run folder changes.
    sft_file = read_messages(cfg.sft.data_path) if cfg.sft.steps > 0 and cfg.sft.data_path else None
    with contextlib.ExitStack() as stack:
        if _PEER_WATCH is not None:  # a failure that echoes a lost process ends with that process's line
            stack.push(_PEER_WATCH.on_exit)
        ctx = open_run(args, run_cfg, hooks or FaultHooks(), stack)
        learner = ctx.new_learner(ctx.exp.policy.params, ctx.sft_opt, micro_batch_rows=cfg.sft_micro_batch_rows)
        stages.heldout(ctx)  # enough held-out questions for every process, checked before any stage
        evals, per_q = {}, {}
        stages.zero_shot_stage(ctx, learner, evals, per_q)
        stages.sft_stage(ctx, learner, sft_file, stack)
        # Frozen reference: the SFT result (ExecutionConfig.reference_dtype; float32: a copy); with LoRA
        # its adapters so, over the same base arrays.
        ref_dtype = jnp.dtype(cfg.execution.reference_dtype)
        ref_params = reference_params(learner.params, lambda x: x.astype(ref_dtype) if jnp.issubdtype(
            x.dtype, jnp.floating) and x.dtype != ref_dtype else x.copy())
        evals["sft"], per_q["sft"] = stages.evaluate_stage(ctx, "sft", learner, ctx.point.eval_sft, ctx.sft_ckpt,
                                                           cfg.sft.steps)
        # RL builds its own optimizer state: the SFT one (and a restored SFT checkpoint's) is freed first
        _free(learner.state.opt_state, ctx.sft_state[0].opt_state if ctx.sft_state is not None else None)
        learner = stages.rl_stage(ctx, learner.params, ref_params, stack)
        # The RL evaluation and the export read the policy alone: the optimizer state, the frozen
        # reference's own arrays (with adapters the base is the policy's) and a restored RL
        # checkpoint's optimizer state are freed before the evaluation's KV cache is built
        _free(learner.state.opt_state, split_trainable(ref_params)[0], ctx.rl_state and ctx.rl_state[0].opt_state)
        learner.state, ref_params = learner.state.replace(opt_state=None), None
        evals["rl"], per_q["rl"] = stages.evaluate_stage(ctx, "rl", learner, ctx.point.eval_rl, ctx.rl_ckpt,
                                                         cfg.rl.steps)
        exported = None
        if cfg.model.checkpoint:  # the RL policy as a Hugging Face folder (every process: a collective)
            from mempo_jax.run.export import EXPORT_DIR, export_policy
            from mempo_jax.run.export_protocol import ExportProtocol

            policy = ctx.exp.policy
            exported = str(export_policy(ctx.run_dir / EXPORT_DIR, policy.model_cfg, learner.params,
                                         policy.tokenizer, source=cfg.model.checkpoint,
                                         protocol=ExportProtocol.of_run(cfg, policy.fmt.system_prompt)))
            if policy.model_cfg.lora_rank:  # also the adapters alone, as a PEFT folder over the source
                from mempo_jax.run.export import PEFT_EXPORT_DIR, export_adapter

                try:
                    export_adapter(ctx.run_dir / PEFT_EXPORT_DIR, policy.model_cfg, learner.params,
                                   cfg.model.checkpoint)
                except ValueError as e:  # embedding rows added for the tags: the merged export only
                    ctx.say(f"[mempo] no {PEFT_EXPORT_DIR}: {e}", flush=True)
        summary = stages.summarize(ctx, evals, per_q, exported)
    stages.print_summary(ctx, summary)
    return summary


def _free(*trees) -> None:
    """Delete the device buffers of every ``jax.Array`` in ``trees``: state no stage uses again,
    freed now rather than when its last reference goes (the frozen run context keeps a restored
    checkpoint's). Checkpoint saves have copied their arrays off the device when they return."""
    for x in jax.tree.leaves(trees):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def main(argv=None, hooks=None) -> int:
    """CLI entry point.

    Args:
      argv: the command line (default ``sys.argv[1:]``).
      hooks: test-only ``faults.FaultHooks`` (default: none).

    Returns:
      0 when done or preempted (checkpoint saved), 2 for a config, data or run-folder error, a
      failed write (disk full, read-only folder) or a device out of memory (``RESOURCE_EXHAUSTED``:
      the phase and the binding to lower, ``out_of_memory_line``; the last checkpoint stays as it
      was) — one line on stderr each —, 3 when non-finite steps stopped the run (one line on stderr).
    """
    from mempo_jax.run.preemption import Preempted
    from mempo_jax.run.faults import NumericalFault

    args = _parse_args(argv)
    try:
        run(args, hooks)
    except Preempted:
        print(f"[mempo] preempted: checkpoint saved under {args.run_dir} (or nothing yet to save); run the same "
              "command to resume", file=sys.stderr, flush=True)
        return 0
    except NumericalFault as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except (ValueError, OSError) as e:  # bad config, data or run folder; a full disk, a read-only folder
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as e:
        line = out_of_memory_line(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    return 0


# (function or file name in the traceback, phase, the bindings that lower its memory); the innermost match wins
_OOM_PHASES = (
    ("rollout", "sampling", "RolloutConfig.num_slots (or RolloutConfig.max_context_tokens)"),
    ("rollout_cached", "sampling", "RolloutConfig.num_slots (or RolloutConfig.max_context_tokens)"),
    ("sft_step", "the SFT step", "ExecutionConfig.sft_micro_batch_rows (or ExecutionConfig.remat = \"full\")"),
    ("ppo_update", "the PPO update", "ExecutionConfig.micro_batch_rows (or ExecutionConfig.remat = \"full\", "
     "ExecutionConfig.logit_chunk_tokens)"),
    ("logprobs", "the log-probs", "ExecutionConfig.logprob_chunk_rows (or ExecutionConfig.logit_chunk_tokens)"),
    ("detached_logprobs", "the old / reference log-probs", "ExecutionConfig.logprob_chunk_rows"),
    ("memory_reward.py", "the memory-reward scoring", "ExecutionConfig.scoring_chunk_rows"),
)


def out_of_memory_line(e: BaseException) -> str | None:
    """One line for a device out-of-memory (``RESOURCE_EXHAUSTED`` in the error): the phase it
    happened in (read off the traceback) and the binding to lower; ``None`` for any other error."""
    import pathlib
    import traceback

    if "RESOURCE_EXHAUSTED" not in str(e):
        return None
    phase, binding = "an unrecognised phase", "ExecutionConfig.micro_batch_rows / logprob_chunk_rows"
    for frame in traceback.extract_tb(e.__traceback__):
        for key, p, b in _OOM_PHASES:
            if key in (frame.name, pathlib.Path(frame.filename).name):
                phase, binding = p, b
    first = " ".join(str(e).split())[:160]
    return f"device out of memory in {phase} ({first}); lower {binding}; the last checkpoint is kept"


def _one_line(e: BaseException) -> str:
    """The error as one line: an ``OSError`` as ``FILE: reason`` (e.g. ``No space left on device``)."""
    if isinstance(e, OSError) and e.strerror and not isinstance(e, FileNotFoundError):
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror} [errno {e.errno}]"
    return " ".join(str(e).split())


if __name__ == "__main__":
    sys.exit(main())
