"""The Vale: a seeded, procedurally generated English corpus for kvlab's shipped models.

The shipped models (``kvlab-tiny`` and its draft) are trained on text that this module writes
from scratch: no downloaded data, no network, no third-party text. A seed fixes a small *world*
(regions, towns, rivers, people with jobs, pets, friends and pronouns) and every document is
drawn from that world, so facts recur across documents (Mira Tallow always lives in the same
town and keeps the same dog) and the grammar agrees (``she lives`` / ``they live``, ``one goat
was`` / ``three goats were``, ``a`` / ``an``). Four kinds of document are written:

- encyclopedia entries about towns,
- encyclopedia entries about people,
- short stories in the past tense (lost things, storms, journeys, festivals),
- question-and-answer sessions that all open with the same :data:`SYSTEM_PROMPT`, which gives
  the book prompts sharing a long common prefix (handy for prefix caching).

Contract: everything here is pure Python (no torch), and output depends only on the arguments,
never on ``PYTHONHASHSEED``, dict order of other modules or the clock. Document ``i`` of seed
``s`` is drawn from its own generator, so ``generate_corpus(s, n)`` is a prefix of
``generate_corpus(s, n + k)`` and held-out documents are cheap to produce (``start=``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

__all__ = [
    "CORPUS_SEED",
    "SYSTEM_PROMPT",
    "Person",
    "Town",
    "World",
    "build_world",
    "corpus_words",
    "generate_corpus",
    "generate_document",
    "qa_examples",
    "sample_prompts",
    "shared_prefix_prompts",
]

#: Seed of the world and corpus the shipped models were trained on.
CORPUS_SEED = 0

#: Common opening of every question-and-answer document (and of :func:`shared_prefix_prompts`).
SYSTEM_PROMPT = (
    "This is a conversation with the Archivist of the Vale. The Archivist knows the towns, "
    "rivers and people of the Vale, and answers every question truthfully, in one short "
    "sentence. The Archivist never makes up a name, a place or a date."
)

# --------------------------------------------------------------------------- word lists
# Written for this project. Plural forms are explicit wherever English is irregular.

_ONSETS = [
    "b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s",
    "st", "t", "th", "tr", "v", "w", "z", "sh", "ch", "el", "al", "or", "ar", "",
]
_NUCLEI = ["a", "e", "i", "o", "u", "a", "e", "o", "i", "ea", "ia", "ou", "y"]
_CODAS = ["", "", "", "", "", "n", "r", "l", "s", "th", "m", "nd", "rn", "ck", "ll", "t"]
_TOWN_SUFFIXES = [
    "ford", "wick", "moor", "dale", "holm", "by", "stead", "mouth", "bridge", "ton",
    "field", "haven", "mere", "well", "combe",
]
_REGION_KINDS = ["Vale", "Hills", "Coast", "Marshes", "Plains", "Woods"]

# (occupation, plural, workplace, product, activity in the past tense, activity in the present)
_OCCUPATIONS = [
    ("baker", "bakers", "bakery", "honey bread", "baked bread", "bakes bread"),
    ("potter", "potters", "workshop", "blue bowls", "shaped clay pots", "shapes clay pots"),
    ("weaver", "weavers", "loom house", "wool blankets", "wove blankets", "weaves blankets"),
    ("fisher", "fishers", "harbor", "smoked fish", "mended the nets", "mends the nets"),
    ("miller", "millers", "mill", "fine flour", "ground the wheat", "grinds the wheat"),
    ("smith", "smiths", "forge", "iron gates", "hammered hot iron", "hammers hot iron"),
    ("carpenter", "carpenters", "workshop", "oak chairs", "built tables", "builds tables"),
    ("shepherd", "shepherds", "hillside", "soft wool", "counted the sheep", "counts the sheep"),
    ("teacher", "teachers", "school", "patient lessons", "taught the children",
     "teaches the children"),
    ("doctor", "doctors", "clinic", "herbal remedies", "visited the sick", "visits the sick"),
    ("sailor", "sailors", "harbor", "long voyages", "sailed the river", "sails the river"),
    ("farmer", "farmers", "farm", "sweet apples", "worked in the fields",
     "works in the fields"),
    ("tailor", "tailors", "shop", "green coats", "sewed coats", "sews coats"),
    ("painter", "painters", "studio", "bright paintings", "painted pictures",
     "paints pictures"),
    ("gardener", "gardeners", "garden", "tall sunflowers", "watered the flowers",
     "waters the flowers"),
    ("merchant", "merchants", "market", "fair prices", "sold spices", "sells spices"),
    ("scribe", "scribes", "library", "careful letters", "copied old books",
     "copies old books"),
    ("cook", "cooks", "kitchen", "onion stew", "cooked soup", "cooks soup"),
    ("glassblower", "glassblowers", "glass house", "green bottles", "blew glass",
     "blows glass"),
    ("bookbinder", "bookbinders", "bindery", "leather books", "bound books", "binds books"),
    ("clockmaker", "clockmakers", "workshop", "silver clocks", "mended clocks",
     "mends clocks"),
    ("beekeeper", "beekeepers", "orchard", "golden honey", "tended the bees",
     "tends the bees"),
    ("brewer", "brewers", "brewery", "apple cider", "brewed cider", "brews cider"),
    ("mason", "masons", "quarry", "stone walls", "cut stone", "cuts stone"),
    ("candlemaker", "candlemakers", "shop", "beeswax candles", "dipped candles",
     "dips candles"),
    ("ferryman", "ferrymen", "ferry", "safe crossings", "rowed the ferry",
     "rows the ferry"),
    ("herbalist", "herbalists", "garden", "mint tea", "dried herbs", "dries herbs"),
    ("mapmaker", "mapmakers", "study", "careful maps", "drew maps", "draws maps"),
    ("musician", "musicians", "hall", "cheerful songs", "played the fiddle",
     "plays the fiddle"),
    ("librarian", "librarians", "library", "quiet reading rooms", "sorted the books",
     "sorts the books"),
    ("innkeeper", "innkeepers", "inn", "warm rooms", "served the travelers",
     "serves the travelers"),
    ("cobbler", "cobblers", "shop", "sturdy boots", "mended shoes", "mends shoes"),
    ("lamplighter", "lamplighters", "square", "bright streets", "lit the lamps",
     "lights the lamps"),
    ("astronomer", "astronomers", "tower", "star charts", "watched the stars",
     "watches the stars"),
]

# (animal, plural)
_ANIMALS = [
    ("dog", "dogs"), ("cat", "cats"), ("goat", "goats"), ("donkey", "donkeys"),
    ("horse", "horses"), ("goose", "geese"), ("crow", "crows"), ("owl", "owls"),
    ("rabbit", "rabbits"), ("fox", "foxes"), ("pony", "ponies"), ("parrot", "parrots"),
    ("tortoise", "tortoises"), ("hen", "hens"), ("duck", "ducks"), ("mouse", "mice"),
    ("ferret", "ferrets"), ("lamb", "lambs"), ("pig", "pigs"), ("hedgehog", "hedgehogs"),
]
_ANIMAL_SOUNDS = {
    "dog": "barked", "cat": "mewed", "goat": "bleated", "donkey": "brayed", "horse": "neighed",
    "goose": "honked", "crow": "cawed", "owl": "hooted", "rabbit": "thumped its foot",
    "fox": "yipped", "pony": "neighed", "parrot": "squawked", "tortoise": "blinked slowly",
    "hen": "clucked", "duck": "quacked", "mouse": "squeaked", "ferret": "chattered",
    "lamb": "bleated", "pig": "grunted", "hedgehog": "snuffled",
}
_FOODS = [
    "apple pie", "plum cake", "fish soup", "honey bread", "onion stew", "pear tart",
    "barley porridge", "goat cheese", "roasted chestnuts", "mushroom pie", "cherry jam",
    "potato cakes", "pumpkin soup", "walnut bread", "berry pudding", "baked pears",
    "carrot soup", "oat biscuits", "lemon cake", "bean stew",
]
# (object, plural)
_OBJECTS = [
    ("key", "keys"), ("hat", "hats"), ("ring", "rings"), ("scarf", "scarves"),
    ("lantern", "lanterns"), ("book", "books"), ("map", "maps"), ("flute", "flutes"),
    ("coin", "coins"), ("letter", "letters"), ("basket", "baskets"), ("compass", "compasses"),
    ("spoon", "spoons"), ("bell", "bells"), ("kite", "kites"), ("boot", "boots"),
    ("glove", "gloves"), ("umbrella", "umbrellas"), ("whistle", "whistles"),
    ("notebook", "notebooks"), ("button", "buttons"), ("shell", "shells"),
]
_COLORS = [
    "red", "blue", "green", "yellow", "brown", "grey", "white", "black", "orange",
    "purple", "silver", "golden",
]
_TRAITS = [
    "kind", "clever", "shy", "brave", "curious", "patient", "cheerful", "stubborn",
    "careful", "generous", "quiet", "proud", "gentle", "honest", "forgetful", "busy",
    "old", "young", "tall", "friendly", "hardworking", "clumsy", "wise", "thoughtful",
]
_SEARCH_PLACES = [
    "under the bed", "behind the stove", "in the kitchen drawer", "on every shelf",
    "under the table", "in the garden", "behind the door", "in the coat pocket",
    "inside the cupboard", "under the stairs", "in the attic", "by the window",
]
_HIDING_PLACES = [
    "behind the woodpile", "inside an old boot", "under a flower pot", "in the hay loft",
    "beneath the bridge", "at the bottom of a basket", "on the roof of the shed",
    "in the hollow of a tree", "under a pile of leaves", "beside the well",
    "inside the rain barrel", "under the garden bench",
]
_SAFE_PLACES = [
    "on a hook by the door", "in a small wooden box", "on the shelf above the fire",
    "in the top drawer", "on a string around the neck", "next to the clock",
]
# Things towns are known for; the second name lists the mass nouns ("which is sold").
_TRADES = [
    "copper bells", "blue glass", "wool blankets", "apple cider", "paper lanterns",
    "river pearls", "salted fish", "silver clocks", "wild honey", "sheep cheese",
    "painted boats", "leather boots", "rose soap", "walnut furniture", "linen cloth",
    "clay pots", "black tea", "plum brandy", "woven baskets", "stone carvings",
]
_MASS_TRADES = frozenset({
    "blue glass", "apple cider", "salted fish", "wild honey", "sheep cheese", "rose soap",
    "walnut furniture", "linen cloth", "black tea", "plum brandy",
})
_LANDMARKS = [
    "an old stone bridge", "a tall clock tower", "a round library", "a windmill on the hill",
    "a harbor full of red boats", "a great oak tree", "the ruins of a castle",
    "a painted town gate", "a deep stone well", "a white lighthouse", "a covered market",
    "a garden of tall poplars", "a narrow wooden pier", "a chapel with a green roof",
    "a long stone wall", "a hot spring",
]
_SIZES = ["small", "quiet", "busy", "old", "pretty", "large", "sleepy", "windy"]
_DIRECTIONS = [
    "north", "south", "east", "west", "north-east", "north-west", "south-east", "south-west",
]
_SEASONS = ["spring", "summer", "autumn", "winter"]
_FESTIVAL_THINGS = [
    ("Lantern", "people float paper lanterns on the river"),
    ("Harvest", "every family brings bread and apples to the square"),
    ("Bell", "the children ring small bells from dawn until noon"),
    ("Kite", "the whole town flies kites from the hill"),
    ("Boat", "the fishers race their boats to the far bank"),
    ("Candle", "every window holds a candle through the longest night"),
    ("Flower", "the streets are covered with flowers"),
    ("Song", "choirs from every street sing in the market"),
]
_NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve",
]
# Replies that follow '"No," said X, "but ...'; each reads as the rest of that sentence.
_QUOTES = [
    "do not worry, we will find it together.",
    "I saw something shiny near the river this morning.",
    "things always turn up where you least expect them.",
    "let us ask the children, they see everything.",
    "have you looked in the places you never look?",
    "I will bring my lantern, it is getting dark.",
]


@dataclass(frozen=True)
class Pronouns:
    """A pronoun set; ``plural`` selects plural verb agreement (singular *they*)."""

    subj: str
    obj: str
    poss: str
    plural: bool

    def verb(self, singular: str, plural: str) -> str:
        """The verb form that agrees with this pronoun as a subject."""
        return plural if self.plural else singular


HE = Pronouns("he", "him", "his", False)
SHE = Pronouns("she", "her", "her", False)
THEY = Pronouns("they", "them", "their", True)


@dataclass(frozen=True)
class Town:
    """A town of the world. ``neighbors`` and ``founders_from`` are indices into ``World.towns``."""

    name: str
    region: str
    river: str
    size: str
    founded: int
    population: int
    trade: str
    landmark: str
    festival: str
    festival_season: str
    festival_custom: str
    neighbors: tuple[int, ...]
    distances: tuple[int, ...]
    directions: tuple[str, ...]
    founders_occupation: int


@dataclass(frozen=True)
class Person:
    """A person of the world. ``town``, ``friend`` index ``World.towns`` / ``World.people``."""

    first: str
    family: str
    pronouns: Pronouns
    occupation: int
    town: int
    born: int
    trait: str
    pet_animal: int
    pet_name: str
    food: str
    friend: int

    @property
    def full(self) -> str:
        return f"{self.first} {self.family}"


@dataclass(frozen=True)
class World:
    """All entities of one seed. Documents only ever state facts recorded here."""

    seed: int
    regions: tuple[str, ...]
    towns: tuple[Town, ...]
    people: tuple[Person, ...]

    def residents(self, town: int) -> list[int]:
        """Indices of the people living in town ``town``, in index order."""
        return [i for i, p in enumerate(self.people) if p.town == town]


# --------------------------------------------------------------------------- the world


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)


def _name(rng: random.Random, syllables: int) -> str:
    text = "".join(_syllable(rng) for _ in range(syllables))
    return text[:1].upper() + text[1:]


def _unique(rng: random.Random, seen: set[str], make) -> str:
    """Draw names with ``make(rng)`` until one is new; membership only, so order-free."""
    for _ in range(1000):
        name = make(rng)
        if 3 <= len(name) <= 10 and name not in seen:
            seen.add(name)
            return name
    raise RuntimeError("name space exhausted")  # pragma: no cover - lists are large


def build_world(seed: int, *, num_towns: int = 40, num_people: int = 200) -> World:
    """Build the world of ``seed``: regions, towns and people with consistent facts.

    Raises ``ValueError`` for a non-integer seed or fewer than 4 towns / 8 people.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if num_towns < 4 or num_people < 8:
        raise ValueError(f"need at least 4 towns and 8 people, got {num_towns}, {num_people}")
    rng = random.Random(f"kvlab-world:{seed}")
    seen: set[str] = set()
    regions = tuple(
        f"the {_unique(rng, seen, lambda r: _name(r, 2))} {kind}" for kind in _REGION_KINDS
    )
    rivers = [_unique(rng, seen, lambda r: _name(r, 2)) for _ in range(12)]
    town_names = [
        _unique(rng, seen, lambda r: _name(r, rng.choice([1, 1, 2])) + rng.choice(_TOWN_SUFFIXES))
        for _ in range(num_towns)
    ]
    towns = []
    for i, name in enumerate(town_names):
        others = [j for j in range(num_towns) if j != i]
        neighbors = tuple(rng.sample(others, 2))
        festival, custom = rng.choice(_FESTIVAL_THINGS)
        towns.append(
            Town(
                name=name,
                region=regions[i % len(regions)],
                river=rivers[rng.randrange(len(rivers))],
                size=rng.choice(_SIZES),
                founded=rng.randrange(1100, 1850),
                population=rng.randrange(4, 400) * 50,
                trade=rng.choice(_TRADES),
                landmark=rng.choice(_LANDMARKS),
                festival=f"{festival} Festival",
                festival_season=rng.choice(_SEASONS),
                festival_custom=custom,
                neighbors=neighbors,
                distances=tuple(rng.randrange(2, 40) for _ in neighbors),
                directions=tuple(rng.choice(_DIRECTIONS) for _ in neighbors),
                founders_occupation=rng.randrange(len(_OCCUPATIONS)),
            )
        )
    first_names = [_unique(rng, seen, lambda r: _name(r, rng.choice([1, 2, 2]))) for _ in
                   range(num_people)]
    families = [_unique(rng, seen, lambda r: _name(r, 2)) for _ in range(max(8, num_people // 3))]
    pet_names = [_unique(rng, seen, lambda r: _name(r, 1) + rng.choice(["", "y", "o", "ie"]))
                 for _ in range(num_people)]
    people = []
    for i in range(num_people):
        roll = rng.random()
        pronouns = HE if roll < 0.45 else SHE if roll < 0.9 else THEY
        friend = rng.randrange(num_people - 1)
        people.append(
            Person(
                first=first_names[i],
                family=rng.choice(families),
                pronouns=pronouns,
                occupation=rng.randrange(len(_OCCUPATIONS)),
                town=rng.randrange(num_towns),
                born=rng.randrange(1890, 2005),
                trait=rng.choice(_TRAITS),
                pet_animal=rng.randrange(len(_ANIMALS)),
                pet_name=pet_names[i],
                food=rng.choice(_FOODS),
                friend=friend if friend < i else friend + 1,
            )
        )
    return World(seed=seed, regions=regions, towns=tuple(towns), people=tuple(people))


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
    word = _NUMBER_WORDS[n] if n < len(_NUMBER_WORDS) else str(n)
    return f"{word} {singular if n == 1 else plural}"


def _was(n: int) -> str:
    return "was" if n == 1 else "were"


def _population(n: int) -> str:
    return f"{n:,}"


class _Writer:
    """Helpers that phrase world facts; one per document, bound to its generator."""

    def __init__(self, world: World, rng: random.Random) -> None:
        self.w = world
        self.rng = rng

    def pick(self, options):
        return self.rng.choice(options)

    def occ(self, p: Person) -> tuple[str, str, str, str, str, str]:
        return _OCCUPATIONS[p.occupation]

    def animal(self, p: Person) -> tuple[str, str]:
        return _ANIMALS[p.pet_animal]

    def town(self, p: Person) -> Town:
        return self.w.towns[p.town]

    def friend(self, p: Person) -> Person:
        return self.w.people[p.friend]

    def person(self) -> Person:
        return self.pick(self.w.people)


# --------------------------------------------------------------------------- documents


def _town_entry(wr: _Writer) -> str:
    w = wr.w
    index = wr.rng.randrange(len(w.towns))
    t = w.towns[index]
    n0, n1 = (w.towns[j] for j in t.neighbors)
    founders = _OCCUPATIONS[t.founders_occupation][1]
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
        f"{t.name} is known for its {t.trade}, which {'is' if t.trade in _MASS_TRADES else 'are'}"
        f" sold in every market of {t.region}.",
        f"Visitors come to see {t.landmark}.",
        f"Every {t.festival_season} the town holds the {t.festival}, when "
        f"{t.festival_custom}.",
    ]
    residents = w.residents(index)
    paragraphs = [" ".join(lead + history), " ".join(culture)]
    if residents:
        chosen = wr.rng.sample(residents, min(len(residents), wr.rng.randint(1, 3)))
        names = [f"{w.people[i].full}, the {_OCCUPATIONS[w.people[i].occupation][0]}"
                 for i in chosen]
        if len(names) == 1:
            people = f"A well-known person from {t.name} is {names[0]}."
        else:
            people = f"Well-known people from {t.name} include {', '.join(names[:-1])} and " \
                     f"{names[-1]}."
        paragraphs.append(people)
    return f"{t.name}\n\n" + "\n\n".join(paragraphs)


def _person_entry(wr: _Writer) -> str:
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
        f"{wr.pick(_TRAITS)} neighbor.",
        f"{p.first}'s favorite food is {p.food}.",
        f"{_cap(pr.subj)} {pr.verb('is', 'are')} a good friend of {f.full}, the "
        f"{_OCCUPATIONS[f.occupation][0]} from {wr.w.towns[f.town].name}.",
    ]
    wr.rng.shuffle(second)
    return f"{p.full}\n\n" + " ".join(first) + "\n\n" + " ".join(second[: wr.rng.randint(2, 4)])


def _story_opening(wr: _Writer, p: Person) -> list[str]:
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
        f"{_a(wr.pick(_COLORS))} door.",
    ])
    routine = wr.pick([
        f"Every morning, {p.first} went to the {workplace} and {past}.",
        f"Each day {pr.subj} {past} from dawn until dusk.",
    ])
    return [opening, pet, routine]


