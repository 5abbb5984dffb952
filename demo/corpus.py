"""A seeded generator of multi-document questions about invented people and cities.

Three kinds of questions (`Example.kind`):
- "single": the fact is stated, by name, in one passage;
- "multi": two passages are needed (a person lives in a city; the city has the fact);
- "context": the fact is stated in a passage that names nobody ("Their horse? It is Veltor.")
  and refers to the subject of the passage just before it. Read alone, such a passage is
  meaningless, so answering needs attention across chunks: reusing each chunk's KV computed alone
  (full reuse) loses exactly what these questions depend on.

Distractor passages state the same relations about other entities, so that every question has
several plausible answers in its prompt and only reading (and linking) the right passages works.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

KINDS = ("single", "multi", "context")
VALIDATION_SEED = 1_000_003  # held-out questions for choosing runs (not demo.train's, 999)
TEST_SEED = 2_000_003  # held-out questions only reported: every headline figure comes from these

# The word lists keep `fmt: skip`: the formatter would spread them over one line per word.
_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "kr", "tr", "th", "sh", "h", "j", "w"]  # fmt: skip
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CODAS = ["", "", "", "", "n", "r", "l", "s", "m", "k"]

JOBS = ["baker", "farmer", "smith", "sailor", "weaver", "potter", "miner", "hunter", "healer",
        "scribe", "tailor", "mason", "brewer", "fisher", "carpenter", "merchant"]  # fmt: skip
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black", "grey",
          "brown", "silver", "golden"]  # fmt: skip

# Relations of a person and of a city: (stated by name, stated by pronoun, question). A fact is
# written as a question and its answer, so that the tokens before its value end exactly as a
# question's tokens before `Answer:` do: "... city of Braigi? It is Houstom." against "... city of
# Braigi?\nAnswer:". The subject is SUBJECT_OFFSET tokens before the value in both, the relation
# word two more; the demo model's structured initialisation (circuit.py) rests on that.
PERSON_RELATIONS = {
    r: (f"The {r} of {{s}}? It is {{v}}.", f"Their {r}? It is {{v}}.", f"What is the {r} of {{s}}?")
    for r in ("city", "job", "color", "horse")
}
CITY_RELATIONS = {
    r: (f"The {r} of {{s}}? It is {{v}}.", f"Its {r}? It is {{v}}.", f"What is the {r} of {{s}}?")
    for r in ("river", "country", "mayor")
}
SUBJECT_OFFSET = 4
# A pronoun passage's value is this far after the subject of the passage before it: "... of
# Braigi? It is Houstom.⏎⏎Their color? It is grey." (one-token values and relation words).
REFERENT_OFFSET = 13
# The relation a multi-hop question asks of the city is this far before `Answer:`'s ":" ("river
# of the city of Braigi?\nAnswer:"); its first hop reads like a question about "city".
HOP_RELATION_OFFSET = 9
MULTI_QUESTIONS = {
    "river": "What is the river of the city of {s}?",
    "country": "What is the country of the city of {s}?",
    "mayor": "What is the mayor of the city of {s}?",
}


def is_pronoun_passage(text: str) -> bool:
    """A passage that names nobody and refers to the subject of the passage before it."""
    return text.split()[0] in ("Their", "Its")


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
class Question:
    question: str
    answer: str
    kind: str


@dataclass(frozen=True)
class Example:
    question: str
    answer: str
    kind: str
    passages: tuple[str, ...]
    gold: tuple[int, ...]  # indices into `passages` that the answer needs
    # Every other question the passages answer unambiguously (training asks several at once).
    also: tuple[Question, ...] = ()


@dataclass(frozen=True)
class _Passage:
    text: str
    facts: tuple[Question, ...]


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
        """A name from the fixed pool, not yet used in the current example (or collection)."""
        if len(self._used) >= len(NAMES) * 3 // 4:
            # Rejection sampling slows as the pool empties; a collection this large is a mistake.
            raise ValueError(f"{len(self._used)} of the {len(NAMES)} names are used: too many")
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

    def named_passage(self, entity: _Entity, must: str | None, avoid: str | None) -> _Passage:
        """One or two facts about `entity` stated by name; includes `must`, never `avoid`."""
        relations = self._relations(entity)
        others = [r for r in relations if r not in (must, avoid)]
        self.rng.shuffle(others)
        chosen = ([must] if must else []) + others[: self.rng.choice((1, 1, 2)) - bool(must)]
        if not chosen:
            chosen = others[:1]
        self.rng.shuffle(chosen)
        text = " ".join(relations[r][0].format(s=entity.name, v=entity.facts[r]) for r in chosen)
        return _Passage(text, tuple(self._question(entity, r, "single") for r in chosen))

    def pronoun_passage(self, entity: _Entity, relation: str) -> _Passage:
        text = self._relations(entity)[relation][1].format(v=entity.facts[relation])
        return _Passage(text, (self._question(entity, relation, "context"),))

    def _question(self, entity: _Entity, relation: str, kind: str) -> Question:
        asked = self._relations(entity)[relation][2].format(s=entity.name)
        return Question(asked, entity.facts[relation], kind)

    # -- units: passages that must stay together, in order ----------------------------------
    def _context_unit(self, entity: _Entity, relation: str) -> list[_Passage]:
        return [self.named_passage(entity, None, relation), self.pronoun_passage(entity, relation)]

    def _distractor(self, relation: str, is_city: bool) -> list[_Passage]:
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

    def example(self, kind: str, *, keep_names: bool = False) -> Example:
        """A question of `kind` over fresh entities; with `keep_names`, none of them shares a name
        with the examples drawn since the last call without it."""
        if not keep_names:
            self._used = set()
        n_passages = self.rng.randint(self.min_passages, self.max_passages)
        gold_units: list[list[_Passage]]
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
        # Context questions get more pronoun distractors ("Their horse? It is ...") to tell apart.
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
        also: list[Question] = []
        for unit, is_gold in units:
            for passage in unit:
                if is_gold:
                    gold.append(len(passages))
                passages.append(passage.text)
                also.extend(f for f in passage.facts if f.question != question)
        return Example(question, answer, kind, tuple(passages), tuple(gold), tuple(also))

    def examples(self, count: int, weights: tuple[float, ...] = (1, 1, 1)) -> Iterator[Example]:
        for _ in range(count):
            yield self.example(self.rng.choices(KINDS, weights=weights)[0])


def named_rivals(example: Example) -> int:
    """How many passages state the asked relation by name (the gold one included): a single-hop
    question with n of them is answered by chance 1 in n if the model ignores the name."""
    for named, _, question in (PERSON_RELATIONS | CITY_RELATIONS).values():
        if example.question.startswith(question.split("{s}")[0]):
            stated = named.split("{s}")[0]  # "The city of "
            return sum(p.count(stated) for p in example.passages)
    raise ValueError(f"not a corpus question about a relation: {example.question!r}")


def held_out(count: int, seed: int = 1_000_003) -> list[Example]:
    """The evaluation set: equal thirds of each kind, from a seed training never uses."""
    generator = CorpusGenerator(seed)
    return [generator.example(KINDS[i % len(KINDS)]) for i in range(count)]


def held_out_collections(count: int, seed: int, size: int) -> list[list[Example]]:
    """`count` held-out questions (equal thirds of each kind) in collections of `size` whose
    documents share no name, so that every fact in a collection has one value: a corpus that
    retrieval over all of a collection's documents can answer (one corpus of every question
    cannot: the pool has 400 names, and other questions state other values for the same name)."""
    if size < 1:
        raise ValueError(f"a collection holds at least one question, got {size}")
    generator = CorpusGenerator(seed)
    examples = [
        generator.example(KINDS[i % len(KINDS)], keep_names=i % size != 0) for i in range(count)
    ]
    return [examples[i : i + size] for i in range(0, count, size)]
