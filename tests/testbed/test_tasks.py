"""Generators: exact lengths, determinism, seed splits, loss masks, filler purity, oracle budgets, scoring."""

import random
import re
import statistics
import time

import pytest
import torch

from kvlearn.errors import KVLearnError
from kvlearn.testbed import vocab as V
from kvlearn.testbed.checkers import solve
from kvlearn.testbed.tasks import (
    FAMILIES,
    MIN_LENGTH,
    VARIANTS,
    example_seed,
    generate,
    informative_positions,
    needed_positions,
    score,
    HELDOUT_REGIMES,
    REGIMES,
    SPLITS,
    TRAIN_REGIMES,
    haystack_of,
    seed_split,
)
from kvlearn.testbed.filler import HELDOUT_STYLES, STYLES, TRAIN_STYLES, filler
from kvlearn.testbed.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, VOCAB, WORD_TO_ID, ids_to_text

ALL = [(f, v) for f in FAMILIES for v in VARIANTS[f]]
FILLER_IDS = {WORD_TO_ID[w] for w in V.FILLER_WORDS}


def _text(ids, positions):
    return " ".join(VOCAB[ids[p]] for p in positions)


@pytest.mark.parametrize("family,variant", ALL)
def test_exact_lengths_and_framing(family, variant):
    rng = random.Random(hash((family, variant)) % 1000)
    lengths = [MIN_LENGTH, MIN_LENGTH + 1, 256, 257, 1000, 4096, 8192] + [rng.randint(MIN_LENGTH, 8192) for _ in range(6)]
    for i, length in enumerate(lengths):
        for dense in (False, True):
            e = generate(family, 1000 * i + 7, length, variant, dense=dense)
            assert len(e.prompt_ids) + len(e.answer_ids) == length == e.length
            assert e.prompt_ids[0] == BOS_ID and BOS_ID not in e.prompt_ids[1:]
            assert e.answer_ids[-1] == EOS_ID and EOS_ID not in e.answer_ids[:-1]
            # <eos> ends every answer: in the prompt only as the last token of a supervised in-context answer
            eos_at = [p for p, t in enumerate(e.prompt_ids) if t == EOS_ID]
            assert all(e.loss_mask_prompt[p] and not e.loss_mask_prompt[p + 1] for p in eos_at)
            assert dense or not eos_at
            assert PAD_ID not in e.input_ids and UNK_ID not in e.input_ids
            assert len(e.loss_mask_prompt) == len(e.prompt_ids)
            assert (e.family, e.variant, e.dense) == (family, variant, dense)
            assert e.prompt_text.endswith("answer :" if family != "trace" else "think :")


@pytest.mark.parametrize("family,variant", ALL)
def test_deterministic_per_seed(family, variant):
    for seed in (0, 1, 12345, 2**40 + 3):
        a = generate(family, seed, 2048, variant, dense=True)
        b = generate(family, seed, 2048, variant, dense=True)
        assert a == b
    others = {tuple(generate(family, s, 2048, variant).prompt_ids) for s in range(8)}
    assert len(others) == 8  # different seeds give different prompts


def test_variant_drawn_from_seed():
    drawn = [generate("niah", example_seed("niah", "eval", i), 256).variant for i in range(80)]
    assert set(drawn) == set(VARIANTS["niah"])
    assert drawn == [generate("niah", example_seed("niah", "eval", i), 256).variant for i in range(80)]


def test_seed_splits_are_disjoint():
    seen = {}
    for fam in FAMILIES:
        for split in ("train", "eval"):
            for i in list(range(2000)) + [2**50 + 5, 10**12]:
                s = example_seed(fam, split, i)
                assert s not in seen, (fam, split, i, seen.get(s))
                seen[s] = (fam, split, i)
                assert seed_split(s) == split
    with pytest.raises(KVLearnError, match="split"):
        example_seed("niah", "test", 0)
    with pytest.raises(KVLearnError, match="index"):
        example_seed("niah", "train", -1)


def test_bad_arguments_raise():
    with pytest.raises(KVLearnError, match="family='bogus'"):
        generate("bogus", 0, 1024)
    with pytest.raises(KVLearnError, match="variant='multikey'"):
        generate("vt", 0, 1024, "multikey")
    with pytest.raises(KVLearnError, match="length=64"):
        generate("niah", 0, 64)
    with pytest.raises(KVLearnError, match="seed=-1"):
        generate("niah", -1, 1024)