def _story_lost(wr: _Writer, p: Person) -> list[str]:
    pr = p.pronouns
    animal, _ = wr.animal(p)
    f = wr.friend(p)
    obj, _ = wr.pick(_OBJECTS)
    color = wr.pick(_COLORS)
    places = wr.rng.sample(_SEARCH_PLACES, 2)
    s = [
        f"One {wr.pick(_SEASONS)} morning, {p.first} could not find {pr.poss} {color} {obj}.",
        f"{_cap(pr.subj)} looked {places[0]}, but the {obj} was not there.",
        f"{_cap(pr.subj)} looked {places[1]} too, and found only dust.",
        f"So {pr.subj} went to see {f.first}, the {_OCCUPATIONS[f.occupation][0]}, and asked "
        f"for help.",
        f'"Have you seen my {obj}?" {pr.subj} asked.',
        f'"No," said {f.first}, "but {wr.pick(_QUOTES)}"',
    ]
    hide = wr.pick(_HIDING_PLACES)
    s.append(wr.pick([
        f"At last, {p.pet_name} the {animal} ran to the yard and came back with the {obj}.",
        f"In the end, {f.first} found the {obj} {hide}.",
        f"Just before sunset, {p.first} found the {obj} {hide}, where {p.pet_name} had "
        f"left it.",
    ]))
    s.append(f"{p.first} thanked {f.first} and shared {pr.poss} {p.food} with {f.pronouns.obj}.")
    s.append(f"From that day on, {p.first} always kept the {obj} {wr.pick(_SAFE_PLACES)}.")
    return s


