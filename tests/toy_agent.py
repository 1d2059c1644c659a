"""A toy agent world for sharding and multi-process tests: a word-level tokenizer whose 12
protocol tags are single ids (so a tiny random model emits tags, ``<mem>`` spans and tool calls
often), a few BM25 documents, and a handful of questions. Shared by ``test_mesh_steps.py`` and
``test_multiprocess.py`` (which runs it in worker processes); imports no JAX at module level. Also
the embedded world at test size (``small_world``) for the scripted-agent tests.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from mempo_jax.text.protocol import ALL_TAG_PIECES

WORDS = ("alice", "bob", "carol", "dave", "paris", "rome", "oslo", "lima", "born", "city", "works", "at", "acme",
         "globex", "initech", "who", "where", "was", "is", "the", "of", "in", "search", "remember", "mem", "answer",
         "question", "and", "unknown", "none")
_TAG_RE = re.compile("(" + "|".join(re.escape(t) for t in ALL_TAG_PIECES) + ")")


class WordTokenizer:
    """Whitespace words + single-id protocol tags; ids 0..3 are pad, bos, eos, unk.

    ``decode`` writes a word as ``" word"`` and a tag as itself, so ``parse_turn`` sees
    ``<mem> alice bob</mem><search> paris</search>``-style text.
    """

    def __init__(self, words=WORDS):
        self.pieces = ["<pad>", "<bos>", "<eos>", "<unk>"] + list(ALL_TAG_PIECES) + sorted(set(words))
        self._ids = {p: i for i, p in enumerate(self.pieces)}
        self.vocab_size = len(self.pieces)
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3

    def encode(self, text: str) -> list[int]:
        out = []
        for part in _TAG_RE.split(text):
            if part in ALL_TAG_PIECES:
                out.append(self._ids[part])
            else:
                out += [self._ids.get(w, self.unk_id) for w in re.findall(r"[a-z0-9]+", part.lower())]
        return out

    def decode(self, ids) -> str:
        text = []
        for i in ids:
            i = int(i)
            if i in (self.pad_id, self.bos_id, self.eos_id):
                continue
            piece = self.pieces[i] if 0 <= i < self.vocab_size else "<unk>"
            text.append(piece if piece in ALL_TAG_PIECES else " " + piece)
        return "".join(text)

    def piece_id(self, piece: str) -> int:
        if piece not in self._ids:
            raise KeyError(piece)
        return self._ids[piece]


class Question(NamedTuple):
    id: str
    question: str
    golds: tuple


QUESTIONS = (
    Question("q0", "where was alice born", (("paris",),)),
    Question("q1", "who works at acme", (("bob",),)),
    Question("q2", "where is globex", (("rome",),)),
    Question("q3", "who was born in oslo", (("carol",),)),
)


def toy_world():
    """``(tokenizer, tool_env, questions)`` of the toy world (BM25 over four documents)."""
    from mempo_jax.tools.bm25 import BM25Index
    from mempo_jax.tools.corpus import Document
    from mempo_jax.tools.search import search_environment

    docs = [Document("0", "alice", "alice was born in paris"), Document("1", "acme", "bob works at acme"),
            Document("2", "globex", "globex is in rome"), Document("3", "carol", "carol was born in oslo")]
    return WordTokenizer(), search_environment(BM25Index(docs), topk=1), list(QUESTIONS)


def toy_model(vocab_size: int, seed: int = 0, std: float = 0.08):
    """A 1-layer random decoder ``(cfg, graphdef, params)``: weights normal(0, ``std``) drawn with
    numpy (no XLA compile of an init program, seconds faster on a busy CPU), norms 1, biases 0.
    ``std`` is 4× the model's init so greedy and sampled outputs vary (as ``test_sampling``)."""
    import jax
    import numpy as np

    from mempo_jax.model.config import ModelConfig
    from mempo_jax.model.forward import abstract_model, split_model

    cfg = ModelConfig.tiny(vocab_size, num_layers=1, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
                           mlp_dim=64, qkv_bias=True)
    graphdef, abstract = split_model(abstract_model(cfg))
    rng = np.random.default_rng(seed)

    def init(path, x):
        name = jax.tree_util.keystr(path)
        if "bias" in name:
            return np.zeros(x.shape, np.float32)
        if "norm" in name:
            return np.ones(x.shape, np.float32)
        return rng.normal(0.0, std, x.shape).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(init, abstract)
    return cfg, graphdef, jax.tree.map(jax.numpy.asarray, params)


class SmallWorld(NamedTuple):
    """The embedded world at test size: ``world`` (``data.world.World``), its SentencePiece
    tokenizer, the plain-tag ``AgentFormat``, BM25 search over its passages (top 1) and each
    company's offices (the scripted agent's second hop)."""

    world: object
    tok: object
    fmt: object
    env: object
    offices: dict


def small_world(spm_dir, per_kind: int = 20) -> SmallWorld:
    """The tiny world with 60 people, 20 companies, 16 cities, 4 countries and ``per_kind``
    single-hop, bridge and multi-objective questions each; its tokenizer (600 pieces) is trained
    in ``spm_dir``."""
    from mempo_jax.agent.format import AgentFormat
    from mempo_jax.data.world import WorldConfig, build_world
    from mempo_jax.run.experiment import _tokenizer_texts
    from mempo_jax.text.tokenizer import train_sentencepiece
    from mempo_jax.tools.bm25 import BM25Index
    from mempo_jax.tools.search import search_environment

    world = build_world(WorldConfig(num_people=60, num_companies=20, num_cities=16, num_countries=4,
                                    num_single=per_kind, num_bridge=per_kind, num_multi=per_kind))
    tok = train_sentencepiece(_tokenizer_texts(world.documents, world.train + world.heldout), spm_dir, 600)
    return SmallWorld(world, tok, AgentFormat.plain(tok), search_environment(BM25Index(world.documents), topk=1),
                      {c["name"]: c["offices"] for c in world.companies})
