"""Worlds training cannot memorise: the name-space shares, pooled training worlds, the evaluation
world of unseen entities, and a tokenizer under which unseen names read like trained ones."""

import hashlib
import json
import pathlib
import re
import zlib

import numpy as np
import pytest

from mempo_jax.config_loader import load_config
from mempo_jax.data.world import (EVAL_SHARE_MODULUS, WorldConfig, build_world, entity_names, name_inventory,
                                  name_share)

REPO = pathlib.Path(__file__).resolve().parents[2]

# sha256 of the default world's passages and questions (``_digest``), computed with the generator
# before WorldConfig.names / num_worlds existed (commit 5b59d6e): the SmolLM2 world recipe's
# committed results rest on this world.
DEFAULT_WORLD_SHA256 = "63ec2e6f37d95a07765d9a25d998a66f596f1130e0ac6d22b0d4bb629b8e1b2f"
SMALL_WORLD_SHA256 = "acabf315e00106b3acbd67782f41096c20f208ae3dca3d05d1ef94edfaedbde8"  # seed 3, 120 people, 50 single

SMALL = dict(num_countries=3, num_cities=8, num_companies=10, num_people=40, num_single=40, num_bridge=30,
             num_multi=40)


def _digest(world) -> str:
    h = hashlib.sha256()
    for d in world.documents:
        h.update(json.dumps([d.id, d.title, d.text]).encode())
    for q in world.train + world.heldout:
        h.update(json.dumps([q.id, q.kind, q.question, q.golds, q.hops]).encode())
    return h.hexdigest()


def _sub_questions(question: str) -> list[str]:
    """The sub-questions of a tiny-world question (one, or the parts of ``answer_all``)."""
    if not question.startswith("Answer all: "):
        return [question]
    return [p.strip() for p in re.split(r"\(\d+\) ", question[len("Answer all: "):]) if p.strip()]


def _pairs(questions) -> set[tuple[str, str]]:
    """(sub-question, answer) pairs of a list of questions."""
    return {(sq, g[0]) for q in questions for sq, g in zip(_sub_questions(q.question), q.golds)}


def test_the_default_world_is_the_original_generator_draw_for_draw():
    assert _digest(build_world()) == DEFAULT_WORLD_SHA256
    assert _digest(build_world(WorldConfig(seed=3, num_people=120, num_single=50))) == SMALL_WORLD_SHA256
    # the SmolLM2 world recipe (which includes tiny_world.gin) pins the original world
    cfg = load_config([str(REPO / "configs" / "smollm2_tiny_world.gin")])
    assert cfg.eval_world is None and _digest(build_world(cfg.world)) == DEFAULT_WORLD_SHA256


def test_name_share_is_a_fixed_hash_partition():
    names = name_inventory(4000, seed=5, share="any")
    shares = [name_share(n) for n in names]
    assert shares == ["eval" if zlib.crc32(n.encode()) % EVAL_SHARE_MODULUS == 0 else "train" for n in names]
    assert 0.2 < shares.count("eval") / len(shares) < 0.3  # a quarter of the space
    assert {name_share(n) for n in name_inventory(300, seed=6, share="eval")} == {"eval"}
    assert {name_share(n) for n in name_inventory(300, seed=6, share="train")} == {"train"}
    with pytest.raises(ValueError, match="share must be one of"):
        name_inventory(3, 0, share="test")


@pytest.mark.parametrize("seed", [0, 7])
def test_no_evaluation_entity_occurs_in_any_training_world(seed):
    """Training worlds of several seeds and sizes hold no name of an evaluation world, and no
    (sub-question, answer) pair of it; nor does any training passage or question mention one."""
    evaluation = build_world(WorldConfig(seed=seed, names="eval", **SMALL))
    eval_names = entity_names(evaluation)
    assert {name_share(n) for n in eval_names} == {"eval"}
    eval_questions = evaluation.train + evaluation.heldout
    for cfg in (WorldConfig(seed=seed, names="train", **SMALL),
                WorldConfig(seed=seed + 1, names="train", num_worlds=3, **SMALL)):
        training = build_world(cfg)
        names = entity_names(training)
        assert {name_share(n) for n in names} == {"train"}
        assert not names & eval_names
        words = {w for d in training.documents for w in re.findall(r"[A-Z][a-z]+", d.contents)}
        words |= {w for q in training.train + training.heldout for w in re.findall(r"[A-Z][a-z]+", q.question)}
        assert not words & eval_names
        assert not _pairs(training.train + training.heldout) & _pairs(eval_questions)


