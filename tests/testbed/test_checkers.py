"""Checkers recompute every answer from the decoded prompt text; hand-written prompts pin the rules."""

import pytest

from kvlearn.errors import KVLearnError
from kvlearn.testbed.checkers import solve, trace_steps
from kvlearn.testbed.tasks import FAMILIES, VARIANTS, example_seed, generate
from kvlearn.testbed.tokenizer import build_tokenizer

ALL = [(f, v) for f in FAMILIES for v in VARIANTS[f]]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("family,variant", ALL)
@pytest.mark.parametrize("length", [256, 1024, 4096])
def test_checker_agrees_with_generator(tok, family, variant, length):
    for i in range(12):
        dense = i % 3 == 2
        split = "train" if dense else "eval"
        e = generate(family, example_seed(family, split, i), length, variant, dense=dense)
        prompt = tok.decode(e.prompt_ids)  # the HF tokenizer, not the generator's helpers
        answer = tok.decode(e.answer_ids, skip_special_tokens=True)
        if family == "trace":
            assert answer.endswith("answer : " + solve(family, prompt))
            pos = 0
            for line in trace_steps(prompt):  # every executed step, in order, in the generated trace
                found = answer.find(line, pos)
                assert found >= 0, (line, answer)
                pos = found + len(line)
        else:
            assert solve(family, prompt) == answer


def test_niah_by_hand():
    hay = "the river moves ."
    prompt = (
        f"<bos> {hay} the special number for piano is 1 2 3 4 . {hay} the special number for frog is 9 8 7 6 . "
        f"{hay} the special number for piano is 0 0 0 5 . {hay} question : what is the special number for frog ? answer :"
    )
    assert solve("niah", prompt) == "frog is 9 8 7 6"
    assert solve("niah", prompt.replace("for frog ? answer", "for piano ? answer")) == "piano is 1 2 3 4 , piano is 0 0 0 5"
    multi = prompt.replace("what is the special number for frog", "what are the special numbers for frog , piano")
    assert solve("niah", multi) == "frog is 9 8 7 6 , piano is 1 2 3 4 , piano is 0 0 0 5"  # every needle of each key
    # an in-context question/answer is not a needle
    probe = prompt.replace(
        f"{hay} question : what is the special number for frog ? answer :",
        "question : what is the special number for piano ? answer : piano is 1 2 3 4 . question : what is the "
        "special number for frog ? answer :",
    )
    assert solve("niah", probe) == "frog is 9 8 7 6"
    with pytest.raises(KVLearnError, match="no needle"):
        solve("niah", prompt.replace("for frog ? answer", "for whale ? answer"))


def test_vt_by_hand():
    prompt = (
        "<bos> var alpha = 1 2 3 4 5 . the river moves . var beta = 5 4 3 2 1 . var gamma = var alpha . "
        "the old river moves . var delta = var beta . var echo = var gamma . "
        "question : which variables hold 1 2 3 4 5 ? answer :"
    )
    assert solve("vt", prompt) == "alpha gamma echo"
    assert solve("vt", prompt.replace("hold 1 2 3 4 5", "hold 5 4 3 2 1")) == "beta delta"
    with pytest.raises(KVLearnError, match="read before"):
        solve("vt", prompt.replace("var gamma = var alpha", "var gamma = var zulu"))


def test_recall_by_hand():
    prompt = (
        "<bos> cat : 1 2 3 . the river moves . dog : 4 5 6 . question : cat ? answer : cat : 1 2 3 . "
        "owl : 0 0 7 . question : owl cat dog ? answer :"
    )
    assert solve("recall", prompt) == "owl : 0 0 7 , cat : 1 2 3 , dog : 4 5 6"
    with pytest.raises(KVLearnError, match="no pair"):
        solve("recall", prompt.replace("owl cat dog ?", "owl bee ?"))


def test_trace_by_hand():
    prompt = (
        "<bos> let a = 7 . the river moves . let b = 3 . let z = 9 . the old river moves . "
        "program : step 1 : c = a + b ; step 2 : d = c - a ; step 3 : e = d - z ; "
        "question : what is e ? think :"
    )
    # c = 7 + 3 = 0, d = 0 - 7 = 3 (mod 10), e = 3 - 9 = 4 (mod 10)
    assert trace_steps(prompt) == [
        "step 1 : c = a + b ; a = 7 ; b = 3 ; 7 + 3 = 0 ; c = 0 .",
        "step 2 : d = c - a ; c = 0 ; a = 7 ; 0 - 7 = 3 ; d = 3 .",
        "step 3 : e = d - z ; d = 3 ; z = 9 ; 3 - 9 = 4 ; e = 4 .",
    ]
    assert solve("trace", prompt) == "4"
    assert solve("trace", prompt.replace("what is e", "what is c")) == "0"
    with pytest.raises(KVLearnError, match="undefined"):
        solve("trace", prompt.replace("e = d - z", "e = d - q"))
    with pytest.raises(KVLearnError, match="program"):
        solve("trace", prompt.replace("think :", "answer :"))
    # an in-context lookup of a dense prompt (cut before the program): the definition's value
    lookup = "<bos> let a = 7 . the river moves . let b = 3 . question : what is a ? think : a = 7 . answer : 7 <eos> " \
        "the old river moves . question : what is b ? think :"
    assert solve("trace", lookup) == "3"
    assert solve("trace", lookup.replace("what is b ?", "what is a ?")) == "7"
    with pytest.raises(KVLearnError, match="'q', which is never defined"):
        solve("trace", lookup.replace("what is b ?", "what is q ?"))
    with pytest.raises(KVLearnError, match="program"):
        solve("trace", lookup.replace("think :", "answer :"))


def test_bad_input():
    with pytest.raises(KVLearnError, match="family"):
        solve("bogus", "question : x ? answer :")
    with pytest.raises(KVLearnError, match="question"):
        solve("niah", "the river moves .")
    with pytest.raises(KVLearnError, match="prompt_text"):
        solve("niah", [1, 2, 3])
