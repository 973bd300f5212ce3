"""The documents of :mod:`kvlab.models.corpus`, written from a :mod:`~kvlab.models.vale_world`
world: encyclopedia entries about towns and people, short stories, and question-and-answer
sessions that open with :data:`SYSTEM_PROMPT`. Pure Python; deterministic given the generator.
"""

from __future__ import annotations

import random

from kvlab.models.vale_world import (
    ANIMAL_SOUNDS,
    ANIMALS,
    COLORS,
    HIDING_PLACES,
    MASS_TRADES,
    NUMBER_WORDS,
    OBJECTS,
    OCCUPATIONS,
    QUOTES,
    SAFE_PLACES,
    SEARCH_PLACES,
    SEASONS,
    TRAITS,
    Person,
    Pronouns,
    Town,
    World,
)

#: Common opening of every question-and-answer document (and of :func:`shared_prefix_prompts`).
SYSTEM_PROMPT = (
    "This is a conversation with the Archivist of the Vale. The Archivist knows the towns, "
    "rivers and people of the Vale, and answers every question truthfully, in one short "
    "sentence. The Archivist never makes up a name, a place or a date."
)


# --------------------------------------------------------------------------- grammar helpers


def _a(phrase: str) -> str:
    """Prefix the right indefinite article ('an honest', 'a young', 'an owl')."""
    vowel_sound = phrase[0].lower() in "aeiou" or phrase.startswith(("honest", "hour"))
    return ("an " if vowel_sound else "a ") + phrase


def _the(phrase: str) -> str:
    """Make an indefinite noun phrase definite: 'an old bridge' -> 'the old bridge'."""
    for article in ("a ", "an "):
        if phrase.startswith(article):
            return "the " + phrase[len(article):]
    return phrase


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _count(n: int, singular: str, plural: str) -> str:
    word = NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else str(n)
    return f"{word} {singular if n == 1 else plural}"


def _was(n: int) -> str:
    return "was" if n == 1 else "were"


def _population(n: int) -> str:
    return f"{n:,}"


class Writer:
    """Helpers that phrase world facts; one per document, bound to its generator."""

    def __init__(self, world: World, rng: random.Random) -> None:
        self.w = world
        self.rng = rng

    def pick(self, options):
        return self.rng.choice(options)

    def occ(self, p: Person) -> tuple[str, str, str, str, str, str]:
        return OCCUPATIONS[p.occupation]

    def animal(self, p: Person) -> tuple[str, str]:
        return ANIMALS[p.pet_animal]

    def town(self, p: Person) -> Town:
        return self.w.towns[p.town]

    def friend(self, p: Person) -> Person:
        return self.w.people[p.friend]

    def person(self) -> Person:
        return self.pick(self.w.people)


# --------------------------------------------------------------------------- documents


def _town_entry(wr: Writer) -> str:
    w = wr.w
    index = wr.rng.randrange(len(w.towns))
    t = w.towns[index]
    n0, n1 = (w.towns[j] for j in t.neighbors)
    founders = OCCUPATIONS[t.founders_occupation][1]
    lead = [
        f"{t.name} is {_a(t.size)} town in {t.region}, on the river {t.river}.",
        f"It lies {_count(t.distances[0], 'mile', 'miles')} {t.directions[0]} of {n0.name} "
        f"and {_count(t.distances[1], 'mile', 'miles')} {t.directions[1]} of {n1.name}.",
    ]
    history = [
        f"The town was founded in {t.founded} by {founders} who came up the river {t.river}.",
        f"About {_population(t.population)} people live in {t.name} today.",
    ]
    wr.rng.shuffle(history)
    culture = [
        f"{t.name} is known for its {t.trade}, which {'is' if t.trade in MASS_TRADES else 'are'}"
        f" sold in every market of {t.region}.",
        f"Visitors come to see {t.landmark}.",
        f"Every {t.festival_season} the town holds the {t.festival}, when "
        f"{t.festival_custom}.",
    ]
    residents = w.residents(index)
    paragraphs = [" ".join(lead + history), " ".join(culture)]
    if residents:
        chosen = wr.rng.sample(residents, min(len(residents), wr.rng.randint(1, 3)))
        names = [f"{w.people[i].full}, the {OCCUPATIONS[w.people[i].occupation][0]}"
                 for i in chosen]
        if len(names) == 1:
            people = f"A well-known person from {t.name} is {names[0]}."
        else:
            people = f"Well-known people from {t.name} include {', '.join(names[:-1])} and " \
                     f"{names[-1]}."
        paragraphs.append(people)
    return f"{t.name}\n\n" + "\n\n".join(paragraphs)


