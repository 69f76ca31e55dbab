"""The testbed vocabulary: fixed word lists, written out in code (no randomness, no files).

Every pool is disjoint from every other one (``tests/testbed/test_tokenizer.py`` checks it), so a word's
role is known from the word alone:

* ``SPECIALS`` ``<pad> <bos> <eos> <unk>`` (ids 0..3), then the ten ``DIGITS`` (ids 4..13), ``PUNCT`` and
  the task ``KEYWORDS`` that the templates use;
* ``KEYS``: >= 256 concrete nouns, the single-token keys of ``niah`` and ``recall``;
* ``VT_NAMES``: variable names of ``vt`` (NATO and Greek letter names);
* ``TRACE_NAMES``: the 26 single letters, variable names of the ``trace`` programs;
* ``THINK_SENTENCES`` (words in ``THINK_WORDS``): the fixed "thinking" sentences of a ``trace`` answer;
* ``FILLER_*``: the haystack grammar (determiner, adjectives, nouns, verbs, adverbs, prepositions); the
  filler never contains a digit, a key, a variable name or a task keyword.
"""

from __future__ import annotations

SPECIALS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
DIGITS: tuple[str, ...] = tuple(str(d) for d in range(10))
PUNCT: tuple[str, ...] = (".", ",", ":", ";", "?", "=", "+", "-")
KEYWORDS: tuple[str, ...] = tuple(
    "special number numbers for is are what question answer var which variables hold let program step think".split()
)

KEYS: tuple[str, ...] = tuple(
    """
    cat dog horse cow pig sheep goat mouse rat rabbit fox wolf bear deer moose lion tiger zebra giraffe camel
    monkey gorilla panda koala kangaroo otter beaver badger squirrel hedgehog mole owl eagle hawk falcon parrot
    pigeon crow raven swan goose duck chicken turkey penguin ostrich flamingo heron frog toad snake lizard turtle
    crocodile shark whale dolphin seal walrus octopus squid crab lobster shrimp oyster snail spider ant bee wasp
    beetle moth butterfly
    apple banana cherry grape lemon mango melon orange peach pear plum kiwi papaya apricot coconut fig olive
    tomato potato carrot onion garlic pepper cabbage lettuce spinach pumpkin radish turnip celery broccoli corn
    rice bean pea bread butter cheese cookie cake pie honey jam soup salad pasta pizza noodle waffle pancake
    muffin donut yogurt cereal
    hammer wrench saw drill shovel rake axe chisel ladder bucket rope chain nail screw bolt hinge lock scissors
    needle thread button zipper pencil crayon marker eraser ruler stapler envelope stamp magnet compass lantern
    candle lamp mirror clock camera radio phone kettle teapot spoon fork knife plate bowl cup mug jar bottle
    basket broom mop sponge towel pillow blanket carpet curtain
    piano guitar violin cello flute trumpet drum harp banjo tuba organ oboe clarinet cymbal ukulele
    diamond ruby emerald sapphire pearl amber jade opal topaz copper silver gold iron marble granite
    hat cap scarf glove sock shoe boot coat jacket sweater shirt skirt dress belt tie vest apron cloak helmet
    mitten
    car bus truck tram bicycle wagon canoe kayak yacht rocket tractor scooter sled carriage
    castle tower bridge cabin barn temple palace cottage igloo tent lighthouse windmill fortress chapel museum
    kitchen garage attic cellar
    anchor balloon kite puzzle trophy medal crown sword shield arrow wheel barrel cannon robot statue globe map
    ticket wallet purse suitcase backpack umbrella feather acorn cactus tulip rose daisy lily orchid sunflower
    fern bamboo mushroom
    """.split()
)

VT_NAMES: tuple[str, ...] = tuple(
    """
    alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec
    romeo sierra tango uniform victor whiskey xray yankee zulu
    beta gamma epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon phi chi psi
    omega
    """.split()
)

TRACE_NAMES: tuple[str, ...] = tuple("abcdefghijklmnopqrstuvwxyz")

THINK_SENTENCES: tuple[tuple[str, ...], ...] = tuple(
    tuple(s.split())
    for s in (
        "hmm , check that again .",
        "ok , that looks right .",
        "good , keep going .",
        "wait , so far so good .",
        "fine , next one .",
        "yes , that seems correct .",
        "careful now , go on .",
        "right , moving on .",
    )
)
THINK_WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(w for s in THINK_SENTENCES for w in s if w not in PUNCT)
)

FILLER_DET: tuple[str, ...] = ("the",)
FILLER_CONJ: tuple[str, ...] = ("and", "while")
FILLER_ADJ: tuple[str, ...] = tuple(
    """
    quiet old small large bright dark warm cold green blue red yellow brown gray white black tall short long
    narrow wide soft hard slow quick gentle calm busy empty full heavy distant ancient young early late happy
    sad strange familiar silent noisy golden pale deep shallow wet dry rough smooth clean dusty hidden broken
    lonely friendly proud tired sleepy brave curious patient honest clever simple plain rich poor famous humble
    foggy sunny windy rainy frozen wild sweet bitter fresh round square crooked hollow
    """.split()
)
FILLER_NOUN: tuple[str, ...] = tuple(
    """
    river house hill valley forest road field sky cloud wind rain storm sea lake stone tree garden village city
    street window door wall roof market meadow shore island mountain path harbor station school farm park
    corner evening morning night season summer winter autumn crowd child farmer teacher sailor traveler
    stranger neighbor writer painter baker singer student king queen soldier doctor family letter story song
    dream shadow light fire smoke dust snow ice water grass leaf wave pond stream creek orchard desert canyon
    cliff bay fountain well gate fence hut porch yard alley plaza bench lane boat ship cart crew guard nurse
    """.split()
)
FILLER_VERB: tuple[str, ...] = tuple(
    """
    moves walks runs rests sleeps waits stands sits falls rises turns drifts flows glows shines fades grows sways
    sings hums whispers wanders travels returns arrives stays listens watches smiles laughs breathes shivers
    trembles circles climbs jumps rolls slides floats sinks bends settles lingers hurries crawls marches passes
    glides swirls shimmers echoes pauses leans waves blinks yawns dances
    """.split()
)
FILLER_ADV: tuple[str, ...] = tuple(
    """
    slowly quickly softly gently quietly calmly rarely often always sometimes still already soon later
    together alone forward away loudly brightly lazily steadily suddenly silently eagerly happily sadly warmly
    """.split()
)
FILLER_PREP: tuple[str, ...] = tuple(
    "past near over under behind beside beyond across along around through toward into above below inside outside within against".split()
)
FILLER_WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(FILLER_DET + FILLER_CONJ + FILLER_ADJ + FILLER_NOUN + FILLER_VERB + FILLER_ADV + FILLER_PREP)
)


def all_words() -> tuple[str, ...]:
    """The vocabulary in id order: specials, digits, punctuation, keywords, then every pool.

    A word used by two pools (only ``the``, which is both a filler determiner and part of the niah needle
    template) gets a single id.
    """
    ordered = (
        SPECIALS + DIGITS + PUNCT + KEYWORDS + ("the",) + KEYS + VT_NAMES + TRACE_NAMES + THINK_WORDS + FILLER_WORDS
    )
    return tuple(dict.fromkeys(ordered))