def _story_storm(wr: _Writer, p: Person) -> list[str]:
    pr = p.pronouns
    animal, _ = wr.animal(p)
    t = wr.town(p)
    sound = _ANIMAL_SOUNDS[animal]
    n = wr.rng.randint(2, 9)
    tree = wr.pick(["tree", "fence", "boat"])
    trees = {"tree": "trees", "fence": "fences", "boat": "boats"}[tree]
    return [
        f"One {wr.pick(['autumn', 'winter'])} night, a great storm came over {t.region}.",
        f"The wind shook the windows, and the river {t.river} rose higher and higher.",
        f"{p.first} was worried about {p.pet_name}, who was still outside.",
        f"{_cap(pr.subj)} put on {pr.poss} coat, took a lantern and went out into the rain.",
        f'"{p.pet_name}! {p.pet_name}!" {pr.subj} called.',
        f"At last {pr.subj} heard a sound: the {animal} {sound} {wr.pick(_HIDING_PLACES)}.",
        f"{p.first} carried {p.pet_name} home and dried it by the fire.",
        f"In the morning the sky was clear, but {_count(n, tree, trees)} {_was(n)} down "
        f"along the river.",
        f"The people of {t.name} worked together all day, and by evening the town was "
        f"in order again.",
    ]


def _story_journey(wr: _Writer, p: Person) -> list[str]:
    pr = p.pronouns
    t = wr.town(p)
    k = wr.rng.randrange(2)
    other = wr.w.towns[t.neighbors[k]]
    dist = t.distances[k]
    stranger_occ = wr.pick(_OCCUPATIONS)
    n = wr.rng.randint(1, 9)
    obj, objs = wr.pick(_OBJECTS)
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


