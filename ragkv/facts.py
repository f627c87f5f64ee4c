"""Passages of invented facts and questions on them: the fidelity gate's calibration set and the
adapter's training and dev sets (other seeds), from one generator.

Every entity (person, town, company, ship, novel, lake) is invented from random syllables, so no
answer can come from the model's memory and no passage is in an evaluation split or the demo. Each
passage states four facts about one entity in 55-85 tokens; a question asks for one fact, and its
prompt holds the answer-bearing passage among distractors of the same kinds. ``eval/make_fidelity_set.py``
writes the shipped calibration set with :func:`build`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

ONSETS = "b br c ch d dr f g gr h j k l m n p pr r s st t tr v w z".split()
VOWELS = "a e i o u ai ea io ou".split()
CODAS = "n r l s th nd rk m x".split() + [""] * 4

PROFESSIONS = "cartographer violinist glassblower botanist architect beekeeper astronomer potter sculptor watchmaker surgeon linguist".split()
SUBJECTS = [
    "geology",
    "music theory",
    "chemistry",
    "medieval history",
    "marine biology",
    "mathematics",
    "painting",
    "economics",
]
PETS = [
    "a grey parrot",
    "two black cats",
    "an old sheepdog",
    "a tortoise",
    "a white rabbit",
    "three goldfish",
]
PRODUCTS = [
    "blue cheese",
    "woollen blankets",
    "clay pipes",
    "copper kettles",
    "honey cakes",
    "paper lanterns",
    "apple cider",
]
MONTHS = "January February March April May June July August September October November December".split()
GOODS = [
    "bicycles",
    "umbrellas",
    "garden tools",
    "fountain pens",
    "sewing machines",
    "kites",
    "board games",
    "hearing aids",
]
ANIMALS = ["fox", "heron", "badger", "otter", "owl", "goat", "lynx", "walrus"]
SHIP_TYPES = ["schooner", "steam ferry", "cargo barque", "fishing trawler", "paddle steamer", "brigantine"]
COLOURS = ["dark green", "bright red", "pale yellow", "navy blue", "white", "orange"]
PLOTS = [
    "searches for a lost sister",
    "builds a bridge across a frozen river",
    "inherits a failing bakery",
    "escapes from a mountain prison",
    "teaches a village to read",
    "maps an unknown island",
]
CHARACTERS = [
    "young miller",
    "retired sailor",
    "blind clockmaker",
    "travelling nurse",
    "shy librarian",
    "stubborn farmer",
]
PRIZES = ["Halvorsen Prize", "Golden Quill Award", "Marren Medal", "Ostrava Book Prize", "Lindqvist Award"]
FISH = ["silver trout", "pike", "eels", "perch", "carp"]


class Names:
    """Invented names from syllables; never the same name twice in one set."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def word(self, syllables: int) -> str:
        while True:
            w = "".join(
                self.rng.choice(ONSETS) + self.rng.choice(VOWELS) + self.rng.choice(CODAS)
                for _ in range(syllables)
            ).capitalize()
            if w not in self.used and 4 <= len(w) <= 11:
                self.used.add(w)
                return w

    def person(self) -> str:
        return f"{self.word(2)} {self.word(2)}"


@dataclass(frozen=True)
class Kind:
    """A kind of entity: ``draw`` invents its facts, named by ``fields`` (drawn always in the same order, so
    a seed gives the same set), and ``template`` states them: the passage (its lines joined by spaces), a
    blank line, then one ``question | answer`` per line, the facts named as ``str.format`` fields."""

    fields: str
    draw: Callable[[Names, random.Random], tuple[str, ...]]
    template: str

    def passage(self, n: Names, r: random.Random) -> tuple[str, list[tuple[str, str]]]:
        """A passage on a new entity of this kind and a (question, answer) for each of its facts."""
        f = dict(zip(self.fields.split(), self.draw(n, r), strict=True))
        text, qa = self.template.strip().split("\n\n")
        pairs = [line.split(" | ") for line in qa.splitlines()]
        return " ".join(text.splitlines()).format(**f), [(q.format(**f), a.format(**f)) for q, a in pairs]


def _person(n: Names, r: random.Random) -> tuple[str, ...]:
    name, prof, town = n.person(), r.choice(PROFESSIONS), n.word(2)
    year, subj, city, pet = str(r.randint(1921, 1994)), r.choice(SUBJECTS), n.word(3), r.choice(PETS)
    return name, name.split()[0], prof, town, year, subj, city, pet, n.word(2)


def _town(n: Names, r: random.Random) -> tuple[str, ...]:
    town, lake, founder = n.word(2), n.word(2), n.person()
    return town, lake, founder, str(r.randint(1150, 1890)), r.choice(PRODUCTS), r.choice(MONTHS)


def _company(n: Names, r: random.Random) -> tuple[str, ...]:
    company, city, founder, ceo = f"{n.word(2)} Works", n.word(3), n.person(), n.person()
    goods, year, animal, mascot = r.choice(GOODS), str(r.randint(1850, 2005)), r.choice(ANIMALS), n.word(2)
    return company, city, founder, ceo, goods, year, animal, mascot


def _ship(n: Names, r: random.Random) -> tuple[str, ...]:
    ship, kind, year, yard = n.word(3), r.choice(SHIP_TYPES), str(r.randint(1820, 1960)), n.word(2)
    return ship, kind, year, yard, n.person(), n.word(2), n.word(3), r.choice(COLOURS)


