"""The haystack: filler text in several styles, produced directly as token ids.

A real language model does not care what its haystack is made of, so the testbed varies it. Every style writes
exactly ``n_tokens`` tokens as whole "sentences" of 4..12 tokens (items are inserted between sentences), and
every style uses only the filler words (never a digit, a key, a variable name or a task keyword), so nothing in
the haystack can be mistaken for task content and the independent checkers still find every item.

Styles (:data:`STYLES`):

- ``svo``: subject-verb sentences, "the quiet river moves past the old house ." (the original grammar)::

      S -> NP VP "." | NP VP PP "." | NP VP CONJ NP VP "."
      NP -> "the" NOUN | "the" ADJ NOUN        VP -> VERB | VERB ADV        PP -> PREP NP

- ``adverbial``: adverb first, "slowly the old farmer walks near the house ."::

      S -> ADV NOUN VERB "." | ADV NP VP "." | ADV NP VERB PP "." | ADV NP VERB CONJ NP VERB "."
         | ADV NP VP PP "." | ADV NP VP CONJ NP VP "."

- ``prepositional``: a fronted prepositional phrase, "near the river the quiet nurse sings softly ."::

      S -> PREP NOUN VERB "." | PP VERB "." | PP NP VP "." | PP NP VP PP "." | PP NP VP CONJ NP VERB "."

- ``salad``: word salad, uniformly random filler words in chunks of 4..12, no punctuation at all.
- ``repeat``: one to three sentences of the ``svo`` grammar drawn once per example and repeated over and over
  (RULER's "repeated noise" haystack).
- ``mixture``: every sentence in a style drawn from the training styles above.
- ``verb_first`` (**held out**: never used in training, see :data:`HELDOUT_STYLES`): verb-initial clauses,
  "walks the old nurse quietly and sings the crew ."::

      S -> VP NP "." | VP NP PP "." | VP NP CONJ VP NP "."

Every grammar keeps only structures of at most 12 tokens and covers every length from 4 to 12 (asserted at
import), which is what lets :func:`filler` hit an exact token count.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from ..errors import check
from .tokenizer import WORD_TO_ID
from .vocab import FILLER_ADJ, FILLER_ADV, FILLER_CONJ, FILLER_NOUN, FILLER_PREP, FILLER_VERB, FILLER_WORDS

_POOLS: tuple[tuple[int, ...], ...] = tuple(
    tuple(WORD_TO_ID[w] for w in pool)
    for pool in (("the",), FILLER_ADJ, FILLER_NOUN, FILLER_VERB, FILLER_ADV, FILLER_PREP, FILLER_CONJ, (".",))
)
_DET, _ADJ, _NOUN, _VERB, _ADV, _PREP, _CONJ, _DOT = range(8)
_ALL_WORDS: tuple[int, ...] = tuple(WORD_TO_ID[w] for w in FILLER_WORDS)

MIN_SENTENCE = 4
MAX_SENTENCE = 12

TRAIN_STYLES: tuple[str, ...] = ("svo", "adverbial", "prepositional", "salad", "repeat", "mixture")
HELDOUT_STYLES: tuple[str, ...] = ("verb_first",)
STYLES: tuple[str, ...] = TRAIN_STYLES + HELDOUT_STYLES
_MIXED = ("svo", "adverbial", "prepositional", "salad", "repeat")  # what a ``mixture`` draws each sentence from

Structure = tuple[int, ...]
_NPS: tuple[Structure, ...] = ((_DET, _NOUN), (_DET, _ADJ, _NOUN))
_VPS: tuple[Structure, ...] = ((_VERB,), (_VERB, _ADV))


def _grammar(rules: Callable[[Structure, Structure, Structure, Structure], list[Structure]]) -> tuple[Structure, ...]:
    """Every structure of at most ``MAX_SENTENCE`` tokens that ``rules(np, vp, np2, vp2)`` yields over all NP / VP
    choices, deduplicated, in order."""
    out: dict[Structure, None] = {}
    for np_, vp, np2, vp2 in itertools.product(_NPS, _VPS, _NPS, _VPS):
        for s in rules(np_, vp, np2, vp2):
            if len(s) <= MAX_SENTENCE:
                out[s] = None
    return tuple(out)


_DOT_ = (_DOT,)
GRAMMARS: dict[str, tuple[Structure, ...]] = {
    "svo": _grammar(lambda np_, vp, np2, vp2: [
        np_ + vp + _DOT_, np_ + vp + (_PREP,) + np2 + _DOT_, np_ + vp + (_CONJ,) + np2 + vp2 + _DOT_]),
    "adverbial": _grammar(lambda np_, vp, np2, vp2: [
        (_ADV, _NOUN, _VERB) + _DOT_, (_ADV,) + np_ + (_VERB,) + _DOT_, (_ADV,) + np_ + vp + _DOT_, (_ADV,) + np_ + (_VERB,) + (_PREP,) + np2 + _DOT_,
        (_ADV,) + np_ + (_VERB,) + (_CONJ,) + np2 + (_VERB,) + _DOT_,
        (_ADV,) + np_ + vp + (_PREP,) + np2 + _DOT_, (_ADV,) + np_ + vp + (_CONJ,) + np2 + vp2 + _DOT_]),
    "prepositional": _grammar(lambda np_, vp, np2, vp2: [
        (_PREP, _NOUN, _VERB) + _DOT_, (_PREP,) + np_ + (_VERB,) + _DOT_, (_PREP,) + np2 + np_ + vp + _DOT_, (_PREP,) + np2 + np_ + vp + (_PREP,) + np_ + _DOT_,
        (_PREP,) + np2 + np_ + vp + (_CONJ,) + np2 + (_VERB,) + _DOT_]),
    "verb_first": _grammar(lambda np_, vp, np2, vp2: [
        vp + np_ + _DOT_, vp + np_ + (_PREP,) + np2 + _DOT_, vp + np_ + (_CONJ,) + vp2 + np2 + _DOT_]),
}
_BY_LENGTH: dict[str, dict[int, tuple[Structure, ...]]] = {
    name: {n: tuple(s for s in structs if len(s) == n) for n in range(MIN_SENTENCE, MAX_SENTENCE + 1)}
    for name, structs in GRAMMARS.items()
}
for _name, _lengths in _BY_LENGTH.items():
    _missing = [n for n, ss in _lengths.items() if not ss]
    assert not _missing, f"grammar {_name!r} produces no sentence of length {_missing}"
    assert all(MIN_SENTENCE <= len(s) <= MAX_SENTENCE for s in GRAMMARS[_name])


def check_style(style: str) -> str:
    """``style`` if it is one of :data:`STYLES`, else a one-line error listing them."""
    check(style in STYLES, f"style={style!r} is unknown: expected one of {', '.join(STYLES)}")
    return style


def filler_ok(n_tokens: int) -> bool:
    """Whether exactly ``n_tokens`` of filler can be written as whole sentences (0 or >= 4)."""
    return n_tokens == 0 or n_tokens >= MIN_SENTENCE


def _realise(rng: random.Random, structure: Structure) -> list[int]:
    rand = rng.random
    return [(pool := _POOLS[slot])[int(rand() * len(pool))] for slot in structure]


class _Writer:
    """Writes sentences of one style: ``free()`` a sentence of the style's natural length, ``of_length(n)`` one of
    exactly ``n`` tokens (``MIN_SENTENCE <= n <= MAX_SENTENCE``)."""

    def __init__(self, style: str, rng: random.Random):
        self.style, self.rng = style, rng
        if style == "repeat":  # one to three sentences, drawn once and cycled
            base = [_realise(rng, rng.choice(GRAMMARS["svo"])) for _ in range(rng.randint(1, 3))]
            self._cycle = itertools.cycle(base)
            self._exact: dict[int, list[int]] = {}
        elif style == "mixture":
            self._sub = {s: _Writer(s, rng) for s in _MIXED}

    def free(self) -> list[int]:
        rng, style = self.rng, self.style
        if style in GRAMMARS:
            return _realise(rng, rng.choice(GRAMMARS[style]))
        if style == "salad":
            return self._salad(rng.randint(MIN_SENTENCE, MAX_SENTENCE))
        if style == "repeat":
            return list(next(self._cycle))
        return self._sub[rng.choice(_MIXED)].free()

    def of_length(self, n: int) -> list[int]:
        rng, style = self.rng, self.style
        if style in GRAMMARS:
            return _realise(rng, rng.choice(_BY_LENGTH[style][n]))
        if style == "salad":
            return self._salad(n)
        if style == "repeat":  # the same sentence for the same length, so the haystack stays repetitive
            if n not in self._exact:
                self._exact[n] = _realise(rng, rng.choice(_BY_LENGTH["svo"][n]))
            return list(self._exact[n])
        return self._sub[rng.choice(_MIXED)].of_length(n)

    def _salad(self, n: int) -> list[int]:
        rand = self.rng.random
        return [_ALL_WORDS[int(rand() * len(_ALL_WORDS))] for _ in range(n)]


def filler(rng: random.Random, n_tokens: int, style: str = "svo") -> tuple[list[int], list[int]]:
    """Whole sentences of ``style`` totalling exactly ``n_tokens`` tokens.

    Returns ``(ids, starts)``: the flat token ids ``[n_tokens]`` and the start offset of every sentence,
    followed by ``n_tokens`` (so ``starts`` lists the sentence boundaries where items may be inserted).
    """
    check_style(style)
    check(filler_ok(n_tokens), f"n_tokens={n_tokens} is invalid: filler needs 0 or >= {MIN_SENTENCE} tokens")
    writer = _Writer(style, rng)
    ids: list[int] = []
    starts: list[int] = []
    while n_tokens - len(ids) > 0:
        remaining = n_tokens - len(ids)
        if remaining <= MAX_SENTENCE:
            sentence = writer.of_length(remaining)
        else:
            sentence = writer.free()
            rest = remaining - len(sentence)
            if rest < MIN_SENTENCE:  # the rest could not be a whole sentence: split what remains in two
                first = min(MAX_SENTENCE, remaining - MIN_SENTENCE)
                sentence = writer.of_length(first)
        starts.append(len(ids))
        ids.extend(sentence)
    starts.append(len(ids))
    assert len(ids) == n_tokens
    return ids, starts