def _runs(mask):
    runs, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        if not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.parametrize("family,variant", ALL)
def test_in_context_answers_are_correct_and_only_answers(family, variant):
    for i in range(6):
        e = generate(family, example_seed(family, "train", i), 2048, variant, dense=True)
        runs = _runs(e.loss_mask_prompt)
        assert len(runs) >= 3
        for a, b in runs:
            before = ids_to_text(e.prompt_ids[:a])
            if family == "trace":  # a definition lookup: "question : what is p ? think :" -> "p = 4 . answer : 4"
                assert before.endswith("? think :")
                name, value = before.split()[-4], solve(family, before)
                assert ids_to_text(e.prompt_ids[a:b]) == f"{name} = {value} . answer : {value} <eos>"
                continue
            assert before.endswith("? answer :")
            # the supervised span is exactly the checker's answer to that in-context question, then <eos>
            assert ids_to_text(e.prompt_ids[a:b]) == solve(family, before) + " <eos>"
        assert not any(generate(family, example_seed(family, "eval", i), 2048, variant).loss_mask_prompt)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("style", STYLES)
def test_filler_is_pure(family, style):
    """Outside the items and the final question, the prompt holds only filler words (and ".")."""
    for i in range(3):
        e = generate(family, example_seed(family, "eval", i), 4096, dense=False, style=style)
        assert e.style == style
        covered = set(informative_positions(e))
        rest = [p for p in range(len(e.prompt_ids)) if p not in covered]
        assert all(e.prompt_ids[p] in FILLER_IDS or VOCAB[e.prompt_ids[p]] == "." for p in rest)
        # no digit, key, variable name or keyword anywhere but the covered positions
        text = _text(e.prompt_ids, rest)
        assert not re.search(r"\d", text)
        words = set(text.split())
        assert not words & (set(V.KEYS) | set(V.VT_NAMES) | set(V.TRACE_NAMES) | set(V.KEYWORDS))


def test_trace_thinking_sentences_come_from_the_fixed_set():
    sentences = {" ".join(s) for s in V.THINK_SENTENCES}
    for i in range(10):
        e = generate("trace", i, 4096)
        body = e.answer_text
        parts = re.split(r"step \d : \S+ = \S+ [+-] \S+ ; \S+ = \d ; \S+ = \d ; \d [+-] \d = \d ; \S+ = \d \. ?", body)
        assert parts[0] == "" and parts[-1].startswith("answer : ")
        assert all(p.strip() in sentences for p in parts[1:-1])


@pytest.mark.parametrize("family,variant", ALL)
def test_oracle_budget_at_4096(family, variant):
    """Keeping exactly needed_positions solves the task and fits in 512 tokens (CR 88% at 4096)."""
    for i in range(25):
        e = generate(family, example_seed(family, "eval", i), 4096, variant)
        needed = needed_positions(e)
        assert len(needed) <= 512 and needed == sorted(set(needed)) and needed[0] == 0
        assert len(informative_positions(e)) <= 512  # also a query-agnostic policy can fit everything
        assert set(needed) <= set(informative_positions(e))
        answer = ids_to_text(e.answer_ids[:-1])
        expected = answer.split()[-1] if family == "trace" else answer
        assert solve(family, _text(e.prompt_ids, needed)) == expected


def _window_coverage(e, length=4096, sinks=4, window=1020):
    question_start = e.needed_spans[-1][0]
    items = [p for p in needed_positions(e) if 0 < p < question_start]
    kept = [p for p in items if p < sinks or p >= length - window]
    return items, kept


@pytest.mark.parametrize("split", ["eval", "heldout"])
@pytest.mark.parametrize("family", FAMILIES)
def test_needed_items_are_spread_so_a_window_cache_fails(family, split):
    """Sinks 4 + recent window 1020 at context 4096 keeps few needed items, over the mixture of depth regimes of
    each split (only the ``tail`` regime, 1/5 of the examples, puts everything in the window)."""
    lost, all_kept = [], 0
    n = 100
    for i in range(n):
        e = generate(family, example_seed(family, split, i), 4096)
        items, kept = _window_coverage(e)
        lost.append(1 - len(kept) / len(items))
        all_kept += len(kept) == len(items)
        if e.regime == "uniform":
            assert 0 < len(items)
    assert statistics.mean(lost) > 0.5, statistics.mean(lost)
    assert all_kept / n < 0.45, all_kept / n