def _person_entry(wr: Writer) -> str:
    p = wr.person()
    pr = p.pronouns
    occ, _, workplace, product, _, present = wr.occ(p)
    animal, _ = wr.animal(p)
    t = wr.town(p)
    f = wr.friend(p)
    first = [
        f"{p.full} (born {p.born}) is {_a(occ)} from {t.name}, {_a(t.size)} town in {t.region}.",
        f"{_cap(pr.subj)} {pr.verb('is', 'are')} known for {pr.poss} {product}.",
        f"Most days {p.first} {present} at the {workplace}.",
    ]
    second = [
        f"{p.first} lives with {pr.poss} {animal}, {p.pet_name}, near {_the(t.landmark)}.",
        f"People say that {pr.subj} {pr.verb('is', 'are')} {_a(p.trait)} and "
        f"{wr.pick(TRAITS)} neighbor.",
        f"{p.first}'s favorite food is {p.food}.",
        f"{_cap(pr.subj)} {pr.verb('is', 'are')} a good friend of {f.full}, the "
        f"{OCCUPATIONS[f.occupation][0]} from {wr.w.towns[f.town].name}.",
    ]
    wr.rng.shuffle(second)
    return f"{p.full}\n\n" + " ".join(first) + "\n\n" + " ".join(second[: wr.rng.randint(2, 4)])


def _story_opening(wr: Writer, p: Person) -> list[str]:
    pr = p.pronouns
    occ, _, workplace, _, past, _ = wr.occ(p)
    animal, _ = wr.animal(p)
    t = wr.town(p)
    opening = wr.pick([
        f"Once upon a time, in the {t.size} town of {t.name}, there lived {_a(p.trait)} {occ} "
        f"named {p.first}.",
        f"{p.full} was {_a(p.trait)} {occ} who lived in {t.name}, by the river {t.river}.",
        f"In the town of {t.name}, in {t.region}, there was {_a(occ)} called {p.first}.",
    ])
    pet = wr.pick([
        f"{_cap(pr.subj)} had {_a(animal)} named {p.pet_name}, and the two of them went "
        f"everywhere together.",
        f"{p.first} lived with {pr.poss} {animal}, {p.pet_name}, in a small house with "
        f"{_a(wr.pick(COLORS))} door.",
    ])
    routine = wr.pick([
        f"Every morning, {p.first} went to the {workplace} and {past}.",
        f"Each day {pr.subj} {past} from dawn until dusk.",
    ])
    return [opening, pet, routine]


def _story_lost(wr: Writer, p: Person) -> list[str]:
    pr = p.pronouns
    animal, _ = wr.animal(p)
    f = wr.friend(p)
    obj, _ = wr.pick(OBJECTS)
    color = wr.pick(COLORS)
    places = wr.rng.sample(SEARCH_PLACES, 2)
    s = [
        f"One {wr.pick(SEASONS)} morning, {p.first} could not find {pr.poss} {color} {obj}.",
        f"{_cap(pr.subj)} looked {places[0]}, but the {obj} was not there.",
        f"{_cap(pr.subj)} looked {places[1]} too, and found only dust.",
        f"So {pr.subj} went to see {f.first}, the {OCCUPATIONS[f.occupation][0]}, and asked "
        f"for help.",
        f'"Have you seen my {obj}?" {pr.subj} asked.',
        f'"No," said {f.first}, "but {wr.pick(QUOTES)}"',
    ]
    hide = wr.pick(HIDING_PLACES)
    s.append(wr.pick([
        f"At last, {p.pet_name} the {animal} ran to the yard and came back with the {obj}.",
        f"In the end, {f.first} found the {obj} {hide}.",
        f"Just before sunset, {p.first} found the {obj} {hide}, where {p.pet_name} had "
        f"left it.",
    ]))
    s.append(f"{p.first} thanked {f.first} and shared {pr.poss} {p.food} with {f.pronouns.obj}.")
    s.append(f"From that day on, {p.first} always kept the {obj} {wr.pick(SAFE_PLACES)}.")
    return s