def _story_festival(wr: _Writer, p: Person) -> list[str]:
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


def _story(wr: _Writer) -> str:
    p = wr.person()
    body = wr.pick([_story_lost, _story_lost, _story_storm, _story_journey, _story_festival])
    sentences = _story_opening(wr, p) + body(wr, p)
    cut = 3
    return " ".join(sentences[:cut]) + "\n\n" + " ".join(sentences[cut:])


def _qa_pair(wr: _Writer) -> tuple[str, str]:
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
        return f"Who is a friend of {p.full}?", f"{f.full}, the {_OCCUPATIONS[f.occupation][0]}."
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


def _dialogue(wr: _Writer) -> str:
    turns = [_qa_pair(wr) for _ in range(wr.rng.randint(2, 4))]
    return SYSTEM_PROMPT + "\n\n" + "\n".join(f"User: {q}\nArchivist: {a}" for q, a in turns)


_KINDS = (
    (_town_entry, 2),
    (_person_entry, 2),
    (_story, 4),
    (_dialogue, 2),
)


def generate_document(world: World, rng: random.Random) -> str:
    """One document drawn with ``rng`` from ``world`` (a town or person entry, story or Q&A)."""
    wr = _Writer(world, rng)
    total = sum(weight for _, weight in _KINDS)
    roll = rng.randrange(total)
    for make, weight in _KINDS:
        if roll < weight:
            return make(wr)
        roll -= weight
    raise AssertionError("unreachable")  # pragma: no cover


