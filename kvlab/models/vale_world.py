"""The Vale's world for :mod:`kvlab.models.corpus`: the word lists (written for this project) and
the seeded towns, rivers and people (:func:`build_world`) that every document is drawn from.

Pure Python; output depends only on the seed (see the corpus module's contract).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# --------------------------------------------------------------------------- word lists
# Written for this project. Plural forms are explicit wherever English is irregular.

ONSETS = [
    "b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s",
    "st", "t", "th", "tr", "v", "w", "z", "sh", "ch", "el", "al", "or", "ar", "",
]
NUCLEI = ["a", "e", "i", "o", "u", "a", "e", "o", "i", "ea", "ia", "ou", "y"]
CODAS = ["", "", "", "", "", "n", "r", "l", "s", "th", "m", "nd", "rn", "ck", "ll", "t"]
TOWN_SUFFIXES = [
    "ford", "wick", "moor", "dale", "holm", "by", "stead", "mouth", "bridge", "ton",
    "field", "haven", "mere", "well", "combe",
]
REGION_KINDS = ["Vale", "Hills", "Coast", "Marshes", "Plains", "Woods"]

# (occupation, plural, workplace, product, activity in the past tense, activity in the present)
OCCUPATIONS = [
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
ANIMALS = [
    ("dog", "dogs"), ("cat", "cats"), ("goat", "goats"), ("donkey", "donkeys"),
    ("horse", "horses"), ("goose", "geese"), ("crow", "crows"), ("owl", "owls"),
    ("rabbit", "rabbits"), ("fox", "foxes"), ("pony", "ponies"), ("parrot", "parrots"),
    ("tortoise", "tortoises"), ("hen", "hens"), ("duck", "ducks"), ("mouse", "mice"),
    ("ferret", "ferrets"), ("lamb", "lambs"), ("pig", "pigs"), ("hedgehog", "hedgehogs"),
]
ANIMAL_SOUNDS = {
    "dog": "barked", "cat": "mewed", "goat": "bleated", "donkey": "brayed", "horse": "neighed",
    "goose": "honked", "crow": "cawed", "owl": "hooted", "rabbit": "thumped its foot",
    "fox": "yipped", "pony": "neighed", "parrot": "squawked", "tortoise": "blinked slowly",
    "hen": "clucked", "duck": "quacked", "mouse": "squeaked", "ferret": "chattered",
    "lamb": "bleated", "pig": "grunted", "hedgehog": "snuffled",
}
FOODS = [
    "apple pie", "plum cake", "fish soup", "honey bread", "onion stew", "pear tart",
    "barley porridge", "goat cheese", "roasted chestnuts", "mushroom pie", "cherry jam",
    "potato cakes", "pumpkin soup", "walnut bread", "berry pudding", "baked pears",
    "carrot soup", "oat biscuits", "lemon cake", "bean stew",
]
# (object, plural)
OBJECTS = [
    ("key", "keys"), ("hat", "hats"), ("ring", "rings"), ("scarf", "scarves"),
    ("lantern", "lanterns"), ("book", "books"), ("map", "maps"), ("flute", "flutes"),
    ("coin", "coins"), ("letter", "letters"), ("basket", "baskets"), ("compass", "compasses"),
    ("spoon", "spoons"), ("bell", "bells"), ("kite", "kites"), ("boot", "boots"),
    ("glove", "gloves"), ("umbrella", "umbrellas"), ("whistle", "whistles"),
    ("notebook", "notebooks"), ("button", "buttons"), ("shell", "shells"),
]
COLORS = [
    "red", "blue", "green", "yellow", "brown", "grey", "white", "black", "orange",
    "purple", "silver", "golden",
]
TRAITS = [
    "kind", "clever", "shy", "brave", "curious", "patient", "cheerful", "stubborn",
    "careful", "generous", "quiet", "proud", "gentle", "honest", "forgetful", "busy",
    "old", "young", "tall", "friendly", "hardworking", "clumsy", "wise", "thoughtful",
]
SEARCH_PLACES = [
    "under the bed", "behind the stove", "in the kitchen drawer", "on every shelf",
    "under the table", "in the garden", "behind the door", "in the coat pocket",
    "inside the cupboard", "under the stairs", "in the attic", "by the window",
]
HIDING_PLACES = [
    "behind the woodpile", "inside an old boot", "under a flower pot", "in the hay loft",
    "beneath the bridge", "at the bottom of a basket", "on the roof of the shed",
    "in the hollow of a tree", "under a pile of leaves", "beside the well",
    "inside the rain barrel", "under the garden bench",
]
SAFE_PLACES = [
    "on a hook by the door", "in a small wooden box", "on the shelf above the fire",
    "in the top drawer", "on a string around the neck", "next to the clock",
]
# Things towns are known for; the second name lists the mass nouns ("which is sold").
TRADES = [
    "copper bells", "blue glass", "wool blankets", "apple cider", "paper lanterns",
    "river pearls", "salted fish", "silver clocks", "wild honey", "sheep cheese",
    "painted boats", "leather boots", "rose soap", "walnut furniture", "linen cloth",
    "clay pots", "black tea", "plum brandy", "woven baskets", "stone carvings",
]
MASS_TRADES = frozenset({
    "blue glass", "apple cider", "salted fish", "wild honey", "sheep cheese", "rose soap",
    "walnut furniture", "linen cloth", "black tea", "plum brandy",
})
LANDMARKS = [
    "an old stone bridge", "a tall clock tower", "a round library", "a windmill on the hill",
    "a harbor full of red boats", "a great oak tree", "the ruins of a castle",
    "a painted town gate", "a deep stone well", "a white lighthouse", "a covered market",
    "a garden of tall poplars", "a narrow wooden pier", "a chapel with a green roof",
    "a long stone wall", "a hot spring",
]
SIZES = ["small", "quiet", "busy", "old", "pretty", "large", "sleepy", "windy"]
DIRECTIONS = [
    "north", "south", "east", "west", "north-east", "north-west", "south-east", "south-west",
]
SEASONS = ["spring", "summer", "autumn", "winter"]
FESTIVAL_THINGS = [
    ("Lantern", "people float paper lanterns on the river"),
    ("Harvest", "every family brings bread and apples to the square"),
    ("Bell", "the children ring small bells from dawn until noon"),
    ("Kite", "the whole town flies kites from the hill"),
    ("Boat", "the fishers race their boats to the far bank"),
    ("Candle", "every window holds a candle through the longest night"),
    ("Flower", "the streets are covered with flowers"),
    ("Song", "choirs from every street sing in the market"),
]
NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve",
]
# Replies that follow '"No," said X, "but ...'; each reads as the rest of that sentence.
QUOTES = [
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
    return rng.choice(ONSETS) + rng.choice(NUCLEI) + rng.choice(CODAS)


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
        f"the {_unique(rng, seen, lambda r: _name(r, 2))} {kind}" for kind in REGION_KINDS
    )
    rivers = [_unique(rng, seen, lambda r: _name(r, 2)) for _ in range(12)]
    town_names = [
        _unique(rng, seen, lambda r: _name(r, rng.choice([1, 1, 2])) + rng.choice(TOWN_SUFFIXES))
        for _ in range(num_towns)
    ]
    towns = []
    for i, name in enumerate(town_names):
        others = [j for j in range(num_towns) if j != i]
        neighbors = tuple(rng.sample(others, 2))
        festival, custom = rng.choice(FESTIVAL_THINGS)
        towns.append(
            Town(
                name=name,
                region=regions[i % len(regions)],
                river=rivers[rng.randrange(len(rivers))],
                size=rng.choice(SIZES),
                founded=rng.randrange(1100, 1850),
                population=rng.randrange(4, 400) * 50,
                trade=rng.choice(TRADES),
                landmark=rng.choice(LANDMARKS),
                festival=f"{festival} Festival",
                festival_season=rng.choice(SEASONS),
                festival_custom=custom,
                neighbors=neighbors,
                distances=tuple(rng.randrange(2, 40) for _ in neighbors),
                directions=tuple(rng.choice(DIRECTIONS) for _ in neighbors),
                founders_occupation=rng.randrange(len(OCCUPATIONS)),
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
                occupation=rng.randrange(len(OCCUPATIONS)),
                town=rng.randrange(num_towns),
                born=rng.randrange(1890, 2005),
                trait=rng.choice(TRAITS),
                pet_animal=rng.randrange(len(ANIMALS)),
                pet_name=pet_names[i],
                food=rng.choice(FOODS),
                friend=friend if friend < i else friend + 1,
            )
        )
    return World(seed=seed, regions=regions, towns=tuple(towns), people=tuple(people))
