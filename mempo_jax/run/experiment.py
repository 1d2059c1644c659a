"""Building a run's components from its config: questions, corpus, tools, tokenizer, model.

``build_experiment`` is the one place that turns an ``ExperimentConfig`` into objects; the
training command (``commands/train.py``) and the evaluation command only consume them.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Collection, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from mempo_jax.agent.format import AgentFormat
from mempo_jax.text.protocol import ANSWER, MEM, THINK, render_turn
from mempo_jax.agent.tags import TagCodec
from mempo_jax.config import ExecutionConfig, ExperimentConfig
from mempo_jax.core.sharding import Rules
from mempo_jax.data.qa_questions import load_qa_questions
from mempo_jax.data.world import Question, World, build_world, name_inventory
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import LogitsFn, make_logits_fn
from mempo_jax.agent.engine import RolloutEngine
from mempo_jax.model.adapters import add_adapters, base_config
from mempo_jax.model.lora import with_trainable
from mempo_jax.rl.memory_reward import MEMORY_PREFIXES, MemoryRewardScorer
from mempo_jax.text.tokenizer import Tokenizer, train_sentencepiece
from mempo_jax.tools.bm25 import BM25Index
from mempo_jax.tools.corpus import Document
from mempo_jax.tools.environment import ToolEnvironment
from mempo_jax.tools.search import search_environment
from mempo_jax.agent.engine import num_slots
from mempo_jax.core import sharding
from mempo_jax.core.rollout_mesh import check_fits, rollout_mesh
from mempo_jax.core.sharding import DEFAULT_RULES, mesh_or_local
from mempo_jax.data.qa_formats import detect_format
from mempo_jax.data.qa_questions import split_questions
from mempo_jax.model.hf_io import load_hf_checkpoint
from mempo_jax.model.placement import init_params
from mempo_jax.model.resize import protocol_tag_rows, resize_vocab
from mempo_jax.run.backends import connect_retriever, training_backend
from mempo_jax.text.hf_tokenizer import HFTokenizer
from mempo_jax.tools.corpus import pool_hotpotqa_contexts


@dataclasses.dataclass
class Policy:
    """A policy ready to roll out: its model, parameters on the mesh, format and jitted callables.

    Attributes:
      model_cfg, graphdef, params: the model (``params`` placed by ``sharding.param_shardings``).
      tokenizer, fmt: its tokenizer and ``AgentFormat`` (``fmt.tokenizer`` is ``tokenizer``).
      engine: ``make_engine`` of it on this process's rollout mesh.
      logits_fn: the model's ``LogitsFn`` (``make_logits_fn``), hidden states of ``(params, ids)`` rows.
      mesh, rules: where it lives: the (global) device mesh and its logical-axis rules.
    """

    model_cfg: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: Tokenizer
    fmt: AgentFormat
    engine: RolloutEngine
    logits_fn: LogitsFn
    mesh: Mesh
    rules: Rules


@dataclasses.dataclass
class Experiment:
    """Everything a run needs, built once (``build_experiment``).

    Attributes:
      cfg: the run's ``ExperimentConfig``.
      train_questions, heldout_questions: the two question splits.
      documents: the local corpus (``[]`` with a retriever).
      offices: ``{company: {city: office head}}`` of the tiny world (the scripted agent's lazy
        guesses); ``{}`` for a QA run.
      tool_env: the search / access tools over the corpus.
      eval_tool_env: the tools the held-out questions are searched with, when they are not
        ``tool_env`` (``ExperimentConfig.eval_world``: its own passages); ``None``: ``tool_env``.
      policy: the model being trained, with its tokenizer, format, engine and mesh.
      scorer: the memory-reward scorer of ``policy``.
      corpus: what the tools search, in words.
    """

    cfg: ExperimentConfig
    train_questions: list[Question]
    heldout_questions: list[Question]
    documents: list[Document]
    offices: dict[str, dict[str, str]]
    tool_env: ToolEnvironment
    policy: Policy
    scorer: MemoryRewardScorer
    corpus: str = ""
    eval_tool_env: ToolEnvironment | None = None

    @property
    def heldout_tool_env(self) -> ToolEnvironment:
        """The tools the held-out questions are searched with (``eval_tool_env``, else ``tool_env``)."""
        return self.eval_tool_env or self.tool_env


def hotpotqa_questions(path: str) -> tuple[list[Question], list[Document]]:
    """Questions and the pooled context corpus of a HotpotQA file (HF distractor layout).

    The scripted cold-start plan searches each supporting-fact title in turn, keeps each title's
    supporting sentences (the bridge fact) in ``<mem>`` and answers the gold answer
    (``qa_questions.load_qa_questions``).

    Raises:
      ValueError: naming the file, line and field of a malformed record.
    """

    return load_qa_questions(path), pool_hotpotqa_contexts(path)


def qa_paths(cfg: ExperimentConfig) -> list[str]:
    """The QA files of a ``dataset != "tiny_world"`` run: the training file, then the held-out one."""
    return [p for p in (cfg.qa_train_path, cfg.eval_path) if p]


def check_qa_inputs(cfg: ExperimentConfig) -> None:
    """The QA run's inputs, checked before the run folder is touched: the files exist, their
    format is readable (``qa_formats.detect_format``: e.g. a CSV without a ``question`` column),
    and a ``retriever_url`` answers. Nothing for the tiny world.

    Raises:
      FileNotFoundError: naming the config field of a missing file.
      ValueError: one line naming the file (or the URL) that is unusable.
    """

    if cfg.dataset == "tiny_world":
        return
    fields = {"train_path" if cfg.train_path else "data_path": cfg.qa_train_path, "eval_path": cfg.eval_path,
              "corpus_path": cfg.corpus_path}
    for name, path in fields.items():
        if path and not pathlib.Path(path).is_file():
            raise FileNotFoundError(f"ExperimentConfig.{name}: no such file: {path}")
    for path in qa_paths(cfg):
        detect_format(path)
    if cfg.retriever_url:
        connect_retriever(cfg.retriever_url, "ExperimentConfig.retriever_url").close()


def load_qa_data(cfg: ExperimentConfig):
    """Questions and search backend of a QA run (``dataset`` ``"qa"`` / ``"hotpotqa"``).

    Training questions come from ``train_path`` (or ``data_path``), held-out ones from
    ``eval_path`` (questions asked in both are dropped from training), else a seeded
    ``heldout_fraction`` (default 20 %) of the training file (``qa_questions.split_questions``). The
    backend is ``backends.training_backend`` of ``corpus_path`` / ``retriever_url`` /
    ``pool_contexts`` over both files.

    Returns:
      ``(train_questions, heldout_questions, documents, backend, note)``; ``documents`` is ``[]``
      for a retriever, ``note`` describes the backend.

    Raises:
      ValueError / FileNotFoundError: a missing or malformed file, an unreachable retriever
        (one line naming the field, file or URL).
    """

    check_qa_inputs(cfg)
    train = load_qa_questions(cfg.qa_train_path)
    held = load_qa_questions(cfg.eval_path) if cfg.eval_path else None
    train_q, held_q, dropped = split_questions(train, held, cfg.seed, cfg.heldout_fraction)
    backend, docs, note = training_backend(qa_paths(cfg), cfg.corpus_path, cfg.retriever_url, cfg.pool_contexts)
    if dropped:
        note += f"; {dropped} training question(s) also in {cfg.eval_path} left out"
    return train_q, held_q, docs, backend, note


def load_questions(cfg: ExperimentConfig):
    """The run's questions and search backend: ``(train, held-out, documents, offices, backend, note)``.

    ``tiny_world``: the embedded world's splits, BM25 over its passages; ``offices`` maps each
    company to its ``{city: office head}`` (the scripted agent's lazy guesses). A QA run:
    ``load_qa_data`` (``offices`` empty). Used by ``build_experiment`` and ``write_sft_messages``.

    Raises:
      FileNotFoundError / ValueError: a missing or malformed data file, an unreachable retriever.
    """
    if cfg.dataset == "tiny_world":
        world = build_world(cfg.world)
        docs = world.documents
        offices = {c["name"]: c["offices"] for c in world.companies}
        return world.train, world.heldout, docs, offices, BM25Index(docs), f"{len(docs)} passages"
    train_q, held_q, docs, backend, note = load_qa_data(cfg)
    return train_q, held_q, docs, {}, backend, note


def evaluation_world(cfg: ExperimentConfig, training_documents: Sequence[Document]) -> World:
    """The world of ``ExperimentConfig.eval_world``: its entities drawn from ``eval_world.names``'
    share of the name space and never named like a training passage (``training_documents``'
    titles, which are the training world's entity names), so none of them occurs in training.

    Args:
      cfg: a ``"tiny_world"`` run's config with ``eval_world`` set.
      training_documents: the training world's passages.

    Raises:
      ValueError: ``eval_world`` is ``None``.
    """
    if cfg.eval_world is None:
        raise ValueError("evaluation_world: ExperimentConfig.eval_world is None")
    return build_world(cfg.eval_world, exclude={d.title for d in training_documents})


def evaluation_questions(world: World) -> list[Question]:
    """Every question of an evaluation world (both of its splits: none of it is trained on)."""
    return world.heldout + world.train


def tokenizer_texts(cfg: ExperimentConfig, documents, questions) -> list[str]:
    """The SentencePiece training text of a from-scratch run of ``cfg`` (``build_experiment``): the
    training world's (or QA files') passages and questions through ``_tokenizer_texts``, with the
    tiny world's entity names redrawn when ``WorldConfig.names`` is not ``"any"``."""
    redraw = {d.title for d in documents} if cfg.dataset == "tiny_world" and cfg.world.names != "any" else ()
    return _tokenizer_texts(documents, questions, redraw, cfg.seed)


def _tokenizer_texts(documents, questions, redraw: Collection[str] = (), seed: int = 0) -> list[str]:
    """The SentencePiece training text of a from-scratch run: passages, questions and the protocol's
    phrases as the scripted agent renders them.

    Args:
      documents, questions: the training corpus and questions.
      redraw: entity names (a world's passage titles) to redraw: each of their occurrences is
        replaced by a fresh name of the grammar (``world.name_inventory``, share ``"train"``), so
        the tokenizer learns the name grammar's pieces, not one world's names, and names it never
        saw tokenise like the ones it did (the tiny world with ``WorldConfig.names != "any"``).
        Empty (default): the text as it is.
      seed: the redrawn names' seed.
    """
    texts = [d.contents for d in documents] + [q.question for q in questions]
    for q in questions:  # the protocol's own phrases, as the scripted agent renders them
        for query, facts in q.hops:
            texts.append(render_turn(" " + "; ".join(facts), " search", "search", " " + query))
        texts.append(render_turn(" " + q.answer, " answer", "answer", " " + q.answer))
    # (kept verbatim: this text is part of the tokenizer training data, so the default run's
    # SentencePiece model, and with it every figure of the default run, stays the same)
    texts.append("unknown none " + "BOS (when the tokenizer has one; Qwen has none) + system prompt + question, as ids.")
    if not redraw:
        return texts
    names = set(redraw)
    hits = sum(m.group(0) in names for t in texts for m in _CAPITALISED.finditer(t))
    fresh = iter(name_inventory(hits, seed))
    return [_CAPITALISED.sub(lambda m: next(fresh) if m.group(0) in names else m.group(0), t) for t in texts]


_CAPITALISED = re.compile(r"\b[A-Z][a-z]+\b")  # a word that may be an entity name of the tiny world


def answer_prefix_ids(tokenizer, mode: str = "empty_mem") -> tuple[list[int], list[int]]:
    """``(full_prefix, answer_prefix)``: the never-scored ids between a memory-reward context and
    Z (``MemoryRewardScorer``), chosen by ``MemoryRewardConfig.prefix`` (``MEMORY_PREFIXES``).

    Built from the protocol's tags only (encoded as text, so it holds for single-token and text
    tags alike); no think wording is assumed. The answer turn's opening is
    ``T = <think></think><answer>`` (an empty think: docs/algorithm.md §1's optional think block).

    * ``"empty_mem"`` (default): full view ``full_traj[t] + <mem></mem> + T + Z``, memory view
      ``mem_traj[t] + T + Z``. Both views then end in a closed ``<mem>`` block before ``T``, as
      every policy turn does, so ``T`` follows where the policy itself writes it.
    * ``"think"``: ``T`` on both views. ``full_traj[t]`` ends in ``</information>`` or the prompt,
      where the policy writes ``<mem>`` next, so ``P_full`` is measured off the policy's
      distribution.
    * ``"none"``: Z straight after both contexts (the reference's plain continuation): off
      the policy's distribution on both views.

    The think block is left empty rather than worded (``<think> answer</think>`` is how the
    scripted agent opens an answer turn, and a checkpoint's policy need not write it); an empty
    think is equally unlikely on both views. The three prefixes' measured probabilities and
    rewards are in docs/log/2026-12.md.

    Raises:
      ValueError: for an unknown ``mode`` (names ``MemoryRewardConfig.prefix``).
    """
    if mode not in MEMORY_PREFIXES:
        raise ValueError(f"MemoryRewardConfig.prefix must be one of {MEMORY_PREFIXES}, got {mode!r}")
    if mode == "none":
        return [], []
    opening = tokenizer.encode(THINK[0] + THINK[1] + ANSWER[0])
    full = tokenizer.encode(MEM[0] + MEM[1]) if mode == "empty_mem" else []
    return full, opening


def entity_token_ids(tokenizer, documents, pool: str = "names") -> list[int]:
    """The pool of the SFT copy rows (``SFTConfig.copy_pool``), from the passage titles (the entity names).

    ``"names"``: ids of the titles that are single pieces; every title's first piece when none is.
    ``"name_pieces"``: every piece of every title (sorted, distinct).

    Raises:
      ValueError: an unknown ``pool``.
    """
    ids = [tokenizer.encode(" " + d.title) for d in documents]
    if pool == "name_pieces":
        return sorted({t for piece_ids in ids for t in piece_ids})
    if pool != "names":
        raise ValueError(f"SFTConfig.copy_pool must be 'names' or 'name_pieces', got {pool!r}")
    single = [t[0] for t in ids if len(t) == 1]
    return single or [t[0] for t in ids if t]


def policy_format(options, tokenizer, folder=None) -> AgentFormat:
    """The ``AgentFormat`` a policy is prompted with; the trainer and the evaluation command alike.

    From-scratch models (``options.checkpoint`` empty and no ``folder``): ``AgentFormat.plain``.
    A checkpoint (``folder``, default ``options.checkpoint``): its own chat template around the
    MemPO system prompt (``AgentFormat.for_checkpoint``), per ``options.chat_template``:
    ``"auto"`` uses the template when the folder has one and the plain prompt otherwise,
    ``"require"`` insists on one, ``"none"`` always uses the plain prompt; either way the tags
    are written as ``options.tags`` says (``TagCodec``: ``"text"`` or ``"tokens"``).

    Args:
      options: a ``ModelOptions``.
      tokenizer: the policy's tokenizer (protocol tags as single ids in tokens mode).
      folder: where the tokenizer files and template live (a run folder's saved tokenizer).

    Raises:
      FileNotFoundError: ``chat_template = "require"`` and the folder has no template.
      ValueError: ``tags = "tokens"`` and a tag is not one token of ``tokenizer``, or
        ``tags = "text"`` and the tokenizer cannot write a tag (names the tag).
    """
    folder = folder or options.checkpoint
    if not folder:
        return AgentFormat.plain(tokenizer)
    has_template = (pathlib.Path(folder, "chat_template.jinja").is_file()
                    or "chat_template" in _json_or_empty(pathlib.Path(folder, "tokenizer_config.json")))
    if options.chat_template == "none" or (options.chat_template == "auto" and not has_template):
        return AgentFormat(tokenizer, TagCodec(tokenizer, options.tags))  # the plain prompt
    return AgentFormat.for_checkpoint(folder, tokenizer, tags=options.tags, tool_layout=options.tool_layout,
                                      enabled_tools=("search", "access"),
                                      system_prompt_path=options.system_prompt_path or None)


def _json_or_empty(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def load_checkpoint_policy(options, mesh=None, rules=None):
    """Model and tokenizer of a Hugging Face checkpoint folder (``ModelOptions.checkpoint``).

    The weights come from ``load_hf_checkpoint`` (float32 unless ``options.overrides`` binds
    ``dtype`` / ``param_dtype``); the tokenizer is the folder's ``tokenizer.json``.
    ``options.tags`` chooses how the protocol tags are written:

    * ``"text"`` (default): the tokenizer as it is; tags are several tokens (``TagCodec`` text mode).
    * ``"tokens"``: the 12 tags become single tokens (``HFTokenizer.with_protocol_tags``) in spare
      embedding rows or reserved specials; where those do not suffice the embedding (and an
      untied LM head) gets new rows initialised as transformers' ``resize_token_embeddings``
      (``model.resize.resize_vocab``: the old rows' mean, with its 1e-9-scaled covariance noise),
      the row count rounded up to ``vocab_row_multiple(mesh)``. The new rows are untrained until
      the SFT cold start.

    ``options.preset`` is not used: the architecture is the checkpoint's ``config.json``.

    Args:
      options: a ``ModelOptions`` with ``checkpoint`` set.
      mesh, rules: as ``load_hf_checkpoint`` (params placed straight into their sharding).

    Returns:
      ``(model_cfg, graphdef, params, tokenizer)``; ``model_cfg.vocab_size`` is the (possibly
      resized) number of embedding rows.

    Raises:
      ValueError: for an override other than ``dtype`` / ``param_dtype``;
        ``CheckpointError`` (a ``ValueError``) / ``FileNotFoundError`` for a bad or missing folder.
    """

    dtypes = dict(options.overrides)
    if set(dtypes) - {"dtype", "param_dtype"}:
        raise ValueError(f"ModelOptions.overrides {sorted(set(dtypes) - {'dtype', 'param_dtype'})} cannot change "
                         f"the architecture of checkpoint {options.checkpoint}; only dtype / param_dtype")
    if not pathlib.Path(options.checkpoint).is_dir():
        raise FileNotFoundError(f"ModelOptions.checkpoint: no such folder: {options.checkpoint} (relative to the "
                                f"working directory {pathlib.Path.cwd()})")
    if not pathlib.Path(options.checkpoint, "config.json").is_file():
        raise FileNotFoundError(f"ModelOptions.checkpoint: no config.json in {options.checkpoint}")
    rules = rules or DEFAULT_RULES
    model_cfg, graphdef, params = load_hf_checkpoint(options.checkpoint, mesh, rules, **dtypes)
    tokenizer = HFTokenizer(options.checkpoint)
    if options.tags == "text":
        return model_cfg, graphdef, params, tokenizer
    rows = protocol_tag_rows(tokenizer, model_cfg.vocab_size, mesh, rules)
    if rows > model_cfg.vocab_size:  # no spare rows / reserved tokens left: grow the embedding
        model_cfg, graphdef, params = resize_vocab(model_cfg, params, rows, mesh=mesh, rules=rules)
    return model_cfg, graphdef, params, tokenizer.with_protocol_tags(model_cfg.vocab_size)


def make_engine(graphdef, model_cfg, fmt, *, mesh=None, rules=None, param_dtype=None,
                attention_impl: str = "xla") -> RolloutEngine:
    """The policy's ``RolloutEngine``: it stops at ``fmt.codec.stop_ids`` (EOS, end-of-turn ids
    and, in tokens mode, the closing action tags) and, in text mode, at the first closing action
    tag of each row's decoded output (``fmt.codec.stop_automaton`` over the model's embedding
    rows). The one engine of the package (the trainer, the evaluation command and the benchmarks
    build it here).

    Args:
      graphdef, model_cfg: the policy model.
      fmt: its ``AgentFormat``.
      mesh, rules: the rollout mesh (default ``sharding.local_mesh()``) and ``DEFAULT_RULES``.
      param_dtype: the rollout copy's dtype (``ExecutionConfig.rollout_dtype``; ``None``: the trainer's).
      attention_impl: the decode's attention strategy (``ExecutionConfig.attention_impl``).
    """

    return RolloutEngine(graphdef, model_cfg, fmt.codec.stop_ids, fmt.tokenizer.pad_id,
                         stop_automaton=fmt.codec.stop_automaton(model_cfg.vocab_size), mesh=mesh_or_local(mesh),
                         rules=rules or DEFAULT_RULES, param_dtype=param_dtype, attention_impl=attention_impl)


def _train_tokenizer(texts, cache_dir, vocab_size: int):
    """``train_sentencepiece``; with several processes, process 0 trains (or finds) the cached model
    first and the others load it after a barrier, so no two processes write one cache file."""
    if jax.process_count() == 1:
        return train_sentencepiece(texts, cache_dir, vocab_size)
    from jax.experimental import multihost_utils

    tokenizer = train_sentencepiece(texts, cache_dir, vocab_size) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("mempo_jax tokenizer")
    return train_sentencepiece(texts, cache_dir, vocab_size) if tokenizer is None else tokenizer


def make_policy(model_cfg, graphdef, params, tokenizer, fmt, *, mesh=None, rules=None,
                rollout_tensor: int = 0, execution=None) -> Policy:
    """The one way a policy is assembled (the trainer's ``build_experiment``, the evaluation
    command): ``params`` placed on ``mesh`` by their logical-axis rules, ``make_engine`` of the
    model on this process's rollout mesh (``rollout_mesh.rollout_mesh`` of ``mesh``) and
    ``make_logits_fn``.

    Args:
      model_cfg, graphdef, params: the model (params in any placement).
      tokenizer, fmt: its tokenizer and ``AgentFormat`` (``policy_format``).
      mesh, rules: default ``sharding.local_mesh()`` and ``DEFAULT_RULES``.
      rollout_tensor: ``MeshConfig.rollout_tensor`` (0: the rollout mesh's default).
      execution: the ``ExecutionConfig`` whose ``logit_chunk_tokens`` and ``remat`` the logits
        function takes and whose ``rollout_dtype`` the engine's weight copy (default ``ExecutionConfig()``).
    """

    mesh, rules = sharding.mesh_or_local(mesh), rules or sharding.DEFAULT_RULES
    ex = execution or ExecutionConfig()
    params = sharding.shard_params(params, mesh, rules)
    local = rollout_mesh(mesh, model_cfg.num_heads, model_cfg.num_kv_heads, rollout_tensor)
    return Policy(model_cfg, graphdef, params, tokenizer, fmt, make_engine(graphdef, model_cfg, fmt, mesh=local, rules=rules,
                                                                            param_dtype=ex.rollout_param_dtype,
                                                                            attention_impl=ex.attention_impl),
                  make_logits_fn(graphdef, mesh=mesh, rules=rules, **ex.forward_options),
                  mesh, rules)


def _from_scratch(cfg: ExperimentConfig, tokenizer, mesh, rules):
    """``(model_cfg, graphdef, params)`` of a fresh ``ModelOptions.preset`` model (with its overrides)."""

    preset = cfg.model.preset
    model_cfg = ModelConfig.tiny(tokenizer.vocab_size) if preset == "tiny" else ModelConfig.preset(preset)
    if cfg.model.overrides:
        model_cfg = model_cfg.replace(**dict(cfg.model.overrides))
    return (model_cfg, *init_params(model_cfg, cfg.seed, mesh, rules))


def _check_rollout_fits(cfg: ExperimentConfig, model_cfg, engine) -> None:
    """``rollout_mesh.check_fits`` for this process's rollout: the whole model over the rollout
    mesh's ``tensor`` devices and the KV cache of its share of a step's trajectories."""

    ro = cfg.rl.rollout
    slots = num_slots(ro, -(-cfg.rl.questions_per_step // jax.process_count()) * cfg.rl.group_size)
    size = engine.sampler.cache_size(ro.max_context_tokens)
    cache = 2 * model_cfg.num_layers * slots * model_cfg.num_kv_heads * size * model_cfg.head_dim
    check_fits(model_cfg.num_params() * model_cfg.weight_dtype.itemsize, cache * model_cfg.activation_dtype.itemsize,
               engine.mesh)


def build_experiment(cfg: ExperimentConfig, cache_dir: str | pathlib.Path, *, mesh=None, rules=None,
                     scoring_chunk_rows: int | None = None) -> Experiment:
    """Build questions, corpus, BM25 tools, tokenizer (cached), model and jitted callables.

    With ``cfg.lora.enabled`` the model gets LoRA adapters (``model.adapters.add_adapters``, seeded by
    ``cfg.seed``) on its base (the checkpoint's weights or the seed's random init, in
    ``LoraConfig.base_dtype``): the trainer then trains and checkpoints the adapters alone.

    Args:
      cfg: the run's config.
      cache_dir: folder for cached artefacts (the SentencePiece model). With
        ``cfg.model.checkpoint`` set, the model and tokenizer come from that Hugging Face folder
        instead (``load_checkpoint_policy``) and no SentencePiece model is trained.
      mesh: the device mesh (default ``sharding.local_mesh()``: one device is the smallest mesh):
        params are created in (or loaded into) the shardings of their logical-axis rules
        (``model.placement.init_params``), the rollout engine (on this process's devices of it) and the memory-reward
        scorer declare shardings on it. It may span several processes (each builds the same
        questions, corpus and tools; process 0 trains the cached tokenizer first).
      rules: logical → mesh axis rules (default ``mempo_jax.core.sharding.DEFAULT_RULES``).
      scoring_chunk_rows: rows per memory-reward scorer call (``None``: the scorer's default).

    Raises:
      ValueError / FileNotFoundError: for a missing or malformed data file (names it).
    """

    mesh, rules = sharding.mesh_or_local(mesh), rules or sharding.DEFAULT_RULES
    train_q, held_q, docs, offices, backend, corpus = load_questions(cfg)
    if cfg.dataset != "tiny_world" and not docs and cfg.sft.steps > 0 and (cfg.sft.copy_fraction > 0
                                                                  or cfg.sft.copy_warmup_fraction > 0):
        raise ValueError("SFTConfig.copy_fraction and copy_warmup_fraction draw their rows from the passage titles "
                         "of a local corpus; with ExperimentConfig.retriever_url set SFTConfig.copy_fraction = 0 and "
                         "SFTConfig.copy_warmup_fraction = 0")
    if cfg.model.checkpoint:  # a Hugging Face checkpoint: its weights and tokenizer (+ protocol tags)
        model_cfg, graphdef, params, tokenizer = load_checkpoint_policy(cfg.model, mesh, rules)
    else:
        tokenizer = _train_tokenizer(tokenizer_texts(cfg, docs, train_q + held_q), cache_dir, cfg.vocab_size)
        model_cfg, graphdef, params = _from_scratch(cfg, tokenizer, mesh, rules)
    eval_env = None
    if cfg.dataset == "tiny_world" and cfg.eval_world is not None:  # entities training never saw
        world = evaluation_world(cfg, docs)
        held_q = evaluation_questions(world)
        eval_env = search_environment(BM25Index(world.documents), topk=cfg.topk)
        corpus += f"; held-out: a world of unseen entities, {len(world.documents)} passages"
    if cfg.lora.enabled:  # adapters on the frozen base (mempo_jax.model.lora)
        model_cfg, graphdef, params = add_adapters(model_cfg, params, cfg.lora, cfg.seed, mesh=mesh, rules=rules)
    policy = make_policy(model_cfg, graphdef, params, tokenizer, policy_format(cfg.model, tokenizer), mesh=mesh,
                         rules=rules, rollout_tensor=cfg.mesh.rollout_tensor, execution=cfg.execution)
    _check_rollout_fits(cfg, model_cfg, policy.engine)
    full_prefix, answer_prefix = answer_prefix_ids(tokenizer, cfg.rl.memory_reward.prefix)
    scorer = MemoryRewardScorer(policy.logits_fn, tokenizer.pad_id, answer_prefix, full_prefix=full_prefix,
                                temperature=cfg.rl.rollout.temperature or 1.0, chunk_rows=scoring_chunk_rows,
                                min_rows=max(8, sharding.batch_shards(mesh, rules)),
                                batch_sharding=sharding.logical_to_sharding(("batch", None), mesh, rules),
                                param_shardings=sharding.param_shardings(policy.params, mesh, rules))
    return Experiment(cfg, train_q, held_q, docs, offices, search_environment(backend, topk=cfg.topk), policy, scorer,
                      corpus, eval_env)


def lora_policy_params(cfg: ExperimentConfig, model_cfg: ModelConfig, adapters, *, mesh=None, rules=None):
    """The parameters of a LoRA run's policy: its base rebuilt as ``build_experiment`` builds it
    (``ModelOptions.checkpoint``'s weights, else ``cfg.seed``'s init of the base shapes) with the
    stored ``adapters`` (a checkpoint's trainable part).

    Args:
      cfg: the run's config (``RUN_DIR/config.gin``).
      model_cfg: the run's adapted ``ModelConfig`` (``RUN_DIR/model_config.json``).
      adapters: the adapters' state (``nnx.LoRAParam`` leaves).

    Raises:
      ValueError: the rebuilt model is not ``model_cfg`` (the source checkpoint changed).
      FileNotFoundError: the source checkpoint folder is gone.
    """

    mesh, rules = mesh_or_local(mesh), rules or DEFAULT_RULES
    base_cfg = base_config(model_cfg)
    if cfg.model.checkpoint:
        base_cfg, _, params, _ = load_checkpoint_policy(cfg.model, mesh, rules)
    else:
        base_cfg = base_cfg.replace(param_dtype=dict(cfg.model.overrides).get("param_dtype", "float32"))
        _, params = init_params(base_cfg, cfg.seed, mesh, rules)
    built, _, params = add_adapters(base_cfg, params, cfg.lora, cfg.seed, mesh=mesh, rules=rules)
    if built != model_cfg:
        raise ValueError(f"the base model rebuilt from the run's config ({cfg.model.checkpoint or 'seed init'}) is not "
                         "the run's model_config.json")
    return with_trainable(params, adapters)