def test_trace_definitions_sit_in_the_first_half():
    for i in range(20):
        e = generate("trace", i, 4096)
        defs = [a for a, b in e.item_spans[:-1]]
        assert defs and max(defs) < len(e.prompt_ids) / 2 + 20


def test_scaling_with_length():
    def count(family, length, pattern):
        return statistics.mean(len(re.findall(pattern, generate(family, i, length).prompt_text)) for i in range(10))

    assert count("recall", 256, r" : \d \d \d \.") < count("recall", 1024, r" : \d \d \d \.") < count("recall", 4096, r" : \d \d \d \.")
    assert 32 <= count("recall", 4096, r" : \d \d \d \.") <= 64
    assert count("trace", 256, r"step \d :") < count("trace", 4096, r"step \d :") <= 8


@pytest.mark.parametrize("family,variant", ALL)
def test_score(family, variant):
    for i in range(5):
        e = generate(family, i, 512, variant)
        ans = list(e.answer_ids)
        assert score(e, ans)
        assert score(e, torch.tensor(ans))
        assert score(e, ans + [WORD_TO_ID["the"]] * 3)  # anything after <eos> is ignored
        wrong = list(ans)
        if family == "vt":
            wrong[0] = WORD_TO_ID["zulu" if VOCAB[ans[0]] != "zulu" else "alpha"]
        else:
            digit_at = max(j for j, t in enumerate(ans) if VOCAB[t].isdigit())
            wrong[digit_at] = WORD_TO_ID[str((int(VOCAB[ans[digit_at]]) + 1) % 10)]
        assert not score(e, wrong)
        assert not score(e, [])
        if family == "trace":
            # only the value after "answer :" counts
            junk = [WORD_TO_ID[w] for w in "answer :".split()] + [ans[-2], EOS_ID]
            assert score(e, junk)
        else:
            assert not score(e, ans[:-2] + [EOS_ID])  # truncated answer
            assert not score(e, ans[:-1] + [WORD_TO_ID[","], EOS_ID])  # extra tokens before <eos>


def test_generation_is_fast():
    for fam in FAMILIES:
        generate(fam, 0, 4096, dense=True)
    start = time.perf_counter()
    n = 0
    for i in range(10):
        for fam in FAMILIES:
            generate(fam, i, 4096, dense=True)
            n += 1
    per_example = (time.perf_counter() - start) / n
    assert per_example < 0.010, f"{per_example * 1e3:.1f} ms per 4096-token example"


def test_trace_in_context_lookups_follow_their_definition_and_leave_eval_prompts_unchanged():
    from kvlearn.testbed.tasks import trace_lookup_count

    assert [trace_lookup_count(n) for n in (128, 255, 256, 1024, 2048, 8192)] == [0, 0, 2, 8, 16, 16]
    for i in range(40):
        seed = example_seed("trace", "train", i)
        e = generate("trace", seed, 1024, dense=True)
        text = ids_to_text(e.prompt_ids)
        asked = re.findall(r"question : what is (\S) \? think : ", text)
        assert len(asked) == 8
        for name in asked:  # every asked name is defined before its question, and only once
            assert text.count(f"let {name} = ") == 1
            assert text.index(f"let {name} = ") < text.index(f"question : what is {name} ? think : ")
        # the dense draws come after every draw of the evaluation format: same program, answer and definitions
        plain = generate("trace", seed, 1024, dense=False)
        assert e.answer_ids == plain.answer_ids
        assert re.findall(r"let \S = \d", text) == re.findall(r"let \S = \d", ids_to_text(plain.prompt_ids))
        assert text.split("program :")[1] == ids_to_text(plain.prompt_ids).split("program :")[1]


def test_recall_in_context_questions_never_ask_a_single_key():
    """A one-key recall question ends like a niah question ("KEY ? answer :"); training must not pair that
    ending with recall's answer format."""
    question = WORD_TO_ID["question"]
    for i in range(30):
        e = generate("recall", example_seed("recall", "train", i), 1024, dense=True)
        for a, _ in _runs(e.loss_mask_prompt):
            start = max(j for j in range(a) if e.prompt_ids[j] == question)
            asked = e.prompt_ids[start + 2 : a - 3]  # between "question :" and "? answer :"
            assert len(asked) >= 2, ids_to_text(e.prompt_ids[start:a])


