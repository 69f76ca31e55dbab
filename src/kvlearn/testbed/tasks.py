"""Seeded long-context task generators: ``trace``, ``niah``, ``vt`` and ``recall``.

``generate(family, seed, length)`` returns an :class:`Example` whose prompt and answer together hold exactly
``length`` tokens; the filler (the haystack) absorbs whatever the task items leave. Everything is built as
token ids straight from :data:`~kvlearn.testbed.tokenizer.WORD_TO_ID` (a 4096-token example costs about
a millisecond of Python). The formats, the scaling with length and the design rationale are in
``docs/TESTBED.md``; :mod:`kvlearn.testbed.checkers` recomputes every answer from the prompt *text* alone.

Items (needles, pairs, assignments, definitions) are inserted between filler sentences at depths drawn from a
*depth regime* (:data:`REGIMES`: uniform, the first 5% with the first item right after ``<bos>`` half of the
time, the last 5%, one cluster, evenly spread), into a haystack of one *style* (:data:`kvlearn.testbed.filler.STYLES`).
Each example draws its style and regime from its seed's split: ``train`` and ``eval`` from the training styles
and regimes, ``heldout`` from the held-out ones, which training never sees. ``dense=True`` (what training uses)
adds in-context question/answer pairs whose answers are marked in ``loss_mask_prompt``.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from dataclasses import dataclass, field

from ..errors import KVLearnError, check, check_int
from .filler import HELDOUT_STYLES, TRAIN_STYLES, check_style, filler, filler_ok
from .tokenizer import BOS_ID, EOS_ID, WORD_TO_ID, ids_to_text
from .vocab import KEYS, THINK_SENTENCES, TRACE_NAMES, VT_NAMES

FAMILIES: tuple[str, ...] = ("trace", "niah", "vt", "recall")
VARIANTS: dict[str, tuple[str, ...]] = {
    "trace": ("default",),
    "niah": ("single", "multikey", "multivalue", "multiquery"),
    "vt": ("default",),
    "recall": ("default",),
}
SPLITS: tuple[str, ...] = ("train", "eval", "heldout")
TRAIN_REGIMES: tuple[str, ...] = ("uniform", "head", "tail", "clustered")
HELDOUT_REGIMES: tuple[str, ...] = ("spread",)
REGIMES: tuple[str, ...] = TRAIN_REGIMES + HELDOUT_REGIMES
_REGIME_WEIGHTS = (0.4, 0.2, 0.2, 0.2)  # of TRAIN_REGIMES: uniform depths stay the most common case
HEAD_FRACTION = 0.05  # "head" / "tail": the first / last 5% of the item range
CLUSTER_WIDTH = 0.1  # "clustered": every item of the example inside one window of 10% of the item range
MIN_LENGTH = 128
MAX_LENGTH = 16384

_W = WORD_TO_ID
_DIGITS = tuple(_W[str(d)] for d in range(10))
_KEY_IDS = tuple(_W[k] for k in KEYS)
_VT_IDS = tuple(_W[n] for n in VT_NAMES)
_TRACE_IDS = tuple(_W[n] for n in TRACE_NAMES)
_THINK = tuple(tuple(_W[w] for w in s) for s in THINK_SENTENCES)
_DOT, _COMMA, _COLON, _SEMI, _QMARK, _EQ, _PLUS, _MINUS = (_W[p] for p in ". , : ; ? = + -".split())
_IS, _VAR, _LET, _STEP = _W["is"], _W["var"], _W["let"], _W["step"]


def _ids(text: str) -> list[int]:
    return [_W[w] for w in text.split()]


_NEEDLE_PREFIX = _ids("the special number for")
_Q_SINGLE = _ids("question : what is the special number for")
_Q_MULTI = _ids("question : what are the special numbers for")
_Q_VT = _ids("question : which variables hold")
_Q_TRACE = _ids("question : what is")
_QUESTION = _ids("question :")
_ANSWER = _ids("? answer :")
_THINK_TAIL = _ids("? think :")
_PROGRAM = _ids("program :")
_FINAL = _ids("answer :")


@dataclass(frozen=True)
class Example:
    """One generated task instance.

    ``prompt_ids`` ``[P]`` starts with ``<bos>``; ``answer_ids`` ``[A]`` is the exact expected continuation
    and ends with ``<eos>``; ``P + A == length``. ``loss_mask_prompt`` ``[P]`` marks the in-context answers
    (dense training examples only) that training supervises besides the answer. ``needed_spans`` are the
    ``[start, end)`` prompt spans that the final answer depends on (the final question included);
    ``item_spans`` are the spans of every task item, distractors included.
    """

    family: str
    variant: str
    seed: int
    prompt_ids: list[int]
    answer_ids: list[int]
    loss_mask_prompt: list[bool]
    needed_spans: tuple[tuple[int, int], ...] = field(repr=False)
    item_spans: tuple[tuple[int, int], ...] = field(repr=False)
    dense: bool = False
    style: str = "svo"
    regime: str = "uniform"

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.answer_ids)

    @property
    def input_ids(self) -> list[int]:
        """Prompt followed by answer ``[length]``: what a training row holds."""
        return self.prompt_ids + self.answer_ids

    @property
    def prompt_text(self) -> str:
        return ids_to_text(self.prompt_ids)

    @property
    def answer_text(self) -> str:
        return ids_to_text(self.answer_ids)

    @property
    def text(self) -> str:
        return ids_to_text(self.input_ids)


# ----------------------------------------------------------------------------------------------------------
# assembly: items at random sentence boundaries of an exact-length filler


@dataclass
class _Item:
    ids: list[int]
    frac: float  # depth in [0, 1]: where in the filler the item goes
    needed: bool = False
    mask: list[bool] | None = None  # supervised positions inside the item (dense in-context answers)
    informative: bool = True



class _Haystack:
    """The haystack of one example: its filler ``style`` and its depth ``regime``.

    :meth:`depths` draws the sorted depths of ``n`` task items inside ``[lo, hi]`` (fractions of the filler):
    ``uniform``: i.i.d. uniform; ``head`` / ``tail``: uniform in the first / last 5% of the range, and in
    ``head`` the first call puts its first item exactly at ``lo`` (right after ``<bos>`` when ``lo = 0``) half of
    the time; ``clustered``: uniform inside one window of 10% of the range whose place is drawn once per example;
    ``spread``: evenly spaced, ``(i + 1/2 + j_i) / n`` with a jitter ``j_i`` uniform in [-0.4, 0.4].
    """

    def __init__(self, style: str, regime: str, rng: random.Random):
        self.style, self.regime, self.rng = style, regime, rng
        self._cluster_start = rng.random() * (1.0 - CLUSTER_WIDTH)
        self._first = True

    def depths(self, n: int, lo: float = 0.0, hi: float = 1.0) -> list[float]:
        rand, regime = self.rng.random, self.regime
        if regime == "uniform":
            u = [rand() for _ in range(n)]
        elif regime == "head":
            u = [HEAD_FRACTION * rand() for _ in range(n)]
            if self._first and n and rand() < 0.5:
                u[u.index(min(u))] = 0.0
        elif regime == "tail":
            u = [1.0 - HEAD_FRACTION * rand() for _ in range(n)]
        elif regime == "clustered":
            u = [self._cluster_start + CLUSTER_WIDTH * rand() for _ in range(n)]
        else:  # spread
            u = [(i + 0.5 + 0.8 * (rand() - 0.5)) / n for i in range(n)]
        self._first = self._first and n == 0
        return sorted(lo + (hi - lo) * x for x in u)


def _assemble(rng, hay: _Haystack, family, variant, seed, length, dense, items, tail, answer) -> Example:
    """Place ``items`` into exactly enough filler that ``1 + items + filler + tail + answer == length``.

    ``tail`` (the final question; for trace the program and the question) follows the filler and is always
    needed. Items at one sentence boundary keep their depth order, so an item with a larger ``frac`` never
    precedes one with a smaller ``frac``: dependent items (a hop after its source, a probe after its needle)
    rely on that.
    """
    fixed = 1 + sum(len(it.ids) for it in items) + len(tail) + len(answer)
    n_fill = length - fixed
    if not filler_ok(n_fill):
        raise KVLearnError(
            f"length={length} is too small for family={family!r} variant={variant!r}: its items need {fixed} "
            f"tokens plus 0 or >= 4 filler tokens"
        )
    fill, starts = filler(rng, n_fill, hay.style)
    n_bound = len(starts)
    placed = sorted(
        ((min(bisect_left(starts, it.frac * n_fill), n_bound - 1), it.frac, order, it) for order, it in enumerate(items)),
        key=lambda t: t[:3],
    )
    prompt = [BOS_ID]
    mask = [False]
    needed: list[tuple[int, int]] = []
    spans: list[tuple[int, int]] = []
    j = 0
    for b in range(n_bound):
        while j < len(placed) and placed[j][0] == b:
            it = placed[j][3]
            start = len(prompt)
            prompt.extend(it.ids)
            mask.extend(it.mask if it.mask is not None else [False] * len(it.ids))
            if it.needed:
                needed.append((start, len(prompt)))
            if it.informative:
                spans.append((start, len(prompt)))
            j += 1
        if b + 1 < n_bound:
            chunk = fill[starts[b] : starts[b + 1]]
            prompt.extend(chunk)
            mask.extend([False] * len(chunk))
    start = len(prompt)
    prompt.extend(tail)
    mask.extend([False] * len(tail))
    needed.append((start, len(prompt)))
    spans.append((start, len(prompt)))
    assert len(prompt) + len(answer) == length and len(mask) == len(prompt)
    return Example(family, variant, seed, prompt, answer, mask, tuple(needed), tuple(spans), dense, hay.style, hay.regime)


def _scale(length: int) -> float:
    """log2(length / 256): 0 at 256, 4 at 4096, 5 at 8192 (negative below 256)."""
    return math.log2(length / 256)


def _digits(rng: random.Random, n: int) -> list[int]:
    rand = rng.random
    return [_DIGITS[int(rand() * 10)] for _ in range(n)]


def _answer_mask(prefix_len: int, total_len: int) -> list[bool]:
    return [False] * prefix_len + [True] * (total_len - prefix_len)


# ----------------------------------------------------------------------------------------------------------
# niah: "the special number for KEY is D D D D ." needles; "question : what is the special number for KEY ?
# answer : KEY is D D D D <eos>" (every answer restates its key, so the value follows by plain induction)


# dense niah rows: the share of in-context probes whose key gets several needles (2..MULTIVALUE_PROBE_MAX), from 512 on
# (the default of generate's ``multivalue_share``; 0 gives the rows of 1880c5c, the generator the shipped teacher
# was trained on)
MULTIVALUE_PROBE_SHARE = 0.25
MULTIVALUE_PROBE_MAX = 4


def check_multivalue_share(share) -> float:
    """``share`` as a float if it is a number in [0, 1] (the share of dense niah probes with several needles), else
    a one-line error naming the value and the range."""
    ok = isinstance(share, (int, float)) and not isinstance(share, bool) and 0.0 <= share <= 1.0
    check(ok, f"multivalue_share={share!r} is invalid: expected a number in [0, 1]")
    return float(share)


def _needle(key: int, value: list[int]) -> list[int]:
    return _NEEDLE_PREFIX + [key, _IS] + value + [_DOT]


def _niah_answer(groups: list[tuple[int, list[int]]]) -> list[int]:
    """ "KEY is D D D D , KEY is D D D D ..." (no terminator)."""
    return [t for k, v in groups for t in [k, _IS] + v + [_COMMA]][:-1]


def _niah(rng: random.Random, hay: _Haystack, length: int, variant: str, dense: bool, seed: int,
          multivalue_share: float = MULTIVALUE_PROBE_SHARE) -> Example:
    n_probes = max(1, length // 256) if dense else 0
    n_keys = {"single": 1, "multikey": 4, "multivalue": 1, "multiquery": 4}[variant]
    keys = rng.sample(_KEY_IDS, n_keys + n_probes)
    task_keys, probe_keys = keys[:n_keys], keys[n_keys:]
    items: list[_Item] = []
    if variant == "multivalue":
        values = [_digits(rng, 4) for _ in range(4)]
        fracs = hay.depths(4)
        items += [_Item(_needle(task_keys[0], v), f, needed=True) for v, f in zip(values, fracs)]
        tail = _Q_SINGLE + [task_keys[0]] + _ANSWER
        answer = _niah_answer([(task_keys[0], v) for v in values])
    else:
        values = [_digits(rng, 4) for _ in task_keys]
        target = rng.randrange(n_keys) if variant == "multikey" else 0
        for i, (k, v, f) in enumerate(zip(task_keys, values, hay.depths(n_keys))):  # keys are a random sample
            items.append(_Item(_needle(k, v), f, needed=(variant == "multiquery" or i == target)))
        if variant == "multiquery":
            order = list(range(n_keys))
            rng.shuffle(order)
            tail = list(_Q_MULTI)
            for i in order:
                tail += [task_keys[i], _COMMA]
            tail = tail[:-1] + _ANSWER
            answer = _niah_answer([(task_keys[i], values[i]) for i in order])
        else:
            tail = _Q_SINGLE + [task_keys[target]] + _ANSWER
            answer = _niah_answer([(task_keys[target], values[target])])
    answer.append(EOS_ID)
    for k in probe_keys:  # dense: fresh needles of one key, then later a question about that key with its answer
        # from 512 on, a share of the probes (a quarter by default) give their key 2-4 needles, answered in document
        # order like the multivalue variant (the evaluation format's only other source of it: a sixteenth of the niah
        # rows). Share 0 draws nothing for it, so the random stream and every row are those of 1880c5c
        several = length >= 512 and multivalue_share > 0 and rng.random() < multivalue_share
        n_values = rng.randint(2, MULTIVALUE_PROBE_MAX) if several else 1
        values = [_digits(rng, 4) for _ in range(n_values)]
        fracs = sorted(rng.random() * 0.95 for _ in range(n_values))
        items += [_Item(_needle(k, v), f) for v, f in zip(values, fracs)]
        head = _Q_SINGLE + [k] + _ANSWER
        qa = head + _niah_answer([(k, v) for v in values]) + [EOS_ID]
        f = fracs[-1]
        items.append(_Item(qa, f + (1.0 - f) * rng.random(), mask=_answer_mask(len(head), len(qa)), informative=False))
    return _assemble(rng, hay, "niah", variant, seed, length, dense, items, tail, answer)


# ----------------------------------------------------------------------------------------------------------
# vt: "var NAME = D D D D D ." then hops "var NAME2 = var NAME1 ."; "question : which variables hold V ?"


def _vt(rng: random.Random, hay: _Haystack, length: int, variant: str, dense: bool, seed: int) -> Example:
    s = _scale(length)
    lo = 3 if length < 1024 else 4
    n_chains = min(6, max(2, 2 + round(s))) if dense else 1 + rng.randint(1, 2)
    sizes = [rng.randint(lo, lo + 1) for _ in range(n_chains)]
    names = rng.sample(_VT_IDS, sum(sizes))
    # chain values differ from each other at every digit position: one digit token tells the chains apart
    columns = [rng.sample(_DIGITS, n_chains) for _ in range(5)]
    values = [[columns[p][c] for p in range(5)] for c in range(n_chains)]
    items: list[_Item] = []
    chains = []
    used = 0
    for c, size in enumerate(sizes):
        chain = names[used : used + size]
        used += size
        chains.append(chain)
        fracs = hay.depths(size)
        needed = c == 0
        items.append(_Item([_VAR, chain[0], _EQ] + values[c] + [_DOT], fracs[0], needed=needed))
        for a, b, f in zip(chain, chain[1:], fracs[1:]):
            items.append(_Item([_VAR, b, _EQ, _VAR, a, _DOT], f, needed=needed))
        if dense and c > 0:  # in-context question about a finished distractor chain
            qa = _Q_VT + values[c] + _ANSWER + chain + [EOS_ID]
            f = fracs[-1] + (1.0 - fracs[-1]) * rng.random()
            items.append(_Item(qa, f, mask=_answer_mask(len(qa) - size - 1, len(qa)), informative=False))
    tail = _Q_VT + values[0] + _ANSWER
    answer = chains[0] + [EOS_ID]
    return _assemble(rng, hay, "vt", variant, seed, length, dense, items, tail, answer)


# ----------------------------------------------------------------------------------------------------------
# recall: pairs "KEY : D D D ." then "question : K1 K2 ... ? answer : K1 : D D D , K2 : D D D <eos>"


def _recall_answer(keys: list[int], value_of: dict[int, list[int]]) -> list[int]:
    return [t for k in keys for t in [k, _COLON] + value_of[k] + [_COMMA]][:-1]


def _recall(rng: random.Random, hay: _Haystack, length: int, variant: str, dense: bool, seed: int) -> Example:
    s = _scale(length)
    n_pairs = min(64, max(4, round(8 + 10 * s)))
    n_query = min(8, max(2, 4 + math.floor(s)), n_pairs)
    keys = rng.sample(_KEY_IDS, n_pairs)
    value_of = {k: _digits(rng, 3) for k in keys}
    fracs = hay.depths(n_pairs)  # keys are a random sample, so sorted depths stay unrelated to the keys
    queried = rng.sample(keys, n_query)
    qset = set(queried)
    items = [_Item([k, _COLON] + value_of[k] + [_DOT], f, needed=k in qset) for k, f in zip(keys, fracs)]
    if dense:  # in-context questions about 2-3 pairs seen earlier
        after = fracs[1]  # questions come after the second pair, whatever the depth regime put the pairs
        for _ in range(max(1, length // 256)):
            f = after + (1.0 - after) * rng.random()
            seen = [k for k, kf in zip(keys, fracs) if kf < f]
            if len(seen) < 2:
                continue
            # never a single key: "question : KEY ? answer :" ends like a niah question, and the first teacher
            # answered single-needle niah questions in recall's format ("KEY : D D D") - docs/TESTBED.md
            ask = rng.sample(seen, min(len(seen), rng.randint(2, 3)))
            head = _QUESTION + ask + _ANSWER
            qa = head + _recall_answer(ask, value_of) + [EOS_ID]
            items.append(_Item(qa, f, mask=_answer_mask(len(head), len(qa)), informative=False))
    tail = _QUESTION + queried + _ANSWER
    answer = _recall_answer(queried, value_of) + [EOS_ID]
    return _assemble(rng, hay, "recall", variant, seed, length, dense, items, tail, answer)


# ----------------------------------------------------------------------------------------------------------
# trace: "let a = 7 ." definitions early; at the end "program : step 1 : c = a + b ; ... question : what is X ?
# think :"; the answer executes it: "step 1 : c = a + b ; a = 7 ; b = 3 ; 7 + 3 = 0 ; c = 0 . <thinking> step 2 : ..."


def _trace(rng: random.Random, hay: _Haystack, length: int, variant: str, dense: bool, seed: int) -> Example:
    s = _scale(length)
    hi = min(9, 4 + math.floor(s)) if length >= 256 else 2
    n_steps = rng.randint(max(2, hi - 4), hi)
    n_defs = n_steps // 2 + rng.randint(2, 3)
    names = rng.sample(_TRACE_IDS, n_defs + n_steps)
    defs, lhs = names[:n_defs], names[n_defs:]
    value = {n: int(rng.random() * 10) for n in defs}
    used: set[int] = set()
    steps = []
    for k, x in enumerate(lhs):
        avail = defs + lhs[:k]
        chain = k > 0 and (k == n_steps - 1 or rng.random() < 0.6)  # the last step reads the previous result
        a = lhs[k - 1] if chain else rng.choice(avail)
        pool = defs if rng.random() < 0.7 else avail
        b = rng.choice([n for n in pool if n != a])
        plus = rng.random() < 0.5
        value[x] = (value[a] + value[b]) % 10 if plus else (value[a] - value[b]) % 10
        used.update(n for n in (a, b) if n in defs)
        steps.append((x, a, b, plus))
    items = [  # definitions in the first half of the filler (defs are a random sample of names)
        _Item([_LET, n, _EQ, _DIGITS[value[n]], _DOT], f, needed=n in used) for n, f in zip(defs, hay.depths(n_defs, 0.0, 0.5))
    ]
    tail = list(_PROGRAM)
    answer: list[int] = []
    for k, (x, a, b, plus) in enumerate(steps):
        op = _PLUS if plus else _MINUS
        line = [_STEP, _DIGITS[k + 1], _COLON, x, _EQ, a, op, b, _SEMI]
        tail += line
        # restate each operand's binding ("a = 7 ; b = 3 ;") before using it: the value is then the continuation of
        # the bigram "a =" (a plain induction copy, as in niah and recall), not a lookup of a name four tokens back
        answer += line + [a, _EQ, _DIGITS[value[a]], _SEMI, b, _EQ, _DIGITS[value[b]], _SEMI]
        answer += [_DIGITS[value[a]], op, _DIGITS[value[b]], _EQ, _DIGITS[value[x]], _SEMI]
        answer += [x, _EQ, _DIGITS[value[x]], _DOT]
        if k + 1 < n_steps:
            answer += rng.choice(_THINK)
    tail += _Q_TRACE + [lhs[-1]] + _THINK_TAIL
    answer += _FINAL + [_DIGITS[value[lhs[-1]]], EOS_ID]
    if dense:  # in-context lookups of definitions seen earlier, in the restated form the trace itself uses
        items += _trace_lookups(rng, defs, items, value, length)
    return _assemble(rng, hay, "trace", variant, seed, length, dense, items, tail, answer)


def trace_lookup_count(length: int) -> int:
    """In-context definition lookups of a dense trace prompt: one per 128 tokens, at most 16 (2 at 256, 8 at 1024,
    16 from 2048 on); none below 256, where the program and its trace leave as few as 13 filler tokens."""
    return min(16, length // 128) if length >= 256 else 0


def _trace_lookups(rng: random.Random, defs: list[int], def_items: list[_Item], value: dict[int, int], length: int):
    """``question : what is p ? think : p = 4 . answer : 4 <eos>`` after the definition of ``p`` (supervised from
    ``p`` on): the name -> value copy that every restated operand of the trace needs, asked on its own. Names are
    drawn with replacement from the definitions; each question goes at a depth after its definition's."""
    out = []
    for _ in range(trace_lookup_count(length)):
        j = rng.randrange(len(defs))
        name, after = defs[j], def_items[j].frac
        head = _Q_TRACE + [name] + _THINK_TAIL
        digit = _DIGITS[value[name]]
        qa = head + [name, _EQ, digit, _DOT] + _FINAL + [digit, EOS_ID]
        out.append(_Item(qa, after + (1.0 - after) * rng.random(), mask=_answer_mask(len(head), len(qa)), informative=False))
    return out