def _story_storm(wr: Writer, p: Person) -> list[str]:
    pr = p.pronouns
    animal, _ = wr.animal(p)
    t = wr.town(p)
    sound = ANIMAL_SOUNDS[animal]
    n = wr.rng.randint(2, 9)
    tree = wr.pick(["tree", "fence", "boat"])
    trees = {"tree": "trees", "fence": "fences", "boat": "boats"}[tree]
    return [
        f"One {wr.pick(['autumn', 'winter'])} night, a great storm came over {t.region}.",
        f"The wind shook the windows, and the river {t.river} rose higher and higher.",
        f"{p.first} was worried about {p.pet_name}, who was still outside.",
        f"{_cap(pr.subj)} put on {pr.poss} coat, took a lantern and went out into the rain.",
        f'"{p.pet_name}! {p.pet_name}!" {pr.subj} called.',
        f"At last {pr.subj} heard a sound: the {animal} {sound} {wr.pick(HIDING_PLACES)}.",
        f"{p.first} carried {p.pet_name} home and dried it by the fire.",
        f"In the morning the sky was clear, but {_count(n, tree, trees)} {_was(n)} down "
        f"along the river.",
        f"The people of {t.name} worked together all day, and by evening the town was "
        f"in order again.",
    ]


def _story_journey(wr: Writer, p: Person) -> list[str]:
    pr = p.pronouns
    t = wr.town(p)
    k = wr.rng.randrange(2)
    other = wr.w.towns[t.neighbors[k]]
    dist = t.distances[k]
    stranger_occ = wr.pick(OCCUPATIONS)
    n = wr.rng.randint(1, 9)
    obj, objs = wr.pick(OBJECTS)
    return [
        f"One day, {p.first} decided to visit {other.name}, which lies "
        f"{_count(dist, 'mile', 'miles')} {_opposite(t.directions[k])} of {t.name}.",
        f"{_cap(pr.subj)} packed some {p.food} and set off early with {p.pet_name}.",
        f"On the way, {pr.subj} met {_a(stranger_occ[0])} who was carrying "
        f"{_count(n, obj, objs)}.",
        f'"Where are you going?" asked the {stranger_occ[0]}.',
        f'"To {other.name}," said {p.first}, "to see {other.landmark}."',
        f"When {p.first} reached {other.name}, {pr.subj} saw {_the(other.landmark)} and bought "
        f"some {other.trade}.",
        f"The people of {other.name} were {wr.pick(['kind', 'friendly', 'cheerful', 'busy'])}, "
        f"and {pr.subj} stayed until the evening.",
        f"{_cap(pr.subj)} came home tired and happy, and told everyone about the journey.",
    ]


def _opposite(direction: str) -> str:
    # The distance is recorded from the other town's point of view in the world, so a journey
    # *to* that town goes the opposite way.
    swap = {"north": "south", "south": "north", "east": "west", "west": "east"}
    return "-".join(swap[part] for part in direction.split("-"))