def test_the_main_jobs_evaluation_world_is_unseen():
    """configs/tiny_world.gin: the held-out questions are a world apart from the training worlds."""
    from mempo_jax.run.experiment import evaluation_questions, evaluation_world

    cfg = load_config([str(REPO / "configs" / "tiny_world.gin")])
    training = build_world(cfg.world)
    evaluation = evaluation_world(cfg, training.documents)
    held = evaluation_questions(evaluation)
    assert cfg.world.names == "train" and cfg.eval_world.names == "eval" and cfg.eval_world.num_worlds == 1
    assert not entity_names(training) & entity_names(evaluation)
    assert not _pairs(training.train + training.heldout) & _pairs(held)
    kinds = [q.kind for q in held]
    assert {k: kinds.count(k) for k in set(kinds)} == {"single": 100, "bridge": 100, "multi": 100}
    assert len({q.id for q in held}) == len(held)


def test_an_evaluation_world_of_any_share_avoids_the_training_worlds_names():
    """``exclude``: an evaluation world beside a training world of share "any" (the original world)."""
    training = build_world(WorldConfig(**SMALL))
    evaluation = build_world(WorldConfig(seed=1, **SMALL), exclude=entity_names(training))
    assert not entity_names(training) & entity_names(evaluation)
    assert _digest(build_world(WorldConfig(**SMALL), exclude=())) == _digest(training)


def test_an_evaluation_world_is_sized_by_its_config():
    """>= 200 bridge and >= 200 multi-objective questions, as a larger recipe asks."""
    world = build_world(WorldConfig(seed=2, names="eval", num_people=400, num_single=100, num_bridge=200,
                                    num_multi=200, heldout_fraction=1.0))
    kinds = [q.kind for q in world.heldout]
    assert (kinds.count("single"), kinds.count("bridge"), kinds.count("multi")) == (100, 200, 200)
    assert world.train == []


def test_pooled_worlds_are_disjoint_and_self_contained():
    """num_worlds: names disjoint across sub-worlds, unique ids, and every hop's passage is in the pool."""
    cfg = WorldConfig(seed=4, names="train", num_worlds=3, **SMALL)
    world = build_world(cfg)
    assert len(world.documents) == 3 * (3 + 8 + 10 + 40) == len(entity_names(world))
    assert [d.id for d in world.documents] == [str(i) for i in range(len(world.documents))]
    questions = world.train + world.heldout
    assert len({q.id for q in questions}) == len(questions)
    assert {q.id.split("-")[0] for q in questions} == {"w0", "w1", "w2"}
    titles = {d.title: d for d in world.documents}
    for q in questions:
        for query, facts in q.hops:
            text = titles[query].text
            for fact in facts:
                assert fact.split(" ", 1)[1].removeprefix("in ").removeprefix("for ") in text


def test_unseen_names_tokenize_like_trained_ones(tmp_path):
    """The tokenizer of a ``names = "train"`` run is trained on redrawn names: no training name is
    one piece, and the evaluation world's names split into as many pieces as the training ones."""
    from mempo_jax.run.experiment import tokenizer_texts
    from mempo_jax.text.tokenizer import train_sentencepiece

    cfg = load_config([str(REPO / "configs" / "tiny_world.gin")], ["WorldConfig.num_worlds=2"])
    training = build_world(cfg.world)
    evaluation = build_world(cfg.eval_world)
    texts = tokenizer_texts(cfg, training.documents, training.train + training.heldout)
    mentioned = {w for t in texts for w in re.findall(r"[A-Z][a-z]+", t)}
    assert len(mentioned & entity_names(training)) < 0.05 * len(entity_names(training))  # only chance re-draws
    tok = train_sentencepiece(texts, tmp_path, cfg.vocab_size)
    pieces = {}
    for name, world in (("train", training), ("eval", evaluation)):
        pieces[name] = np.array([len(tok.encode(" " + n)) for n in sorted(entity_names(world))])
        assert (pieces[name] >= 2).all(), name  # no name is an atom
    assert abs(pieces["train"].mean() - pieces["eval"].mean()) < 0.1


def test_the_seed_comparisons_unseen_world_shares_nothing_with_the_smollm2_recipes_world():
    """benchmarks/seed_arms.py: the SmolLM2 world recipe trains on the original world (names from the
    whole name space); the comparison's unseen world has none of its entity names and none of its
    (sub-question, answer) pairs, and holds at least 200 bridge and 200 multi-objective questions."""
    import sys
    from collections import Counter

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    import seed_arms

    train = build_world(WorldConfig())
    world, questions = seed_arms.unseen_world(WorldConfig(), 1, 250, 250, 100)
    kinds = Counter(q.kind for q in questions)
    assert kinds["bridge"] >= 200 and kinds["multi"] >= 200
    assert not entity_names(world) & entity_names(train)
    assert _pairs(questions) and not _pairs(questions) & _pairs(train.train + train.heldout)
