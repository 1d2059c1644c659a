"""The embedded default: a seeded, procedurally generated knowledge world.

The world has countries, cities, companies and people with attributes and relations. It is
rendered into a passage corpus in the Search-R1 JSONL format (``{"id", "contents":
"\\"Title\\"\\ntext"}``) and into questions of three kinds:

* ``single`` — one fact of one entity ("Where was Kalo Venn born?"): one search.
* ``bridge`` — two hops where the answer needs a fact found in the *first* hop
  ("Who runs the office of Kalo Venn's company in the city where Kalo Venn was born?"): the agent
  reads the person's passage (birth city, employer), then the company's passage (one office head
  per city). The company passage alone does not say which office is meant, so an agent that keeps
  only its ``<mem>`` must have remembered the birth city.
* ``multi`` — multi-objective: 2–4 single-hop sub-questions in one prompt, answers joined by
  ``;`` (docs/algorithm.md §1). Every earlier sub-answer must survive in ``<mem>`` until the answer turn.

Train and held-out splits share no question (they are split by question text).

Worlds that training cannot memorise (``WorldConfig.names``, ``WorldConfig.num_worlds``). The
name space (every name the syllable grammar writes) is split in two fixed shares by a hash of the
name (``name_share``): a training world draws its names from the ``"train"`` share only, an
evaluation world from the ``"eval"`` share only, so no evaluation entity can occur in any training
world of any seed; both shares are the same grammar, so their names read (and tokenise) alike.
``num_worlds`` pools independent sub-worlds with disjoint names into one training world, so that
each entity is seen a few times at most. ``names = "any"`` and ``num_worlds = 1`` (the defaults) are
the original generator, draw for draw.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Collection, Sequence

import numpy as np

from mempo_jax.tools.corpus import Document
from mempo_jax.core.validation import check

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CODAS = ["", "n", "r", "l", "s", "th", "x", "m"]
NAME_SHARES = ("any", "train", "eval")  # the values of WorldConfig.names
EVAL_SHARE_MODULUS = 4  # a name is in the "eval" share when crc32(name) % 4 == 0 (a quarter of the space)


def name_share(name: str) -> str:
    """The share of the name space a name belongs to: ``"eval"`` or ``"train"``.

    ``zlib.crc32`` of the name's UTF-8 bytes modulo ``EVAL_SHARE_MODULUS`` (0: ``"eval"``): fixed for
    every seed and platform, and independent of the syllables, so both shares hold names of every shape.
    """
    return "eval" if zlib.crc32(name.encode("utf-8")) % EVAL_SHARE_MODULUS == 0 else "train"


@dataclasses.dataclass(frozen=True)
class WorldConfig:
    """Sizes and seed of the generated world.

    Attributes:
      seed: RNG seed; the same seed gives the same world, corpus and questions.
      num_countries, num_cities, num_companies, num_people: entity counts (≥ 300 in total by default).
      offices_per_company: cities in which each company has an office (bridge questions need ≥ 2).
      multi_min, multi_max: sub-questions per multi-objective question (inclusive).
      num_single, num_bridge, num_multi: questions generated per kind (before the split).
      heldout_fraction: share of each kind's questions kept out of training.
      names: the share of the name space entity names are drawn from (``name_share``): ``"any"``
        (default: the whole space, the original worlds), ``"train"`` or ``"eval"``. A ``"train"``
        world never holds a name of an ``"eval"`` world, whatever the seeds and sizes.
      num_worlds: independent sub-worlds pooled into this one (default 1), each of the sizes above,
        its own random stream (``default_rng([seed, i])``) and names disjoint from the others'
        (question ids ``"w<i>-<kind>-<n>"``); e.g. many small training worlds whose entities are each
        seen a few times. 1 is the single world of ``default_rng(seed)``.

    Raises:
      ValueError: from ``__post_init__`` for a value out of range (names the field).
    """

    seed: int = 0
    num_countries: int = 12
    num_cities: int = 48
    num_companies: int = 60
    num_people: int = 300
    offices_per_company: int = 3
    multi_min: int = 2
    multi_max: int = 4
    num_single: int = 600
    num_bridge: int = 600
    num_multi: int = 600
    heldout_fraction: float = 0.2
    names: str = "any"
    num_worlds: int = 1

    def __post_init__(self):
        check(self, "seed", int, lo=0)
        check(self, "names", str, choices=NAME_SHARES)
        for name in ("num_countries", "num_cities", "num_companies", "num_people", "multi_min", "num_worlds"):
            check(self, name, int, lo=1)
        check(self, "offices_per_company", int, lo=2)  # bridge questions need two offices
        for name in ("num_single", "num_bridge", "num_multi"):
            check(self, name, int, lo=0)
        check(self, "multi_max", int, lo=self.multi_min)
        check(self, "heldout_fraction", float, lo=0.0, hi=1.0)
        for name in ("num_cities", "num_people"):  # the offices of a company, and their heads, are distinct
            check(self, name, int, lo=self.offices_per_company)


@dataclasses.dataclass(frozen=True)
class Question:
    """One question with its gold answers and the scripted solution path.

    Attributes:
      id: stable id (``"<kind>-<n>"``).
      kind: ``"single"``, ``"bridge"`` or ``"multi"``.
      question: the question text as the policy sees it.
      golds: one tuple of accepted aliases per objective.
      hops: the scripted agent's plan: one ``(query, facts)`` per search, where ``facts`` are the
        memory lines read from that search's top passage (``"(i) value"`` for the answer of
        objective i; ``"born in X"`` / ``"works for C"`` for a bridge's first hop).
      qa_type: a QA file's own question type (HotpotQA / 2Wiki ``type``: ``"bridge"``,
        ``"comparison"``, …), "" when the file has none or for the tiny world; the evaluation's
        per-kind breakdown uses it before ``kind`` (``evaluation.question_kind``).
    """

    id: str
    kind: str
    question: str
    golds: tuple[tuple[str, ...], ...]
    hops: tuple[tuple[str, tuple[str, ...]], ...]
    qa_type: str = ""

    @property
    def answer(self) -> str:
        """The canonical gold answer string (objectives joined by ``"; "``)."""
        return "; ".join(g[0] for g in self.golds)


@dataclasses.dataclass
class World:
    """The generated entities, corpus and question splits."""

    config: WorldConfig
    countries: list[str]
    cities: list[dict]
    companies: list[dict]
    people: list[dict]
    documents: list[Document]
    train: list[Question]
    heldout: list[Question]


def _names(rng: np.random.Generator, count: int, taken: set[str], syllables: int, share: str = "any") -> list[str]:
    """``count`` new names (added to ``taken``) from ``share`` of the name space; with ``"any"``
    every draw is kept as the original generator keeps it (the same names for the same stream)."""
    out = []
    while len(out) < count:
        parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)]
        name = "".join(parts).capitalize()
        if name not in taken and len(name) >= 4 and (share == "any" or name_share(name) == share):
            taken.add(name)
            out.append(name)
    return out


def name_inventory(count: int, seed: int, share: str = "train") -> list[str]:
    """``count`` names drawn independently from the world's name grammar (repeats possible), in
    ``share`` of the name space (``name_share``; ``"any"``: all of it): the inventory a tokenizer is
    trained on, so that it learns the grammar's pieces rather than any world's names.

    Args:
      count: names to draw (>= 0).
      seed: numpy ``default_rng`` seed.
      share: ``"any"``, ``"train"`` or ``"eval"``.

    Raises:
      ValueError: ``share`` not in ``NAME_SHARES``.
    """
    if share not in NAME_SHARES:
        raise ValueError(f"name_inventory: share must be one of {NAME_SHARES}, got {share!r}")
    rng = np.random.default_rng(seed)
    syllables = np.array([o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS])
    out: list[str] = []
    while len(out) < count:
        picks = syllables[rng.integers(len(syllables), size=(max(count - len(out), 1) * 2, 2))]
        for a, b in picks:
            name = (a + b).capitalize()
            if len(name) >= 4 and (share == "any" or name_share(name) == share):
                out.append(name)
    return out[:count]


def _single_facts(world_people, world_cities, world_companies):
    """All single-hop facts: (subject, question, answer)."""
    facts = []
    for p in world_people:
        facts.append((p["name"], f"Where was {p['name']} born?", p["born"], "city"))
        facts.append((p["name"], f"Which company does {p['name']} work for?", p["employer"], "company"))
    for c in world_cities:
        facts.append((c["name"], f"In which country is {c['name']}?", c["country"], "country"))
        facts.append((c["name"], f"Who is the mayor of {c['name']}?", c["mayor"], "person"))
    for c in world_companies:
        facts.append((c["name"], f"Who founded {c['name']}?", c["founder"], "person"))
    return facts


def build_world(cfg: WorldConfig = WorldConfig(), exclude: Collection[str] = ()) -> World:
    """Generate the world, its corpus and its question splits from ``cfg.seed``.

    Args:
      cfg: sizes, seed, name share and number of sub-worlds.
      exclude: names never drawn (e.g. a training world's, for an evaluation world of share
        ``"any"``); empty (default) changes no draw.

    Returns:
      A ``World``; ``len(documents) == countries + cities + companies + people`` (over all
      sub-worlds), each entity's passage titled by its name, passage ids ``"0"``, ``"1"``, ….

    Raises:
      ValueError: if the sizes cannot support bridge questions (fewer than 2 offices or cities).
    """
    if cfg.offices_per_company < 2 or cfg.num_cities < cfg.offices_per_company:
        raise ValueError("WorldConfig.offices_per_company must be >= 2 and <= num_cities")
    taken = set(exclude)
    if cfg.num_worlds == 1:
        return _build_one(np.random.default_rng(cfg.seed), cfg, taken)
    parts = [_build_one(np.random.default_rng([cfg.seed, i]), cfg, taken) for i in range(cfg.num_worlds)]
    docs: list[Document] = []
    for part in parts:
        docs += [dataclasses.replace(d, id=str(len(docs) + int(d.id))) for d in part.documents]

    def renamed(i: int, qs: list[Question]) -> list[Question]:
        return [dataclasses.replace(q, id=f"w{i}-{q.id}") for q in qs]

    return World(cfg, *([x for p in parts for x in getattr(p, f)] for f in ("countries", "cities", "companies", "people")),
                 docs, [q for i, p in enumerate(parts) for q in renamed(i, p.train)],
                 [q for i, p in enumerate(parts) for q in renamed(i, p.heldout)])


def entity_names(world: World) -> set[str]:
    """Every entity name of ``world`` (countries, cities, companies, people)."""
    return {*world.countries, *(c["name"] for c in world.cities), *(c["name"] for c in world.companies),
            *(p["name"] for p in world.people)}


def _build_one(rng: np.random.Generator, cfg: WorldConfig, taken: set[str]) -> World:
    """One world from ``rng``, its names from ``cfg.names`` and outside ``taken`` (added to it)."""
    countries = _names(rng, cfg.num_countries, taken, 2, cfg.names)
    city_names = _names(rng, cfg.num_cities, taken, 2, cfg.names)
    company_names = _names(rng, cfg.num_companies, taken, 2, cfg.names)
    first = _names(rng, cfg.num_people, taken, 2, cfg.names)
    people = [{"name": n} for n in first]

    cities = [
        {"name": n, "country": countries[i % len(countries)], "mayor": people[int(rng.integers(len(people)))]["name"]}
        for i, n in enumerate(city_names)
    ]
    companies = []
    for n in company_names:
        offices = [city_names[int(i)] for i in rng.choice(len(city_names), cfg.offices_per_company, replace=False)]
        heads = [people[int(i)]["name"] for i in rng.choice(len(people), cfg.offices_per_company, replace=False)]
        companies.append({
            "name": n,
            "founder": people[int(rng.integers(len(people)))]["name"],
            "city": offices[0],
            "offices": dict(zip(offices, heads)),
        })
    for p in people:
        comp = companies[int(rng.integers(len(companies)))]
        p["employer"] = comp["name"]
        # Most people are born in a city where their employer has an office (bridge questions).
        if rng.random() < 0.8:
            p["born"] = list(comp["offices"])[int(rng.integers(cfg.offices_per_company))]
        else:
            p["born"] = city_names[int(rng.integers(len(city_names)))]

    documents = _render_corpus(countries, cities, companies, people)
    questions = _make_questions(rng, cfg, cities, companies, people)
    train, heldout = _split(rng, questions, cfg.heldout_fraction)
    return World(cfg, countries, cities, companies, people, documents, train, heldout)


def _render_corpus(countries, cities, companies, people) -> list[Document]:
    docs: list[Document] = []

    def add(title: str, text: str) -> None:
        docs.append(Document(id=str(len(docs)), title=title, text=text))

    capitals = {}
    for c in cities:
        capitals.setdefault(c["country"], c["name"])
    for country in countries:
        add(country, f"{country} is a country. Its capital is {capitals.get(country, 'unknown')}.")
    for c in cities:
        add(c["name"], f"{c['name']} is a city in {c['country']}. Its mayor is {c['mayor']}.")
    for c in companies:
        offices = "; ".join(f"{city} office: {head}" for city, head in c["offices"].items())
        add(c["name"], f"{c['name']} was founded by {c['founder']}. Offices run by: {offices}.")
    for p in people:
        add(p["name"], f"{p['name']} was born in {p['born']}. {p['name']} works for {p['employer']}.")
    return docs


def _make_questions(rng, cfg: WorldConfig, cities, companies, people) -> list[Question]:
    facts = _single_facts(people, cities, companies)
    by_company = {c["name"]: c for c in companies}
    out: list[Question] = []
    seen: set[str] = set()

    def emit(kind: str, text: str, golds, hops) -> None:
        if text in seen:
            return
        seen.add(text)
        out.append(Question(f"{kind}-{len(out)}", kind, text, tuple(golds), tuple(hops)))

    for i in rng.permutation(len(facts))[: cfg.num_single]:
        subj, text, ans, _ = facts[int(i)]
        emit("single", text, [(ans,)], [(subj, (f"(1) {ans}",))])

    bridge_people = [p for p in people if p["born"] in by_company[p["employer"]]["offices"]]
    for i in rng.permutation(len(bridge_people))[: cfg.num_bridge]:
        p = bridge_people[int(i)]
        comp = by_company[p["employer"]]
        head = comp["offices"][p["born"]]
        text = f"Who runs the office of {p['name']}'s company in the city where {p['name']} was born?"
        hops = [(p["name"], (f"born in {p['born']}", f"works for {comp['name']}")), (comp["name"], (f"(1) {head}",))]
        emit("bridge", text, [(head,)], hops)

    attempts = 0
    while sum(q.kind == "multi" for q in out) < cfg.num_multi and attempts < cfg.num_multi * 10:
        attempts += 1
        k = int(rng.integers(cfg.multi_min, cfg.multi_max + 1))
        picks = [facts[int(i)] for i in rng.choice(len(facts), k, replace=False)]
        if len({p[0] for p in picks}) < k:
            continue  # distinct subjects, so every sub-question needs its own search
        text = answer_all([p[1] for p in picks])
        emit("multi", text, [(p[2],) for p in picks], [(p[0], (f"({j + 1}) {p[2]}",)) for j, p in enumerate(picks)])
    return out


def answer_all(questions: Sequence[str]) -> str:
    """The world's multi-objective prompt: ``"Answer all: (1) q1 (2) q2 …"``."""
    return "Answer all: " + " ".join(f"({j + 1}) {q}" for j, q in enumerate(questions))