# ----------------------------------------------------------------------------------------------------------
# haystack styles, depth regimes and the held-out split


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("family,variant", ALL)
def test_every_style_and_regime_is_checked_by_the_independent_checker(family, variant, style, regime):
    split = "heldout" if style in HELDOUT_STYLES or regime in HELDOUT_REGIMES else "eval"
    for i in range(2):
        for dense in (False, True):
            e = generate(family, example_seed(family, split, i), 2048, variant, dense=dense, style=style, regime=regime)
            assert (e.style, e.regime) == (style, regime) and e.length == 2048
            answer = ids_to_text(e.answer_ids[:-1])
            expected = answer.split()[-1] if family == "trace" else answer
            assert solve(family, e.prompt_text) == expected


def _sentences(ids, starts):
    return [ids[a:b] for a, b in zip(starts, starts[1:])]


def test_styles_differ_as_documented():
    dot = WORD_TO_ID["."]
    out = {st: filler(random.Random(3), 600, st) for st in STYLES}
    for st, (ids, starts) in out.items():
        assert len(ids) == 600 and starts[0] == 0 and starts[-1] == 600
        sentences = _sentences(ids, starts)
        assert all(4 <= len(x) <= 12 for x in sentences)
        if st == "salad":
            assert dot not in ids
        elif st != "mixture":
            assert all(x[-1] == dot and dot not in x[:-1] for x in sentences)
    first_words = lambda st: {VOCAB[x[0]] for x in _sentences(*out[st])}  # noqa: E731
    assert first_words("svo") == {"the"}
    assert first_words("adverbial") <= set(V.FILLER_ADV)
    assert first_words("prepositional") <= set(V.FILLER_PREP)
    assert first_words("verb_first") <= set(V.FILLER_VERB)
    repeat = [tuple(x) for x in _sentences(*out["repeat"])]
    assert len(set(repeat)) <= 5 and len(repeat) > 50  # 1-3 cycled sentences (+ exact-length fillers)
    mix = out["mixture"][0]
    assert dot in mix and len({tuple(x) for x in _sentences(*out["mixture"])}) > 20


def test_needle_right_after_bos_is_generated_and_checked():
    """The ``head`` regime puts the first item right after ``<bos>`` half of the time."""
    at_one = 0
    for i in range(40):
        e = generate("niah", example_seed("niah", "eval", i), 4096, "single", regime="head")
        first_item = e.item_spans[0][0]
        assert first_item < 0.06 * 4096
        if first_item == 1:
            at_one += 1
            assert e.prompt_text.startswith("<bos> the special number for ")
            assert solve("niah", e.prompt_text) == ids_to_text(e.answer_ids[:-1])
    assert 8 <= at_one <= 32


@pytest.mark.parametrize("regime", REGIMES)
def test_depth_regimes_place_items_where_documented(regime):
    for i in range(20):
        e = generate("recall", example_seed("recall", "heldout" if regime in HELDOUT_REGIMES else "eval", i), 4096,
                     regime=regime)
        q = e.needed_spans[-1][0]
        starts = [a / q for a, _ in e.item_spans[:-1]]
        if regime == "head":
            assert max(starts) < 0.15  # 48 pairs of 6 tokens do not fit in 5% of the filler: they spill over
        elif regime == "tail":
            assert min(starts) > 0.85
        elif regime == "clustered":
            assert max(starts) - min(starts) < 0.2
        elif regime == "spread":  # evenly spaced: every fifth of the context holds items
            assert all(any(k / 5 <= d < (k + 1) / 5 for d in starts) for k in range(5))


def test_splits_draw_their_styles_and_regimes():
    seen = {split: set() for split in SPLITS}
    for split in SPLITS:
        for fam in FAMILIES:
            for i in range(150):
                seed = example_seed(fam, split, i)
                assert seed_split(seed) == split
                style, regime = haystack_of(seed)
                e = generate(fam, seed, 512)
                assert (e.style, e.regime) == (style, regime)
                seen[split].add((style, regime))
    assert {s for s, _ in seen["train"]} == set(TRAIN_STYLES) == {s for s, _ in seen["eval"]}
    assert {r for _, r in seen["train"]} == set(TRAIN_REGIMES) == {r for _, r in seen["eval"]}
    assert seen["heldout"] == {(s, r) for s in HELDOUT_STYLES for r in HELDOUT_REGIMES}