_GENERATORS = {"trace": _trace, "niah": _niah, "vt": _vt, "recall": _recall}


# ----------------------------------------------------------------------------------------------------------
# public API


def _check_family(family) -> None:
    check(family in FAMILIES, f"family={family!r} is invalid: expected one of {FAMILIES}")


def example_seed(family: str, split: str, index: int) -> int:
    """The generator seed of example ``index`` of ``family`` in ``split`` (one of :data:`SPLITS`).

    ``index * 12 + split * 4 + family``: the splits (and the four families) never share a seed, and
    :func:`seed_split` recovers the split, which decides the haystack styles and depth regimes an example may use.
    """
    _check_family(family)
    check_split(split)
    check_int("index", index, 0)
    return index * 12 + SPLITS.index(split) * 4 + FAMILIES.index(family)


def check_split(split: str) -> str:
    """``split`` if it is one of :data:`SPLITS`, else a one-line error listing them."""
    check(split in SPLITS, f"split={split!r} is unknown: expected one of {', '.join(SPLITS)}")
    return split


def check_regime(regime: str) -> str:
    """``regime`` if it is one of :data:`REGIMES`, else a one-line error listing them."""
    check(regime in REGIMES, f"regime={regime!r} is unknown: expected one of {', '.join(REGIMES)}")
    return regime