def compose_objectives(singles: Sequence[Question], k: int, num: int, seed: int) -> list[Question]:
    """``num`` questions of ``k`` objectives each, from single-hop questions, in the world's own
    multi-objective layout (``answer_all``; MEM1's scaling experiment, ``benchmarks/objectives_sweep.py``).

    Each composite draws ``k`` single-hop questions with distinct subjects (so every objective
    needs its own search, and its answer comes from its own turn); objective j's fact is
    ``"(j) answer"`` as in the world's ``multi`` questions. ``k = 1`` returns single questions
    unchanged (kind ``single``).

    Args:
      singles: single-hop ``Question`` s (``kind == "single"``, e.g. ``World.heldout`` ones).
      k: objectives per question, ``1 <= k <= number of distinct subjects``.
      num: questions to make (``k = 1``: the first ``num`` of a seeded permutation).
      seed: numpy ``default_rng`` seed; the same inputs give the same questions.

    Returns:
      ``num`` ``Question`` s; kind ``multi`` (``k >= 2``), id ``"mo{k}-{i}"``.

    Raises:
      ValueError: a question that is not single-hop, ``k`` out of range, or ``num < 1``.
    """
    singles = list(singles)
    bad = [q.id for q in singles if q.kind != "single" or len(q.hops) != 1 or len(q.golds) != 1]
    if bad:
        raise ValueError(f"compose_objectives takes single-hop questions; not single: {bad[:3]}")
    subjects = {q.hops[0][0] for q in singles}
    if not isinstance(k, int) or not 1 <= k <= len(subjects):
        raise ValueError(f"k must be an int in [1, {len(subjects)}] (distinct subjects), got {k!r}")
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    rng = np.random.default_rng(seed)
    if k == 1:
        return [singles[int(i)] for i in rng.permutation(len(singles))[:num]]
    out = []
    while len(out) < num:
        picks, seen = [], set()
        for i in rng.permutation(len(singles)):
            q = singles[int(i)]
            if q.hops[0][0] not in seen:
                seen.add(q.hops[0][0])
                picks.append(q)
            if len(picks) == k:
                break
        answers = [q.golds[0][0] for q in picks]
        hops = [(q.hops[0][0], (f"({j + 1}) {a}",)) for j, (q, a) in enumerate(zip(picks, answers))]
        out.append(Question(f"mo{k}-{len(out)}", "multi", answer_all([q.question for q in picks]),
                            tuple(q.golds[0] for q in picks), tuple(hops)))
    return out


def _split(rng, questions: Sequence[Question], heldout_fraction: float):
    train, heldout = [], []
    for kind in ("single", "bridge", "multi"):
        qs = [q for q in questions if q.kind == kind]
        order = rng.permutation(len(qs))
        n_held = int(round(len(qs) * heldout_fraction))
        heldout += [qs[int(i)] for i in order[:n_held]]
        train += [qs[int(i)] for i in order[n_held:]]
    # Mix the kinds, so that any prefix of either split (EvalConfig.num_questions) has all three.
    return [train[int(i)] for i in rng.permutation(len(train))], [heldout[int(i)] for i in rng.permutation(len(heldout))]