def _novel(n: Names, r: random.Random) -> tuple[str, ...]:
    title, author, year = f"The {n.word(2)} Road", n.person(), str(r.randint(1890, 2015))
    return title, author, year, r.choice(CHARACTERS), r.choice(PLOTS), str(r.randint(3, 40)), r.choice(PRIZES)


def _lake(n: Names, r: random.Random) -> tuple[str, ...]:
    return n.word(2), str(r.randint(12, 310)), r.choice(FISH), n.word(2), n.person()


KINDS = {
    "person": Kind(
        "name first prof town year subj city pet uni",
        _person,
        """
{name} is a {prof} from the town of {town}. Born in {year}, {first} studied {subj} at
the University of {uni} before moving to the city of {city}, where {first} still
lives today with {pet}.

What is the profession of {name}? | {prof}
In which year was {name} born? | {year}
What did {name} study at university? | {subj}
In which city does {name} live? | {city}
Which town does {name} come from? | {town}
""",
    ),
    "town": Kind(
        "town lake founder year product month",
        _town,
        """
{town} is a small town on the shore of Lake {lake}. It was founded in {year} by {founder}.
The town is famous for its {product}, and every {month} it holds a festival that draws
visitors from all over the region.

Who founded the town of {town}? | {founder}
What is the town of {town} famous for? | {product}
In which month does {town} hold its festival? | {month}
On the shore of which lake is {town}? | Lake {lake}
In which year was {town} founded? | {year}
""",
    ),
    "company": Kind(
        "company city founder ceo goods year animal mascot",
        _company,
        """
{company} is a company that makes {goods}. It was started in {year} in the city of {city} by
{founder}. Its chief executive today is {ceo}, and its mascot is a cheerful {animal} called {mascot}.

What does {company} make? | {goods}
Who is the chief executive of {company}? | {ceo}
What animal is the mascot of {company}? | {animal}
Who started {company}? | {founder}
In which city was {company} started? | {city}
""",
    ),
    "ship": Kind(
        "ship kind year yard captain port_a port_b colour",
        _ship,
        """
The {ship} is a {kind} built in {year} at the {yard} shipyard. Her first captain was {captain}.
For most of her life she sailed between the ports of {port_a} and {port_b}, and her hull was
always painted {colour}.

Who was the first captain of the {ship}? | {captain}
What colour was the hull of the {ship}? | {colour}
What kind of vessel is the {ship}? | {kind}
At which shipyard was the {ship} built? | {yard} shipyard
In which year was the {ship} built? | {year}
""",
    ),
    "novel": Kind(
        "title author year character plot langs prize",
        _novel,
        """
{title} is a novel by {author}, published in {year}. It tells the story of a {character} who
{plot}. The book has been translated into {langs} languages and won the {prize}.

Who wrote the novel {title}? | {author}
In which year was {title} published? | {year}
Which prize did {title} win? | {prize}
Into how many languages has {title} been translated? | {langs}
""",
    ),
    "lake": Kind(
        "lake depth fish island keeper",
        _lake,
        """
Lake {lake} is {depth} metres deep at its deepest point and is known for its {fish}. In the middle
of the lake lies the island of {island}, whose lighthouse was kept for forty years by {keeper}.

How deep is Lake {lake} at its deepest point? | {depth} metres
Which fish is Lake {lake} known for? | {fish}
What is the name of the island in the middle of Lake {lake}? | {island}
Who kept the lighthouse on the island in Lake {lake}? | {keeper}
""",
    ),
}


def build(seed: int, short: int, long: int, long_passages: int) -> dict:
    """The set: ``passages`` (id, kind, text) and ``questions`` (question, answers, passage ids, split).

    Each question has its own passages and its own random stream (seeded by the set's seed and the
    question's index), so a larger set begins with the smaller one's questions. Short and long
    questions alternate while both last, so any prefix of the set holds both kinds."""
    names = Names(random.Random(seed))  # one name space: no name twice in the set
    kinds = list(KINDS)
    order = []
    for i in range(max(short, long)):
        order += [("short", 4)] if i < short else []
        order += [("long", long_passages)] if i < long else []
    passages, questions = [], []
    for qi, (split, size) in enumerate(order):
        rng = random.Random(f"{seed}-{qi}")
        ids, qas = [], []
        for j in range(size):
            kind = kinds[(qi + j) % len(kinds)]
            text, qa = KINDS[kind].passage(names, rng)
            pid = f"p{len(passages):04d}"
            passages.append({"id": pid, "kind": kind, "text": text})
            ids.append(pid)
            qas.append(qa)
        gold = rng.randrange(size)
        q, a = rng.choice(qas[gold])
        rng.shuffle(ids)
        questions.append(
            {
                "id": f"{split}-{qi:03d}",
                "split": split,
                "question": q,
                "answers": [a],
                "passages": ids,
                "gold_passage": f"p{len(passages) - size + gold:04d}",
            }
        )
    return {
        "about": (
            "ragkv's fidelity calibration set: invented facts (names from random syllables), written by "
            f"eval/make_fidelity_set.py with seed {seed}; in no evaluation split and not in the demo corpus."
        ),
        "seed": seed,
        "shape": {"short": short, "long": long, "long_passages": long_passages},
        "passages": passages,
        "questions": questions,
    }