def _story_festival(wr: Writer, p: Person) -> list[str]:
    pr = p.pronouns
    _, _, _, product, _, _ = wr.occ(p)
    t = wr.town(p)
    f = wr.friend(p)
    place = wr.rng.randint(1, 3)
    ordinal = ["first", "second", "third"][place - 1]
    return [
        f"Every {t.festival_season}, {t.name} holds the {t.festival}, when {t.festival_custom}.",
        f"This year, {p.first} wanted to win the prize for the best {product}.",
        f"{_cap(pr.subj)} worked for {_count(wr.rng.randint(2, 9), 'day', 'days')} and "
        f"{_count(wr.rng.randint(2, 9), 'night', 'nights')}.",
        f"{f.first} came to help, and together they "
        f"{wr.pick(['sang while they worked', 'laughed a great deal', 'worked without a word'])}.",
        "On the day of the festival, the judges looked at everything twice.",
        f"{p.first} won the {ordinal} prize, and {pr.subj} {pr.verb('was', 'were')} "
        f"{'very happy' if place == 1 else 'happy all the same'}.",
        f"That night everyone in {t.name} ate {p.food} and watched the lanterns over the "
        f"river {t.river}.",
    ]


def _story(wr: Writer) -> str:
    p = wr.person()
    body = wr.pick([_story_lost, _story_lost, _story_storm, _story_journey, _story_festival])
    sentences = _story_opening(wr, p) + body(wr, p)
    cut = 3
    return " ".join(sentences[:cut]) + "\n\n" + " ".join(sentences[cut:])


def qa_pair(wr: Writer) -> tuple[str, str]:
    w = wr.w
    p = wr.person()
    pr = p.pronouns
    t = wr.town(p)
    occ = wr.occ(p)
    animal, _ = wr.animal(p)
    kind = wr.rng.randrange(8)
    if kind == 0:
        return f"Where does {p.full} live?", f"{p.full} lives in {t.name}, in {t.region}."
    if kind == 1:
        return (f"What does {p.full} do?",
                f"{p.full} is {_a(occ[0])}, and {pr.subj} {_present(pr, occ[5])} at the "
                f"{occ[2]}.")
    if kind == 2:
        return (f"What is the name of {p.full}'s {animal}?",
                f"{p.full}'s {animal} is called {p.pet_name}.")
    if kind == 3:
        f = wr.friend(p)
        return f"Who is a friend of {p.full}?", f"{f.full}, the {OCCUPATIONS[f.occupation][0]}."
    tt = wr.pick(w.towns)
    if kind == 4:
        return f"What is {tt.name} known for?", f"{tt.name} is known for its {tt.trade}."
    if kind == 5:
        return f"When was {tt.name} founded?", f"{tt.name} was founded in {tt.founded}."
    if kind == 6:
        return (f"Which river runs through {tt.name}?",
                f"The river {tt.river} runs through {tt.name}.")
    return (f"What happens at the {tt.festival} in {tt.name}?",
            f"Every {tt.festival_season}, {tt.festival_custom}.")


def _present(pr: Pronouns, phrase: str) -> str:
    """Agree a third-person-singular activity with ``pr``: 'bakes bread' -> 'bake bread'."""
    if not pr.plural:
        return phrase
    verb, _, rest = phrase.partition(" ")
    if verb.endswith(("ches", "shes", "sses", "xes")):
        verb = verb[:-2]
    elif verb.endswith("ies"):
        verb = verb[:-3] + "y"
    elif verb.endswith("s"):
        verb = verb[:-1]
    return f"{verb} {rest}" if rest else verb


def _dialogue(wr: Writer) -> str:
    turns = [qa_pair(wr) for _ in range(wr.rng.randint(2, 4))]
    return SYSTEM_PROMPT + "\n\n" + "\n".join(f"User: {q}\nArchivist: {a}" for q, a in turns)


_KINDS = (
    (_town_entry, 2),
    (_person_entry, 2),
    (_story, 4),
    (_dialogue, 2),
)


def generate_document(world: World, rng: random.Random) -> str:
    """One document drawn with ``rng`` from ``world`` (a town or person entry, story or Q&A)."""
    wr = Writer(world, rng)
    total = sum(weight for _, weight in _KINDS)
    roll = rng.randrange(total)
    for make, weight in _KINDS:
        if roll < weight:
            return make(wr)
        roll -= weight
    raise AssertionError("unreachable")  # pragma: no cover