def test_train_seeds_never_take_a_heldout_style_or_regime():
    seed = example_seed("niah", "train", 5)
    for kwargs in ({"style": HELDOUT_STYLES[0]}, {"regime": HELDOUT_REGIMES[0]}):
        with pytest.raises(KVLearnError, match="never generated from a train seed"):
            generate("niah", seed, 1024, **kwargs)


def test_unknown_style_regime_split_are_one_line_errors():
    with pytest.raises(KVLearnError, match=r"style='prose' is unknown: expected one of svo, adverbial"):
        generate("niah", 1, 1024, style="prose")
    with pytest.raises(KVLearnError, match=r"regime='middle' is unknown: expected one of uniform, head"):
        generate("niah", 1, 1024, regime="middle")
    with pytest.raises(KVLearnError, match=r"split='test' is unknown: expected one of train, eval, heldout"):
        example_seed("niah", "test", 0)


def test_niah_in_context_probes_include_multivalue_keys_answered_in_document_order():
    """From 512 on, about a quarter of a dense niah row's probes give their key 2-4 needles; the in-context answer
    lists them in document order (what the checker, written apart, computes from the text)."""
    counts = {1: 0, 2: 0, 3: 0, 4: 0}
    for i in range(40):
        seed = example_seed("niah", "train", i)
        for length in (256, 2048):
            e = generate("niah", seed, length, "single", dense=True)
            text = ids_to_text(e.prompt_ids)
            for m in re.finditer(r"what is the special number for (\S+) \? answer : ([^<]*)<eos>", text):
                key, answer = m.group(1), m.group(2).strip()
                values = re.findall(rf"the special number for {key} is ((?:\d ){{4}})", text[:m.start()])
                assert answer == " , ".join(f"{key} is {v.strip()}" for v in values)  # every needle, in order
                n = len(values)
                assert n == 1 or length >= 512
                counts[n] += 1
    several = counts[2] + counts[3] + counts[4]
    assert min(counts[2], counts[3], counts[4]) > 0
    assert 0.15 < several / sum(counts.values()) < 0.35, counts


# SHA-256 (first 16 hex digits) of the first 100 evaluation examples of each split and family at 4096, as the harness
# draws them (prompt and answer ids): the set every committed accuracy table was measured on (since 68c180d). A change
# of the generator that moves them must say so and rerun the tables; training-only changes (dense rows) must not.
EVAL_SET_DIGESTS = {
    "eval/trace": "b520f87ab962721d", "eval/niah": "e9237feaa9a94bce", "eval/vt": "04803e756de40cde",
    "eval/recall": "997dd146b5f9df41", "heldout/trace": "8a30421493df632c", "heldout/niah": "ffbc7f45609bc553",
    "heldout/vt": "5d38dc52d30465db", "heldout/recall": "59fb1804c53fc10a",
}


def test_the_evaluation_set_is_the_one_the_tables_were_measured_on():
    import hashlib
    import json

    for name, digest in EVAL_SET_DIGESTS.items():
        split, family = name.split("/")
        h = hashlib.sha256()
        for i in range(100):
            e = generate(family, example_seed(family, split, i), 4096)
            h.update(json.dumps([e.prompt_ids, e.answer_ids]).encode())
        assert h.hexdigest()[:16] == digest, name


def _probes(text: str):
    """``(cut, answer)`` of every in-context niah probe of a dense prompt: the text up to its ``? answer :`` and the
    answer it gives (the final question has no ``<eos>`` after it, so it is not one)."""
    for m in re.finditer(r"what is the special number for \S+ \? answer :( [^<]*)<eos>", text):
        yield text[: m.start(1)], m.group(1).strip()


