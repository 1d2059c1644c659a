"""Building a run's components from its config: questions, corpus, tools, tokenizer, model.

``build_experiment`` is the one place that turns an ``ExperimentConfig`` into objects; the
training loop (``train.py``) and the evaluation command only consume them.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import numpy as np

from mempo_jax.agent.protocol import STOP_TAGS, render_turn
from mempo_jax.agent.rollout import build_prompt
from mempo_jax.config import ExperimentConfig
from mempo_jax.data.world import Question, build_world
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import create_model, make_logits_fn, split_model
from mempo_jax.sampling import Sampler, SamplerConfig
from mempo_jax.scoring import MemoryRewardScorer
from mempo_jax.tokenizer import train_sentencepiece
from mempo_jax.tools.bm25 import BM25Index
from mempo_jax.tools.corpus import Document
from mempo_jax.tools.search import ToolEnvironment


@dataclasses.dataclass
class Experiment:
    """Everything a run needs, built once."""

    cfg: ExperimentConfig
    train_questions: list
    heldout_questions: list
    documents: list
    offices: dict
    tokenizer: Any
    tool_env: ToolEnvironment
    model_cfg: ModelConfig
    graphdef: Any
    params: Any
    sample_fn: Any
    logits_fn: Any
    scorer: MemoryRewardScorer
    mesh: Any = None


def hotpotqa_questions(path: str) -> tuple[list[Question], list[Document]]:
    """Questions and the pooled context corpus of a HotpotQA file (HF distractor layout).

    The scripted cold-start plan searches each supporting-fact title in turn, keeps the titles
    read so far in ``<mem>`` and answers the gold answer.

    Raises:
      ValueError: naming the file, line and field of a malformed record.
    """
    from mempo_jax.data.qa_formats import hotpotqa_example, hotpotqa_supporting_titles
    from mempo_jax.tools.corpus import pool_hotpotqa_contexts
    from mempo_jax.tools.records import iter_records

    docs = pool_hotpotqa_contexts(path)
    questions = []
    for where, rec in iter_records(path):
        ex = hotpotqa_example(rec, path, where)  # question, answer, id and context checked
        titles = hotpotqa_supporting_titles(rec, path, where)
        qid, text, answer = ex.id, ex.question, ex.golds[0][0]
        hops = [(t, (f"read {t}",)) for t in titles] or [(text, ())]
        hops[-1] = (hops[-1][0], hops[-1][1] + (f"(1) {answer}",))
        questions.append(Question(qid, "hotpotqa", text, ((answer,),), tuple(hops)))
    if len(questions) < 2:
        raise ValueError(f"{path}: {len(questions)} HotpotQA questions; a run needs at least 2 (held-out and training)")
    return questions, docs


def _tokenizer_texts(documents, questions) -> list[str]:
    texts = [d.contents for d in documents] + [q.question for q in questions]
    for q in questions:  # the protocol's own phrases, as the scripted agent renders them
        for query, facts in q.hops:
            texts.append(render_turn(" " + "; ".join(facts), " search", "search", " " + query))
        texts.append(render_turn(" " + q.answer, " answer", "answer", " " + q.answer))
    texts.append("unknown none " + build_prompt.__doc__)
    return texts


def answer_prefix_ids(tokenizer) -> list[int]:
    """The ids placed between a scoring context and Z: the answer turn's own opening,
    ``<think> answer</think><answer>``, as the scripted agent renders it. It keeps
    ``P(Z | mem_traj[t])`` in distribution (a ``<mem>`` block is followed by ``<think>``) and is the
    same for both contexts, so ``R_M = P_mem − P_full`` compares the contexts alone."""
    return tokenizer.encode("<think> answer</think><answer>")


def entity_token_ids(tokenizer, documents) -> list[int]:
    """Ids of the passage titles that are single pieces (the entity names), the pool of the
    SFT copy rows; falls back to every title's first piece when none is a single piece."""
    ids = [tokenizer.encode(" " + d.title) for d in documents]
    single = [t[0] for t in ids if len(t) == 1]
    return single or [t[0] for t in ids if t]