def _check_counts(seed: int, num_docs: int, start: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if not isinstance(num_docs, int) or num_docs < 0:
        raise ValueError(f"num_docs must be a non-negative int, got {num_docs!r}")
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")


def generate_corpus(seed: int, num_docs: int, *, start: int = 0) -> list[str]:
    """Documents ``start .. start + num_docs - 1`` of the corpus of ``seed``.

    Each document is plain English text (no special tokens), paragraphs separated by a blank
    line. Document ``i`` depends only on ``(seed, i)``: the world of ``seed`` and its own
    generator, so slices of the corpus can be produced independently.
    """
    _check_counts(seed, num_docs, start)
    world = build_world(seed)
    return [
        generate_document(world, random.Random(f"kvlab-doc:{seed}:{i}"))
        for i in range(start, start + num_docs)
    ]


_WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


def corpus_words(texts: list[str]) -> set[str]:
    """The lower-cased words (letters and apostrophes) occurring in ``texts``."""
    return {m.group(0).lower() for text in texts for m in _WORD.finditer(text)}


# --------------------------------------------------------------------------- prompts


def sample_prompts(seed: int, n: int, *, corpus_seed: int = CORPUS_SEED) -> list[str]:
    """``n`` prompts in the style of the corpus: the opening of a fresh document.

    Each is the first sentence (stories, Q&A) or the title and first clause (entries) of a
    document drawn from the world of ``corpus_seed`` with a generator separate from the
    training stream, cut at a word boundary, so a model trained on the corpus should continue
    it fluently. Deterministic in ``(seed, n, corpus_seed)``.
    """
    _check_counts(seed, n, 0)
    world = build_world(corpus_seed)
    prompts = []
    for i in range(n):
        doc = generate_document(world, random.Random(f"kvlab-prompt:{seed}:{i}"))
        prompts.append(_prompt_cut(doc))
    return prompts


def _prompt_cut(doc: str) -> str:
    if doc.startswith(SYSTEM_PROMPT):
        # keep the system prompt and the first question, up to the answer marker
        end = doc.index("\nArchivist:") + len("\nArchivist:")
        return doc[:end]
    body = doc.split("\n\n")
    if len(body) > 1 and "." not in body[0]:  # an entry: title + first words of the text
        words = body[1].split(" ")
        return body[0] + "\n\n" + " ".join(words[: max(3, len(words) // 4)])
    sentence_end = doc.find(". ")
    first = doc[: sentence_end + 1] if sentence_end > 0 else doc
    words = first.split(" ")
    return " ".join(words[: max(4, (2 * len(words)) // 3)])


def qa_examples(seed: int, n: int, *, corpus_seed: int = CORPUS_SEED) -> list[tuple[str, str]]:
    """``n`` (prompt, answer) pairs: a Q&A prompt as in :func:`shared_prefix_prompts` and the
    one-line answer the world of ``corpus_seed`` makes true (what the Archivist would say).

    Use it to measure how many facts of the world a model has learned: greedy-decode the
    prompt up to the first newline and compare with ``answer`` (which has no leading space).
    """
    _check_counts(seed, n, 0)
    world = build_world(corpus_seed)
    examples = []
    for i in range(n):
        question, answer = _qa_pair(_Writer(world, random.Random(f"kvlab-qa:{seed}:{i}")))
        examples.append((f"{SYSTEM_PROMPT}\n\nUser: {question}\nArchivist:", answer))
    return examples


def shared_prefix_prompts(seed: int, n: int, *, corpus_seed: int = CORPUS_SEED) -> list[str]:
    """``n`` Q&A prompts that all start with :data:`SYSTEM_PROMPT` and differ after it.

    Shape: ``SYSTEM_PROMPT + "\\n\\nUser: <question>\\nArchivist:"``; questions are about the
    world of ``corpus_seed``, so a trained model answers them in the corpus style. Useful for
    prefix-caching demonstrations: the shared prefix is identical token for token.
    """
    return [prompt for prompt, _ in qa_examples(seed, n, corpus_seed=corpus_seed)]