def test_multivalue_share_zero_never_gives_a_probe_several_needles_and_one_gives_every_probe_from_512():
    """``multivalue_share=0``: every in-context probe has one needle at every length; ``1``: from 512 on every probe's
    key has 2-4 needles (below 512 still one). The independent checker, cut at each probe's question, computes the
    same answer from the text (every needle of the key, in document order)."""
    seen = {0.0: set(), 1.0: set()}
    for share in (0.0, 1.0):
        for i in range(12):
            seed = example_seed("niah", "train", i)
            for length in (256, 512, 2048):
                e = generate("niah", seed, length, dense=True, multivalue_share=share)
                probes = list(_probes(ids_to_text(e.prompt_ids)))
                assert len(probes) == length // 256
                for cut, answer in probes:
                    assert solve("niah", cut) == answer
                    n = len(answer.split(" , "))
                    assert n == 1 if share == 0.0 or length < 512 else 2 <= n <= 4
                    seen[share].add(n)
    assert seen == {0.0: {1}, 1.0: {1, 2, 3, 4}}


def test_multivalue_share_is_validated_and_changes_only_dense_niah_rows():
    for bad in (-0.1, 1.5, True, "0.5", None):
        with pytest.raises(KVLearnError, match=r"multivalue_share=.* is invalid: expected a number in \[0, 1\]"):
            generate("niah", 1, 1024, dense=True, multivalue_share=bad)
    for family in FAMILIES:
        for i in range(4):
            seed = example_seed(family, "train", i)
            for dense in (False, True):
                a, b = (generate(family, seed, 1024, dense=dense, multivalue_share=s) for s in (0.0, 1.0))
                assert (a == b) == (family != "niah" or not dense), (family, i, dense)
            # below 512 the share is never drawn from: every share gives the same dense rows
            assert generate(family, seed, 256, dense=True, multivalue_share=0.0) == generate(family, seed, 256, dense=True)


# SHA-256 (first 16 hex digits) of json.dumps([prompt_ids, answer_ids, loss_mask_prompt, needed_spans, item_spans]) of
# niah examples made by the generator of commit 1880c5c (the one the shipped teacher was trained on, before e1df32b).
ROWS_1880C5C = {
    "train/0/512/dense": "41abf66d34eaa20a", "train/0/1024/dense": "a2375411d28b7ef1",
    "train/0/4096/dense": "c169cd4c2835703f", "train/1/512/dense": "0104a1933c738f4d",
    "train/1/1024/dense": "c78cd73fdb4f75f9", "train/1/4096/dense": "5c0865b5dfc06731",
    "train/2/512/dense": "a178e9e2949576fd", "train/2/1024/dense": "17dd5667c41dd1c5",
    "train/2/4096/dense": "bd675f63b5054a83", "eval/0/4096": "bf70a6c074e4eabc",
}


def _row_digest(e) -> str:
    import hashlib
    import json

    payload = [e.prompt_ids, e.answer_ids, e.loss_mask_prompt, e.needed_spans, e.item_spans]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


def _rows_1880c5c_calls(**kw):
    for name in ROWS_1880C5C:
        split, i, length, *dense = name.split("/")
        yield name, generate("niah", example_seed("niah", split, int(i)), int(length), dense=bool(dense), **kw)


def test_multivalue_share_zero_is_the_generator_of_1880c5c():
    """``multivalue_share=0`` gives byte for byte the rows of commit 1880c5c (the shipped teacher's training data).

    The constants were produced once with that commit's own code, not with this one: ``git worktree add /tmp/wt1880
    1880c5c``, then with ``PYTHONPATH=/tmp/wt1880/src`` (``kvlearn.testbed.tasks`` imported from the worktree) for
    ``i`` in 0, 1, 2 and ``length`` in 512, 1024, 4096: ``generate("niah", example_seed("niah", "train", i), length,
    dense=True)`` (variants drawn by the seed: single, single, multivalue), and one evaluation-format row
    ``generate("niah", example_seed("niah", "eval", 0), 4096)`` (multikey), each hashed as :func:`_row_digest` does;
    the worktree was removed after. (The same check over 25 seeds x 4 families x 256/512/2048 x dense/eval agreed.)
    At the default share the dense rows differ (the test can tell), the evaluation row does not."""
    for name, e in _rows_1880c5c_calls(multivalue_share=0.0):
        assert _row_digest(e) == ROWS_1880C5C[name], name
    for name, e in _rows_1880c5c_calls():
        assert (_row_digest(e) == ROWS_1880C5C[name]) == (not name.endswith("dense")), name
