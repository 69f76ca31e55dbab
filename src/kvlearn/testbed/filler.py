"""The haystack: pseudo-English sentences from a tiny grammar, produced directly as token ids.

Grammar (every sentence ends with "."; lengths 4..12 tokens)::

    S  -> NP VP "." | NP VP PP "." | NP VP CONJ NP VP "."
    NP -> "the" NOUN | "the" ADJ NOUN        VP -> VERB | VERB ADV        PP -> PREP NP

e.g. "the quiet river moves past the old house ." The filler words never include a digit, a key, a variable
name or a task keyword, so nothing in the haystack can be mistaken for task content.
"""

from __future__ import annotations

import itertools
import random

from ..errors import check
from .tokenizer import WORD_TO_ID
from .vocab import FILLER_ADJ, FILLER_ADV, FILLER_CONJ, FILLER_NOUN, FILLER_PREP, FILLER_VERB

_POOLS: tuple[tuple[int, ...], ...] = tuple(
    tuple(WORD_TO_ID[w] for w in pool)
    for pool in (("the",), FILLER_ADJ, FILLER_NOUN, FILLER_VERB, FILLER_ADV, FILLER_PREP, FILLER_CONJ, (".",))
)
_DET, _ADJ, _NOUN, _VERB, _ADV, _PREP, _CONJ, _DOT = range(8)


def _structures() -> tuple[tuple[int, ...], ...]:
    nps = ((_DET, _NOUN), (_DET, _ADJ, _NOUN))
    vps = ((_VERB,), (_VERB, _ADV))
    out = []
    for np_, vp in itertools.product(nps, vps):
        out.append(np_ + vp + (_DOT,))
        for np2 in nps:
            out.append(np_ + vp + (_PREP,) + np2 + (_DOT,))
    for np_, vp, np2, vp2 in itertools.product(nps, vps, nps, vps):
        out.append(np_ + vp + (_CONJ,) + np2 + vp2 + (_DOT,))
    return tuple(out)


STRUCTURES = _structures()
MIN_SENTENCE = min(len(s) for s in STRUCTURES)  # 4
MAX_SENTENCE = max(len(s) for s in STRUCTURES)  # 12
_BY_LENGTH: dict[int, tuple[tuple[int, ...], ...]] = {
    n: tuple(s for s in STRUCTURES if len(s) == n) for n in range(MIN_SENTENCE, MAX_SENTENCE + 1)
}
assert all(_BY_LENGTH.values()), "the grammar must produce every length in [MIN_SENTENCE, MAX_SENTENCE]"


def filler_ok(n_tokens: int) -> bool:
    """Whether exactly ``n_tokens`` of filler can be written as whole sentences (0 or >= 4)."""
    return n_tokens == 0 or n_tokens >= MIN_SENTENCE


def filler(rng: random.Random, n_tokens: int) -> tuple[list[int], list[int]]:
    """Whole sentences totalling exactly ``n_tokens`` tokens.

    Returns ``(ids, starts)``: the flat token ids ``[n_tokens]`` and the start offset of every sentence,
    followed by ``n_tokens`` (so ``starts`` lists the sentence boundaries where items may be inserted).
    """
    check(filler_ok(n_tokens), f"n_tokens={n_tokens} is invalid: filler needs 0 or >= {MIN_SENTENCE} tokens")
    pools = _POOLS
    rand = rng.random
    ids: list[int] = []
    starts: list[int] = []
    append = ids.append
    structs = STRUCTURES
    n_structs = len(structs)
    plan: list[tuple[int, ...]] = []
    remaining = n_tokens
    while remaining > MAX_SENTENCE + MIN_SENTENCE:
        s = structs[int(rand() * n_structs)]
        plan.append(s)
        remaining -= len(s)
    if remaining > MAX_SENTENCE:  # 13..16: two sentences
        first = remaining - 8
        plan.append(rng.choice(_BY_LENGTH[first]))
        remaining -= first
    if remaining:
        plan.append(rng.choice(_BY_LENGTH[remaining]))
    for s in plan:
        starts.append(len(ids))
        for slot in s:
            pool = pools[slot]
            append(pool[int(rand() * len(pool))])
    starts.append(len(ids))
    return ids, starts
