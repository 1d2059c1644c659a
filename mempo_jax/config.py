"""Experiment configuration: validated dataclasses, bound by gin at the entry point only.

Every runnable recipe is a ``configs/*.gin`` file that binds fields of these dataclasses, e.g.::

    ExperimentConfig.rl = @RLConfig()
    RLConfig.group_size = 8
    RLConfig.rollout = @RolloutConfig()
    RolloutConfig.context_steps = 1

``config_loader.load_config`` parses gin files and ``--gin_param`` overrides and returns one frozen
``ExperimentConfig``; library code never reads gin.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from mempo_jax import recipes
from mempo_jax.text.protocol import ALL_TAG_PIECES
from mempo_jax.data.scripted_agent import ScriptedAgentConfig
from mempo_jax.data.world import WorldConfig
from mempo_jax.core.logprobs import DEFAULT_LOGIT_CHUNK
from mempo_jax.model.attention_kernels import ATTENTION_IMPLS
from mempo_jax.model.attention_xla import BLOCKED_MIN_LEN
from mempo_jax.rl.learner import DEFAULT_LOGPROB_CHUNK_ROWS, DEFAULT_MICRO_BATCH_ROWS, OptimConfig
from mempo_jax.core.distributed import DistributedConfig
from mempo_jax.core.mesh_config import MeshConfig
from mempo_jax.model.lora import LoraConfig
from mempo_jax.rl.config import RLConfig
from mempo_jax.core.validation import check, require
from mempo_jax.agent.trajectory import parse_context_steps
from mempo_jax.model.config import ModelConfig, PRESET_SHAPES
from mempo_jax.model.decoder import REMAT_CHOICES


DEFAULT_GIN = recipes.resolve_recipe(recipes.DEFAULT_RECIPE)  # the default recipe's file

# SentencePiece's fixed pieces: pad/unk/bos/eos, the protocol tags and the 256 byte-fallback pieces
# (the trainer also needs one piece per distinct character of its text; ``train_sentencepiece``).
MIN_VOCAB_SIZE = 4 + len(ALL_TAG_PIECES) + 256


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Which model to build.

    Attributes:
      preset: a ``ModelConfig`` classmethod name (``tiny``, ``qwen2_5_0_5b``, …).
      overrides: ``(field, value)`` pairs applied to the preset (e.g. ``(("num_layers", 2),)``).
      checkpoint: a Hugging Face checkpoint folder to import instead of random weights ("" = none).
      tags: how a checkpoint's policy writes the protocol tags (``agent.tags.TagCodec``):
        ``"text"`` (default: the checkpoint keeps its own tokenization; ``</search>`` is several
        BPE tokens, stops and ``<mem>`` spans are found on the sampled ids' bytes) or ``"tokens"``
        (every tag one added token: spare embedding rows or reserved specials, else the embedding
        and an untied LM head are resized, ``model.resize``). Ignored without a checkpoint: the
        from-scratch tokenizer has every tag as a single piece (tokens mode).
      chat_template: how a checkpoint's policy is prompted: ``"auto"`` (its own chat template when
        the folder has one, else the plain prompt), ``"require"`` (its template, or a one-line
        error), ``"none"`` (the plain prompt of the from-scratch tokenizer).
      tool_layout: where tool results go: ``"assistant"`` (the assistant's stream, as
        ``<information>…</information>``; Search-R1 / ASearcher), ``"user"`` or ``"tool"`` (a
        message of that role, rendered by the chat template).
      system_prompt_path: a text file replacing the shipped MemPO system prompt
        (``mempo_jax/agent/prompts/mempo_system.txt``; ``{action_tags}`` / ``{actions}`` are
        filled in); "" = the shipped one.

    Raises:
      ValueError: from ``__post_init__``: an unknown preset, ``tags``, ``chat_template`` or
        ``tool_layout``, an override that is not a ``(ModelConfig field, value)`` pair or whose
        value the preset rejects (e.g. ``num_heads`` not a multiple of ``num_kv_heads``), or with
        ``checkpoint`` an override other than ``dtype`` / ``param_dtype`` (names the field).
    """

    preset: str = "tiny"
    overrides: tuple = ()
    checkpoint: str = ""
    tags: str = "text"
    chat_template: str = "auto"
    tool_layout: str = "assistant"
    system_prompt_path: str = ""

    def __post_init__(self):
        presets = sorted(["tiny", *PRESET_SHAPES])
        check(self, "preset", str, choices=presets)
        check(self, "overrides", tuple)
        check(self, "checkpoint", str)
        check(self, "tags", str, choices=("text", "tokens"))
        check(self, "chat_template", str, choices=("auto", "require", "none"))
        check(self, "tool_layout", str, choices=("assistant", "user", "tool"))
        check(self, "system_prompt_path", str)
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        for i, item in enumerate(self.overrides):
            require(isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str),
                    f"ModelOptions.overrides[{i}] must be a (field, value) pair, got {item!r}")
            require(item[0] in fields, f"ModelOptions.overrides: unknown ModelConfig field {item[0]!r} "
                                       f"(known: {', '.join(sorted(fields))})")
        names = [k for k, _ in self.overrides]
        require(len(set(names)) == len(names), f"ModelOptions.overrides names a field twice: {names}")
        if self.checkpoint:
            extra = sorted(set(names) - {"dtype", "param_dtype"})
            require(not extra, f"ModelOptions.overrides {extra} cannot change the architecture of checkpoint "
                               f"{self.checkpoint}; only dtype / param_dtype")
            return
        base = ModelConfig.tiny(1024) if self.preset == "tiny" else ModelConfig.preset(self.preset)
        try:  # the preset with the overrides, validated now (the tiny preset's vocabulary is a placeholder)
            base.replace(**dict(self.overrides))
        except (TypeError, ValueError) as e:
            raise ValueError(f"ModelOptions.overrides: {e}") from None


