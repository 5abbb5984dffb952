"""A seeded generator of multi-document questions about invented people and cities.

Three kinds of questions (`Example.kind`):
- "single": the fact is stated, by name, in one passage;
- "multi": two passages are needed (a person lives in a city; the city has the fact);
- "context": the fact is stated in a passage that names nobody ("They ride a horse called
  Veltor.") and refers to the subject of the passage just before it. Read alone, such a passage
  is meaningless, so answering needs attention across chunks: reusing each chunk's KV computed
  alone (full reuse) loses exactly what these questions depend on.

Distractor passages state the same relations about other entities, so that every question has
several plausible answers in its prompt and only reading (and linking) the right passages works.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

KINDS = ("single", "multi", "context")

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "kr", "tr", "th", "sh", "h", "j", "w"]  # fmt: skip
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CODAS = ["", "", "", "", "n", "r", "l", "s", "m", "k"]

JOBS = ["baker", "farmer", "smith", "sailor", "weaver", "potter", "miner", "hunter", "healer",
        "scribe", "tailor", "mason", "brewer", "fisher", "carpenter", "merchant"]  # fmt: skip
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black", "grey",
          "brown", "silver", "golden"]  # fmt: skip

# Relations of a person (P) and of a city (C): (stated by name, stated by pronoun, question).
PERSON_RELATIONS = {
    "city": ("{s} lives in {v}.", "They live in {v}.", "Where does {s} live?"),
    "job": ("{s} works as a {v}.", "They work as a {v}.", "What is the job of {s}?"),
    "color": ("{s} likes the color {v}.", "They like the color {v}.", "Which color does {s} like?"),
    "horse": (
        "{s} rides a horse called {v}.",
        "They ride a horse called {v}.",
        "What is the name of the horse of {s}?",
    ),
}
CITY_RELATIONS = {
    "river": ("{s} lies on the river {v}.", "It lies on the river {v}.", "On which river is {s}?"),
    "country": ("{s} is a city in {v}.", "It is a city in {v}.", "In which country is {s}?"),
    "mayor": ("The mayor of {s} is {v}.", "Its mayor is {v}.", "Who is the mayor of {s}?"),
}
# Two-hop questions: the person's city, then a fact of that city.
MULTI_QUESTIONS = {
    "river": "On which river is the city where {s} lives?",
    "country": "In which country does {s} live?",
    "mayor": "Who is the mayor of the city where {s} lives?",
}


def _name_pool(size: int, seed: int = 12345) -> tuple[str, ...]:
    """Invented two-syllable names. The pool is fixed (the tokenizer learns each name as one
    token); which name has which facts is drawn afresh for every example."""
    rng = random.Random(seed)
    names: set[str] = set()
    while len(names) < size:
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(2)
        )
        if 4 <= len(word) <= 8:
            names.add(word.capitalize())
    return tuple(sorted(names))


NAMES = _name_pool(400)


@dataclass(frozen=True)
class Example:
    question: str
    answer: str
    kind: str
    passages: tuple[str, ...]
    gold: tuple[int, ...]  # indices into `passages` that the answer needs


@dataclass
class _Entity:
    name: str
    is_city: bool
    facts: dict[str, str]


class CorpusGenerator:
    """Deterministic for a seed; every call draws fresh invented entities."""

    def __init__(self, seed: int, min_passages: int = 3, max_passages: int = 6):
        self.rng = random.Random(seed)
        self.min_passages = min_passages
        self.max_passages = max_passages
        self._used: set[str] = set()
        self.context_share = 0.45

    # -- entities --------------------------------------------------------------------------
    def name(self) -> str:
        """A name from the fixed pool, not yet used in the current example."""
        while True:
            word = self.rng.choice(NAMES)
            if word not in self._used:
                self._used.add(word)
                return word

    def _value(self, relation: str) -> str:
        if relation == "job":
            return self.rng.choice(JOBS)
        if relation == "color":
            return self.rng.choice(COLORS)
        return self.name()

    def person(self) -> _Entity:
        return _Entity(self.name(), False, {r: self._value(r) for r in PERSON_RELATIONS})

    def city(self) -> _Entity:
        return _Entity(self.name(), True, {r: self._value(r) for r in CITY_RELATIONS})

    def entity(self, is_city: bool) -> _Entity:
        return self.city() if is_city else self.person()

    # -- passages ------------------------------------------------------------------------
    @staticmethod
    def _relations(entity: _Entity) -> dict[str, tuple[str, str, str]]:
        return CITY_RELATIONS if entity.is_city else PERSON_RELATIONS

    def named_passage(self, entity: _Entity, must: str | None, avoid: str | None) -> str:
        """One or two facts about `entity` stated by name; includes `must`, never `avoid`."""
        relations = self._relations(entity)
        others = [r for r in relations if r not in (must, avoid)]
        self.rng.shuffle(others)
        chosen = ([must] if must else []) + others[: self.rng.choice((1, 1, 2)) - bool(must)]
        if not chosen:
            chosen = others[:1]
        self.rng.shuffle(chosen)
        return " ".join(relations[r][0].format(s=entity.name, v=entity.facts[r]) for r in chosen)

    def pronoun_passage(self, entity: _Entity, relation: str) -> str:
        return self._relations(entity)[relation][1].format(v=entity.facts[relation])

    # -- units: passages that must stay together, in order ----------------------------------
    def _context_unit(self, entity: _Entity, relation: str) -> list[str]:
        return [self.named_passage(entity, None, relation), self.pronoun_passage(entity, relation)]

    def _distractor(self, relation: str, is_city: bool) -> list[str]:
        """Mostly hard distractors: the same relation about another entity of the same kind."""
        roll = self.rng.random()
        if roll < 0.75:
            entity = self.entity(is_city)
            rel = relation if relation in self._relations(entity) else None
        else:
            entity = self.entity(not is_city)
            rel = None
        if rel is None:
            rel = self.rng.choice(list(self._relations(entity)))
        if self.rng.random() < self.context_share:
            return self._context_unit(entity, rel)
        return [self.named_passage(entity, rel, None)]

    def example(self, kind: str) -> Example:
        self._used = set()
        n_passages = self.rng.randint(self.min_passages, self.max_passages)
        gold_units: list[list[str]]
        if kind == "single":
            is_city = self.rng.random() < 0.4
            subject = self.entity(is_city)
            relation = self.rng.choice(list(self._relations(subject)))
            gold_units = [[self.named_passage(subject, relation, None)]]
            question = self._relations(subject)[relation][2].format(s=subject.name)
            answer = subject.facts[relation]
        elif kind == "multi":
            person, city = self.person(), self.city()
            person.facts["city"] = city.name
            relation = self.rng.choice(list(MULTI_QUESTIONS))
            gold_units = [
                [self.named_passage(person, "city", None)],
                [self.named_passage(city, relation, None)],
            ]
            question = MULTI_QUESTIONS[relation].format(s=person.name)
            answer = city.facts[relation]
            is_city = True
        elif kind == "context":
            is_city = self.rng.random() < 0.4
            subject = self.entity(is_city)
            relation = self.rng.choice(list(self._relations(subject)))
            gold_units = [self._context_unit(subject, relation)]
            question = self._relations(subject)[relation][2].format(s=subject.name)
            answer = subject.facts[relation]
        else:
            raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        # Context questions get more pronoun distractors: several "They ride..." to tell apart.
        self.context_share = 0.65 if kind == "context" else 0.4
        units = [(unit, True) for unit in gold_units]
        count = sum(len(u) for u in gold_units)
        # Multi-hop distractors: other people living in other cities, other cities' facts.
        if kind == "context" and count + 2 <= n_passages:
            # A rival pronoun passage with the same relation: only the link to the passage
            # before it says whose fact it is.
            units.append((self._context_unit(self.entity(is_city), relation), False))
            count += 2
        while count < n_passages:
            if kind == "multi" and self.rng.random() < 0.5:
                unit = self._distractor("city", False)
            else:
                unit = self._distractor(relation, is_city)
            if count + len(unit) > n_passages:
                unit = unit[:1]
            units.append((unit, False))
            count += len(unit)
        self.rng.shuffle(units)
        passages: list[str] = []
        gold: list[int] = []
        for unit, is_gold in units:
            for text in unit:
                if is_gold:
                    gold.append(len(passages))
                passages.append(text)
        return Example(question, answer, kind, tuple(passages), tuple(gold))

    def examples(self, count: int, weights: tuple[float, ...] = (1, 1, 1)) -> Iterator[Example]:
        for _ in range(count):
            yield self.example(self.rng.choices(KINDS, weights=weights)[0])


def held_out(count: int, seed: int = 1_000_003) -> list[Example]:
    """The evaluation set: equal thirds of each kind, from a seed training never uses."""
    generator = CorpusGenerator(seed)
    return [generator.example(KINDS[i % len(KINDS)]) for i in range(count)]