def load_checkpoint_policy(options, mesh=None, rules=None):
    """Model and tokenizer of a Hugging Face checkpoint folder (``ModelOptions.checkpoint``).

    The weights come from ``load_hf_checkpoint`` (float32 unless ``options.overrides`` binds
    ``dtype`` / ``param_dtype``); the tokenizer is the folder's ``tokenizer.json`` with the 12
    protocol tags made single tokens in spare embedding rows or reserved tokens
    (``HFTokenizer.with_protocol_tags``), untrained until the SFT cold start. ``options.preset``
    is not used: the architecture is the checkpoint's ``config.json``.

    Args:
      options: a ``ModelOptions`` with ``checkpoint`` set.
      mesh, rules: as ``load_hf_checkpoint`` (params placed straight into their sharding).

    Returns:
      ``(model_cfg, graphdef, params, tokenizer)``.

    Raises:
      ValueError: for an override other than ``dtype`` / ``param_dtype``, or no room for a tag;
        ``CheckpointError`` (a ``ValueError``) / ``FileNotFoundError`` for a bad or missing folder.
    """
    from mempo_jax.hf_tokenizer import HFTokenizer
    from mempo_jax.model.hf_io import load_hf_checkpoint
    from mempo_jax.sharding import DEFAULT_RULES

    dtypes = dict(options.overrides)
    if set(dtypes) - {"dtype", "param_dtype"}:
        raise ValueError(f"ModelOptions.overrides {sorted(set(dtypes) - {'dtype', 'param_dtype'})} cannot change "
                         f"the architecture of checkpoint {options.checkpoint}; only dtype / param_dtype")
    if not pathlib.Path(options.checkpoint, "config.json").is_file():
        raise FileNotFoundError(f"ModelOptions.checkpoint: no config.json in {options.checkpoint}")
    model_cfg, graphdef, params = load_hf_checkpoint(options.checkpoint, mesh, rules or DEFAULT_RULES, **dtypes)
    tokenizer = HFTokenizer(options.checkpoint).with_protocol_tags(model_cfg.vocab_size)
    return model_cfg, graphdef, params, tokenizer


def _train_tokenizer(texts, cache_dir, vocab_size: int):
    """``train_sentencepiece``; with several processes, process 0 trains (or finds) the cached model
    first and the others load it after a barrier, so no two processes write one cache file."""
    if jax.process_count() == 1:
        return train_sentencepiece(texts, cache_dir, vocab_size)
    from jax.experimental import multihost_utils

    tokenizer = train_sentencepiece(texts, cache_dir, vocab_size) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("mempo_jax tokenizer")
    return train_sentencepiece(texts, cache_dir, vocab_size) if tokenizer is None else tokenizer