def seed_split(seed: int) -> str:
    """The split that :func:`example_seed` drew ``seed`` from."""
    return SPLITS[(seed % 12) // 4]


def haystack_of(seed: int) -> tuple[str, str]:
    """The ``(style, regime)`` that ``seed`` draws: training styles/regimes for the ``train`` and ``eval`` splits
    (styles uniform, regimes with :data:`_REGIME_WEIGHTS`), held-out ones for ``heldout``."""
    rng = random.Random(f"kvlearn-haystack:{seed}")
    if seed_split(seed) == "heldout":
        return rng.choice(HELDOUT_STYLES), rng.choice(HELDOUT_REGIMES)
    return rng.choice(TRAIN_STYLES), rng.choices(TRAIN_REGIMES, weights=_REGIME_WEIGHTS)[0]


def generate(
    family: str, seed: int, length: int, variant: str | None = None, dense: bool = False,
    style: str | None = None, regime: str | None = None, multivalue_share: float = MULTIVALUE_PROBE_SHARE,
) -> Example:
    """One example of ``family`` with ``len(prompt_ids) + len(answer_ids) == length``.

    ``variant`` (see :data:`VARIANTS`), ``style`` (:data:`STYLES`) and ``regime`` (:data:`REGIMES`) are drawn from
    the seed when None (:func:`haystack_of`). A ``train``-split seed never takes a held-out style or regime, not
    even when asked, so training cannot see them. ``dense=True`` adds in-context question/answer pairs marked in
    ``loss_mask_prompt`` (training); the evaluation format is ``dense=False``. ``multivalue_share`` (in [0, 1]): the
    share of a dense niah row's in-context probes, from length 512 on, whose key gets 2..:data:`MULTIVALUE_PROBE_MAX`
    needles; 0 gives exactly the rows of commit 1880c5c (the shipped teacher's training data). It changes nothing
    else: not the other families, not the evaluation format. The same arguments always give the same example.
    """
    _check_family(family)
    check_int("seed", seed, 0)
    check_int("length", length, MIN_LENGTH, MAX_LENGTH)
    if variant is None:
        variant = VARIANTS[family][random.Random(seed ^ 0x5EED).randrange(len(VARIANTS[family]))]
    check(variant in VARIANTS[family], f"variant={variant!r} is invalid for family={family!r}: expected one of {VARIANTS[family]}")
    drawn_style, drawn_regime = haystack_of(seed)
    style = drawn_style if style is None else check_style(style)
    regime = drawn_regime if regime is None else check_regime(regime)
    check(
        seed_split(seed) != "train" or (style not in HELDOUT_STYLES and regime not in HELDOUT_REGIMES),
        f"style={style!r} / regime={regime!r}: held-out styles {HELDOUT_STYLES} and regimes {HELDOUT_REGIMES} "
        f"are never generated from a train seed (seed={seed})",
    )
    multivalue_share = check_multivalue_share(multivalue_share)
    rng = random.Random(seed)
    hay = _Haystack(style, regime, random.Random(f"kvlearn-depths:{seed}"))
    if family == "niah":
        return _niah(rng, hay, length, variant, bool(dense), seed, multivalue_share)
    return _GENERATORS[family](rng, hay, length, variant, bool(dense), seed)


def _positions(spans) -> list[int]:
    out = {0}
    for a, b in spans:
        out.update(range(a, b))
    return sorted(out)


def needed_positions(example: Example) -> list[int]:
    """Sorted prompt positions that the final answer depends on: ``<bos>`` (position 0), the needed needles /
    assignments / pairs / definitions, and the final question (for trace: the program and the question).

    A cache that keeps exactly these tokens can answer; at length 4096 there are at most 512 of them.
    """
    return _positions(example.needed_spans)


def informative_positions(example: Example) -> list[int]:
    """Sorted prompt positions of ``<bos>``, every task item (distractors and unused definitions included)
    and the final question: what a policy that cannot see the question would have to keep. In-context
    question/answer pairs of dense examples are not counted."""
    return _positions(example.item_spans)


def _as_list(ids) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    try:
        return [int(i) for i in ids]
    except (TypeError, ValueError):
        raise KVLearnError(f"generated_ids={ids!r:.60} is invalid: expected a 1-D sequence of token ids") from None


def score(example: Example, generated_ids) -> bool:
    """Exact match of a generated continuation (token ids, ``[n]``) against ``example``.

    The generation is cut at its first ``<eos>``. niah / vt / recall: what remains must equal the answer
    (without its ``<eos>``). trace: only the token after the first "answer :" counts, and it must be the
    final value.
    """
    gen = _as_list(generated_ids)
    if EOS_ID in gen:
        gen = gen[: gen.index(EOS_ID)]
    if example.family == "trace":
        for i in range(len(gen) - 2):
            if gen[i] == _FINAL[0] and gen[i + 1] == _FINAL[1]:
                return gen[i + 2] == example.answer_ids[-2]
        return False
    return gen == example.answer_ids[:-1]