COPY_POOLS = ("names", "name_pieces")  # the values of SFTConfig.copy_pool


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Cold-start SFT on scripted trajectories or on a trajectory file (``data_path``).

    Attributes:
      steps: optimizer steps.
      batch_rows: training rows per step.
      full_fraction: share of trajectories also trained as one whole-history (``full``) row, so
        the policy works in both context modes.
      copy_fraction: synthetic copy (induction) rows added per scripted row (see ``sft.copy_rows``);
        for models trained from scratch (``configs/tiny_world.gin`` sets 0.25). Default 0: a
        pretrained checkpoint copies already, and random-token rows only cost it (docs/log/2026-12.md).
      copy_warmup_fraction: share of ``steps`` trained first on copy rows only (a curriculum: a
        from-scratch model forms its copy circuit there before the agent rows;
        ``sft.with_copy_warmup``); 0: none. Needs a corpus to draw the rows from, as
        ``copy_fraction`` does. ``copy_warmup_steps`` is the number of steps it gives.
      copy_pool: the tokens copy rows are drawn from (``experiment.entity_token_ids``):
        ``"names"`` (default), the passage titles that are single pieces (every title's first
        piece when none is); ``"name_pieces"``, every piece of every title (names of several
        pieces, e.g. a tokenizer trained on the name grammar: ``WorldConfig.names``).
      reader_fraction: share of SFT trajectories that also give two memory-reader rows
        (``sft.reader_rows``): the memory reward's memory view and full view of the answer turn,
        followed by the scorer's answer prefix and an answer (loss on the answer only), so that
        the scorer's ``P(Z | ·)`` is read on contexts the policy was taught to answer from; 0: none.
      agent: the scripted agent's imperfections.
      optim: optimizer options.
      data_path: an SFT trajectory file (JSONL, JSON array or parquet of ``{"messages": [...]}`` rows,
        ``mempo_jax/data/messages.py``) to train on instead of playing the scripted agent ("" = play
        it; ``python -m mempo_jax.commands.write_sft_messages`` writes its conversations in this format).
        Read and validated before the run folder changes; a bad row is one error naming file, line
        and field. ``agent`` is then unused.

    Raises:
      ValueError: from ``__post_init__`` for a value out of range (names the field).
    """

    steps: int = 300
    batch_rows: int = 64
    full_fraction: float = 0.25
    copy_fraction: float = 0.0
    copy_warmup_fraction: float = 0.0
    reader_fraction: float = 0.0
    copy_pool: str = "names"
    agent: ScriptedAgentConfig = ScriptedAgentConfig()
    optim: OptimConfig = OptimConfig(learning_rate=3e-3, warmup_steps=20)
    data_path: str = ""

    def __post_init__(self):
        check(self, "steps", int, lo=0)
        check(self, "batch_rows", int, lo=1)
        check(self, "full_fraction", float, lo=0.0, hi=1.0)
        check(self, "copy_fraction", float, lo=0.0)
        check(self, "copy_warmup_fraction", float, lo=0.0, hi=1.0)
        check(self, "reader_fraction", float, lo=0.0, hi=1.0)
        check(self, "copy_pool", str, choices=COPY_POOLS)
        check(self, "agent", ScriptedAgentConfig)
        check(self, "optim", OptimConfig)
        check(self, "data_path", str)

    @property
    def copy_warmup_steps(self) -> int:
        """Copy-only steps at the start: ``round(copy_warmup_fraction * steps)``."""
        return int(round(self.copy_warmup_fraction * self.steps))


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How the device programs split their work: the one place of the execution sizes. They change
    memory and speed, not the gradient (up to float rounding); ``python -m mempo_jax.commands.plan`` checks
    a recipe's against the chips' HBM with the same values the run uses.

    Attributes:
      micro_batch_rows: rows per gradient-accumulation micro-batch of a PPO update (``Learner``;
        default ``learner.DEFAULT_MICRO_BATCH_ROWS``).
      sft_micro_batch_rows: the same for an SFT step; 0 = ``SFTConfig.batch_rows`` (the whole
        batch in one micro-batch). Must divide ``SFTConfig.batch_rows``.
      logprob_chunk_rows: most packed rows per detached log-prob call: the reference and old
        log-probs (``rl.step.detached_logprobs``; default ``learner.DEFAULT_LOGPROB_CHUNK_ROWS``).
      scoring_chunk_rows: rows per memory-reward scorer call (``MemoryRewardScorer.chunk_rows``,
        a power of two); 0 = the scorer's ``memory_reward.DEFAULT_CHUNK_ROWS``.
      logit_chunk_tokens: sequence positions per LM-head chunk wherever log-probs are taken (the
        update, SFT, old / reference log-probs, scoring): the ``[rows, length, vocab]`` logits are
        never built, one ``[rows, logit_chunk_tokens, vocab]`` float32 block at a time is
        (``core.logprobs.target_logprobs``; default ``DEFAULT_LOGIT_CHUNK``).
      remat: decoder-layer rematerialisation in the update and SFT step: ``"none"``, ``"full"``
        (each layer recomputed in the backward pass from its input) or a ``jax.checkpoint_policies``
        name such as ``"dots_saveable"`` (matmul outputs kept) / ``"nothing_saveable"``
        (``model.decoder.REMAT_CHOICES``).
      dense_attention_max_len: rows up to this many tokens take dense attention in the update, SFT,
        log-prob and scoring passes; longer rows take the blocked (flash-style) attention
        (``model.attention_xla.use_blocked``; default ``attention_xla.BLOCKED_MIN_LEN`` = 1,024). Dense
        keeps each layer's ``[rows, heads, length, length]`` float32 scores in the backward pass
        and is the faster path on CPU at these lengths; a lower value trades that speed for memory
        (docs/results.md, "The SmolLM2 recipe at micro-batch 8"). Values are the same up to float32
        summation order. The KV-cache passes of rollout and evaluation always take the blocked path.
      reference_dtype: dtype of the frozen reference policy's weights (``"float32"`` or
        ``"bfloat16"``: half the reference's memory; its log-probs then carry bfloat16 weight
        rounding). The policy's master weights and optimizer state stay float32.
      rollout_dtype: dtype of the rollout engine's weights (``"float32"``: the trainer's arrays as
        they are, no copy; ``"bfloat16"``: the weight sync casts every floating parameter once per step, so decode
        reads half the weight bytes and a pod's all-gather moves half as many). The sampled
        tokens' own log-probs then carry bfloat16 weight rounding; the PPO old log-probs are the
        trainer's float32 ones (``RLConfig.old_logprobs = "trainer"``), and
        ``rollout/logprob_diff/*`` reports the gap. On one process the cast is an extra
        half-size copy while the rollout runs.
      attention_impl: the attention strategy of every forward pass, the rollout's decode
        included (``model.attention_kernels.resolve_impl``): ``"auto"`` (default: ``"cudnn"`` on GPU,
        ``"pallas"`` on TPU, ``"xla"`` elsewhere), ``"xla"`` (the dense / blocked XLA code),
        ``"cudnn"`` (GPU: cuDNN flash attention, Pallas paged decode) or ``"pallas"`` (TPU:
        splash attention, Pallas paged decode). Speed and memory, not values (float32 summation
        order aside); a kernel strategy on a backend without it is an error.

    Raises:
      ValueError: from ``__post_init__`` for a value out of range (names the field).
    """

    micro_batch_rows: int = DEFAULT_MICRO_BATCH_ROWS
    sft_micro_batch_rows: int = 0
    logprob_chunk_rows: int = DEFAULT_LOGPROB_CHUNK_ROWS
    scoring_chunk_rows: int = 0
    logit_chunk_tokens: int = DEFAULT_LOGIT_CHUNK
    remat: str = "full"
    dense_attention_max_len: int = BLOCKED_MIN_LEN
    reference_dtype: str = "float32"
    rollout_dtype: str = "float32"
    attention_impl: str = "auto"

    @property
    def forward_options(self) -> dict:
        """The ``model.forward.make_logits_fn`` keywords these sizes bind (``logit_chunk``,
        ``remat``, ``dense_max_len``, ``attention_impl``): the one place an execution field reaches
        the forward pass."""
        return {"logit_chunk": self.logit_chunk_tokens, "remat": self.remat,
                "dense_max_len": self.dense_attention_max_len, "attention_impl": self.attention_impl}

    @property
    def rollout_param_dtype(self):
        """The dtype the weight sync casts to: ``None`` for ``"float32"`` (the trainer's own arrays,
        no copy), else ``rollout_dtype``."""
        return None if self.rollout_dtype == "float32" else self.rollout_dtype

    def __post_init__(self):
        check(self, "micro_batch_rows", int, lo=1)
        check(self, "sft_micro_batch_rows", int, lo=0)
        check(self, "logprob_chunk_rows", int, lo=1)
        check(self, "scoring_chunk_rows", int, lo=0)
        check(self, "logit_chunk_tokens", int, lo=1)
        check(self, "dense_attention_max_len", int, lo=1)
        check(self, "remat", str, choices=REMAT_CHOICES)
        check(self, "reference_dtype", str, choices=("float32", "bfloat16"))
        check(self, "rollout_dtype", str, choices=("float32", "bfloat16"))
        check(self, "attention_impl", str, choices=ATTENTION_IMPLS)
        n = self.scoring_chunk_rows
        require(n & (n - 1) == 0, f"ExecutionConfig.scoring_chunk_rows must be 0 or a power of two, got {n}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation.

    Attributes:
      num_questions: held-out questions evaluated (0 = all).
      temperature: sampling temperature (0 = greedy).
      context_modes: the context modes evaluated (``"k1"``-style names built from ints; ``"full"``).
      bootstrap_samples: resamples for the EM-gain confidence interval.
      zero_shot: also evaluate the initial policy (a checkpoint before SFT) as stage ``base``
        (``eval_base.json``), so the summary gives the SFT gain over it too.
      num_slots: KV-cache slots of an evaluation rollout (0: ``RolloutConfig.num_slots``, by default
        one per question). The held-out questions then run through that many slots, a finished
        question's slot refilled with the next; the cache (slots x context x layers, the largest
        buffer of an evaluation of many questions) shrinks in proportion, the answers do not
        change (a question's tokens do not depend on the slot layout).

    Raises:
      ValueError: from ``__post_init__`` for a value out of range or a context mode that is not
        ``"full"`` or an integer k >= 1 (names the field).
    """

    num_questions: int = 0
    temperature: float = 0.0
    context_modes: tuple = (1, "full")
    bootstrap_samples: int = 2000
    zero_shot: bool = False
    num_slots: int = 0

    def __post_init__(self):
        check(self, "num_questions", int, lo=0)
        check(self, "temperature", float, lo=0.0)
        check(self, "context_modes", tuple)
        require(len(self.context_modes) > 0, "EvalConfig.context_modes must name at least one mode")
        for i, mode in enumerate(self.context_modes):
            try:
                require(not isinstance(mode, (bool, float)), f"not an int or 'full': {mode!r}")
                parse_context_steps(mode)
            except (TypeError, ValueError) as e:
                raise ValueError(f"EvalConfig.context_modes[{i}]: {e}") from None
        check(self, "bootstrap_samples", int, lo=1)
        check(self, "zero_shot", bool)
        check(self, "num_slots", int, lo=0)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints, resume, preemption and numerical-fault policy (docs/resume.md).

    Attributes:
      every_steps: save an orbax checkpoint every this many SFT and RL steps (and always at the
        end of each stage), asynchronously.
      max_to_keep: complete checkpoints kept per stage folder (the newest ones).
      grace_s: seconds between SIGTERM and a forced exit; within it the run saves a checkpoint
        and exits 0 (exit status 4 if the save could not finish in time).
      max_consecutive_nonfinite: the run stops (exit status 3) after this many consecutive RL
        steps whose loss or gradients were non-finite (their updates are skipped).
      async_save: write checkpoints in a background thread.

    Raises:
      ValueError: from ``__post_init__`` for a value out of range (names the field).
    """

    every_steps: int = 10
    max_to_keep: int = 3
    grace_s: float = 25.0
    max_consecutive_nonfinite: int = 3
    async_save: bool = True

    def __post_init__(self):
        for name in ("every_steps", "max_to_keep", "max_consecutive_nonfinite"):
            check(self, name, int, lo=1)
        check(self, "grace_s", float, gt=0.0)
        check(self, "async_save", bool)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """One complete run.

    Attributes:
      seed: master seed (world, model init, rollouts, shuffles).
      dataset: ``"tiny_world"`` (embedded default), ``"qa"`` (RL on QA files: ``train_path``,
        ``eval_path``, and ``corpus_path`` or ``retriever_url``) or ``"hotpotqa"`` (the same, the
        name kept for recipes that set ``data_path``).
      data_path: the HotpotQA file of ``dataset = "hotpotqa"`` recipes: another name for
        ``train_path`` (set one of them; with ``eval_path`` empty 20 % of it is held out and its
        context paragraphs are the corpus).
      train_path: the training QA file, any format ``mempo_jax.data.qa_formats`` reads: FlashRAG /
        Search-R1 JSONL or parquet, question–answer JSONL, CSV with ``question`` and ``answer``
        columns, HotpotQA, 2WikiMultihopQA, MuSiQue (``mempo_jax.data.qa_questions``).
      eval_path: the held-out QA file (same formats); its questions are removed from the training
        ones (same question text). Empty: ``max(1, 20 %)`` of ``train_path`` is held out (seeded).
      corpus_path: a corpus file (``tools.corpus.CORPUS_LAYOUTS``: ``{"id", "contents"}`` rows and others) searched with
        a local BM25 index (``mempo_jax.run.backends.training_backend``).
      retriever_url: a running Search-R1-compatible ``/retrieve`` server instead (e.g.
        ``python -m mempo_jax.commands.retrieval_server``), reached with ``RemoteSearchBackend``'s
        timeouts and retries; checked at start-up (a server that does not answer: one line naming
        the URL, exit 2, run folder untouched). Exclusive with ``corpus_path``. With neither, the
        context paragraphs of the QA files (HotpotQA, 2Wiki, MuSiQue) are the corpus.
      pool_contexts: with ``corpus_path``, also index the context paragraphs the QA files carry
        (ids ``ctx0``, ``ctx1``, …); not allowed with ``retriever_url``.
      heldout_fraction: without ``eval_path``, the seeded share of the training file's questions
        held out (``qa_questions.split_questions``).
      world: the embedded world's sizes (the training world of ``dataset = "tiny_world"``).
      eval_world: a world of entities training never saw, the held-out set of a
        ``"tiny_world"`` run (every question of it, searched in its own passages through a
        tool environment of its own; ``experiment.evaluation_world``) in place of ``world``'s
        held-out split; ``None`` (default): ``world``'s held-out split. Its names come from
        ``eval_world.names``' share and never from ``world``'s names; ``"eval"`` with a
        ``"train"`` ``world`` keeps it apart from every training world of any seed.
        Used by the tiny world only (as ``world``).
      vocab_size: SentencePiece vocabulary size.
      topk: passages returned per search.
      model: model choice.
      sft: cold start (``steps = 0`` skips it).
      rl: MemPO RL.
      optim: RL optimizer.
      eval: held-out evaluation.
      log_rollouts: sample trajectories written per logging step to ``rollouts.jsonl``.
      checkpoint: checkpoint cadence, preemption grace and numerical-fault limit.
      mesh: the device mesh (``MeshConfig``). Unbound (no ``MeshConfig.*`` binding), one process
        runs on the smallest mesh, ``(1, 1, 1)``; several processes on ``MeshConfig()``'s.
      execution: micro-batch and chunk rows of the device programs (``ExecutionConfig``).
      lora: LoRA adapters (``LoraConfig``; ``rank = 0``, the default, trains every parameter).
        ``LoraConfig.*`` bindings apply without an ``ExperimentConfig.lora`` line.
      distributed: what a multi-process run does when a process is lost (``DistributedConfig``);
        ``DistributedConfig.*`` bindings apply without an ``ExperimentConfig.distributed`` line.

    Raises:
      ValueError: from ``__post_init__`` for a value out of range or of the wrong type (names the
        field); the nested configs check their own fields.
    """

    seed: int = 0
    dataset: str = "tiny_world"
    data_path: str = ""
    train_path: str = ""
    eval_path: str = ""
    corpus_path: str = ""
    retriever_url: str = ""
    pool_contexts: bool = False
    heldout_fraction: float = 0.2
    world: WorldConfig = WorldConfig()
    eval_world: Optional[WorldConfig] = None
    vocab_size: int = 1024
    topk: int = 1
    model: ModelOptions = ModelOptions()
    sft: SFTConfig = SFTConfig()
    rl: RLConfig = RLConfig()
    optim: OptimConfig = OptimConfig(learning_rate=1e-4, warmup_steps=2)
    eval: EvalConfig = EvalConfig()
    log_rollouts: int = 4
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    execution: ExecutionConfig = ExecutionConfig()
    lora: LoraConfig = LoraConfig()
    distributed: DistributedConfig = DistributedConfig()

    def __post_init__(self):
        check(self, "seed", int, lo=0)
        check(self, "dataset", str, choices=("tiny_world", "hotpotqa", "qa"))
        for name in ("data_path", "train_path", "eval_path", "corpus_path", "retriever_url"):
            check(self, name, str)
        qa_fields = ("data_path", "train_path", "eval_path", "corpus_path", "retriever_url")
        if self.dataset == "tiny_world":
            for name, value in zip(qa_fields, (self.data_path, self.train_path, self.eval_path, self.corpus_path,
                                               self.retriever_url)):
                if value:
                    raise ValueError(f"ExperimentConfig.{name} is set but dataset is 'tiny_world'; "
                                     "set ExperimentConfig.dataset = \"qa\"")
        elif not self.qa_train_path:
            raise ValueError(f"ExperimentConfig.train_path (or data_path) is required for dataset {self.dataset!r}")
        if self.data_path and self.train_path and self.data_path != self.train_path:
            raise ValueError("ExperimentConfig.data_path and ExperimentConfig.train_path name different files; "
                             "set train_path only")
        if self.corpus_path and self.retriever_url:
            raise ValueError("ExperimentConfig.corpus_path and ExperimentConfig.retriever_url are exclusive; set one")
        if self.pool_contexts and self.retriever_url:
            raise ValueError("ExperimentConfig.pool_contexts cannot add passages to a retriever_url's index; "
                             "use corpus_path, or set pool_contexts = False")
        check(self, "heldout_fraction", float, gt=0.0, lt=1.0)
        check(self, "vocab_size", int, lo=MIN_VOCAB_SIZE)
        check(self, "topk", int, lo=1)
        check(self, "log_rollouts", int, lo=0)
        for name, kind in (("world", WorldConfig), ("model", ModelOptions), ("sft", SFTConfig), ("rl", RLConfig),
                           ("optim", OptimConfig), ("eval", EvalConfig), ("checkpoint", CheckpointConfig),
                           ("mesh", MeshConfig), ("execution", ExecutionConfig), ("lora", LoraConfig),
                           ("distributed", DistributedConfig)):
            check(self, name, kind)
        require(self.eval_world is None or isinstance(self.eval_world, WorldConfig),
                f"ExperimentConfig.eval_world must be a WorldConfig or None, got {self.eval_world!r}")
        micro = self.execution.sft_micro_batch_rows
        require(not (micro and self.sft.batch_rows % micro), "ExecutionConfig.sft_micro_batch_rows must be 0 or divide "
                f"SFTConfig.batch_rows = {self.sft.batch_rows}, got {micro}")

    @property
    def sft_micro_batch_rows(self) -> int:
        """Rows per SFT micro-batch (``ExecutionConfig.sft_micro_batch_rows``, 0: the whole batch)."""
        return self.execution.sft_micro_batch_rows or self.sft.batch_rows

    @property
    def rl_seed(self) -> int:
        """The RL stage's seed: ``RLConfig.seed``, else ``seed``."""
        return self.seed if self.rl.seed is None else self.rl.seed

    @property
    def qa_train_path(self) -> str:
        """The training QA file: ``train_path``, else ``data_path`` ("" for the tiny world)."""
        return self.train_path or self.data_path