def build_experiment(cfg: ExperimentConfig, cache_dir: str | pathlib.Path, *, mesh=None, rules=None,
                     scoring_chunk_rows: int | None = None) -> Experiment:
    """Build questions, corpus, BM25 tools, tokenizer (cached), model and jitted callables.

    Args:
      cfg: the run's config.
      cache_dir: folder for cached artefacts (the SentencePiece model). With
        ``cfg.model.checkpoint`` set, the model and tokenizer come from that Hugging Face folder
        instead (``load_checkpoint_policy``) and no SentencePiece model is trained.
      mesh: optional device mesh: params are created in (or loaded into) the shardings of their
        logical-axis rules (``sharding.init_sharded_params``: equal to the one-device init up to
        float rounding), the sampler (and its KV cache) and the memory-reward scorer declare
        shardings on it (``None``: one device, as before). It may span several processes (each
        builds the same questions, corpus and tools; process 0 trains the cached tokenizer first).
      rules: logical → mesh axis rules (default ``mempo_jax.sharding.DEFAULT_RULES``).
      scoring_chunk_rows: rows per memory-reward scorer call (``None``: one call).

    Raises:
      ValueError / FileNotFoundError: for a missing or malformed data file (names it).
    """
    if cfg.dataset == "tiny_world":
        world = build_world(cfg.world)
        train_q, held_q, docs = world.train, world.heldout, world.documents
        offices = {c["name"]: c["offices"] for c in world.companies}
    else:
        if not pathlib.Path(cfg.data_path).is_file():
            raise FileNotFoundError(f"ExperimentConfig.data_path: no such file: {cfg.data_path}")
        questions, docs = hotpotqa_questions(cfg.data_path)
        rng = np.random.default_rng(cfg.seed)
        order = rng.permutation(len(questions))
        n_held = max(1, int(0.2 * len(questions)))
        held_q = [questions[int(i)] for i in order[:n_held]]
        train_q = [questions[int(i)] for i in order[n_held:]]
        offices = {}
    if cfg.model.checkpoint:  # a Hugging Face checkpoint: its weights and tokenizer (+ protocol tags)
        model_cfg, graphdef, params, tokenizer = load_checkpoint_policy(cfg.model, mesh, rules)
    else:
        tokenizer = _train_tokenizer(_tokenizer_texts(docs, train_q + held_q), cache_dir, cfg.vocab_size)
    tool_env = ToolEnvironment(BM25Index(docs), topk=cfg.topk)

    if not cfg.model.checkpoint:
        model_cfg = getattr(ModelConfig, cfg.model.preset)
        model_cfg = model_cfg(tokenizer.vocab_size) if cfg.model.preset == "tiny" else model_cfg()
        if cfg.model.overrides:
            model_cfg = model_cfg.replace(**dict(cfg.model.overrides))
        if mesh is None:
            graphdef, params = split_model(create_model(model_cfg, seed=cfg.seed))
        else:  # every parameter created in its sharding (no full copy on one device)
            from mempo_jax.sharding import DEFAULT_RULES, init_sharded_params

            graphdef, params = init_sharded_params(model_cfg, cfg.seed, mesh, DEFAULT_RULES if rules is None else rules)
    stop_ids = [tokenizer.eos_id] + [tokenizer.piece_id(t) for t in STOP_TAGS]
    if cfg.model.checkpoint:  # EOS ∪ generation-config EOS ∪ end-of-turn ids (<|im_end|>, …) ∪ tags
        stop_ids = list(tokenizer.stop_ids(STOP_TAGS))
    scorer_kw: dict = {"chunk_rows": scoring_chunk_rows}
    if mesh is None:
        sampler = Sampler(graphdef, model_cfg, stop_ids, tokenizer.pad_id)
    else:
        from mempo_jax import sharding

        rules = sharding.DEFAULT_RULES if rules is None else rules
        params = sharding.shard_params(params, mesh, rules)
        sampler = Sampler(graphdef, model_cfg, stop_ids, tokenizer.pad_id, mesh=mesh, rules=rules)
        scorer_kw.update(min_rows=max(8, sharding.batch_shards(mesh, rules)),
                         batch_sharding=sharding.logical_to_sharding(("batch", None), mesh, rules),
                         param_shardings=sharding.param_shardings(params, mesh, rules))

    def sample_fn(p, ids, mask, key, max_new_tokens, temperature, top_p):
        return sampler(p, ids, mask, key, SamplerConfig(int(max_new_tokens), float(temperature), float(top_p)))

    logits_fn = make_logits_fn(graphdef)
    scorer = MemoryRewardScorer(logits_fn, tokenizer.pad_id, answer_prefix_ids(tokenizer),
                                temperature=cfg.rl.rollout.temperature or 1.0, **scorer_kw)
    return Experiment(cfg, train_q, held_q, docs, offices, tokenizer, tool_env, model_cfg, graphdef, params,
                      sample_fn, logits_fn, scorer, mesh)
