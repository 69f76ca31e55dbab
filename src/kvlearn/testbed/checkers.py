"""Independent answer checkers: recompute the expected answer from the decoded prompt TEXT alone.

Nothing here imports the generators: every rule is re-derived from the surface format (regular
expressions, and a tiny interpreter for the trace program), so a generator bug shows up as a disagreement
between ``solve(family, decode(prompt_ids))`` and the generator's ``answer_ids``.

Only the final question counts: it is the last "question :" of the prompt. In-context question/answer
pairs of dense training prompts (each answer ends with ``<eos>``, like the final one) restate values that
agree with the items; the item patterns below need an item's whole template, ending with `` .`` (which no answer
restatement has), and start after any word, since a word-salad haystack has no sentence ends.
"""

from __future__ import annotations

import re

from ..errors import KVLearnError, check

_FAMILIES = ("trace", "niah", "vt", "recall")

_NEEDLE = re.compile(r"(?:^|(?<= ))the special number for (\S+) is (\d \d \d \d) \.")
_Q_NIAH_ONE = re.compile(r"what is the special number for (\S+) \? answer :$")
_Q_NIAH_MANY = re.compile(r"what are the special numbers for (\S+(?: , \S+)*) \? answer :$")

_VT_STATEMENT = re.compile(r"(?:^|(?<= ))var (\S+) = (?:(\d \d \d \d \d)|var (\S+)) \.")
_Q_VT = re.compile(r"which variables hold (\d \d \d \d \d) \? answer :$")

_PAIR = re.compile(r"(?:^|(?<= ))(\S+) : (\d \d \d) \.")
_Q_RECALL = re.compile(r"(\S+(?: \S+)*) \? answer :$")

_DEF = re.compile(r"(?:^|(?<= ))let (\S+) = (\d) \.")
_PROGRAM = re.compile(r"program : (.*) question : what is (\S+) \? think :$")
_STEP = re.compile(r"step (\d) : (\S+) = (\S+) ([+-]) (\S+)")


def _final_question(prompt_text: str) -> str:
    cut = prompt_text.rfind("question : ")
    check(cut >= 0, f"prompt_text={prompt_text[-60:]!r} is invalid: expected a final 'question :'")
    return prompt_text[cut + len("question : ") :].strip()


def _fail(family: str, what: str) -> KVLearnError:
    return KVLearnError(f"prompt_text is invalid for family={family!r}: {what}")


def _niah(text: str) -> str:
    q = _final_question(text)
    needles: dict[str, list[str]] = {}
    for m in _NEEDLE.finditer(text):
        needles.setdefault(m.group(1), []).append(m.group(2))
    if m := _Q_NIAH_ONE.match(q):
        values = needles.get(m.group(1))
        if not values:
            raise _fail("niah", f"no needle for key {m.group(1)!r}")
        return " , ".join(f"{m.group(1)} is {v}" for v in values)  # every needle of the key, in order
    if m := _Q_NIAH_MANY.match(q):
        keys = m.group(1).split(" , ")
        if any(k not in needles for k in keys):
            raise _fail("niah", f"a queried key has no needle: {keys}")
        return " , ".join(f"{k} is {v}" for k in keys for v in needles[k])
    raise _fail("niah", f"unrecognised final question {q!r}")


def _vt(text: str) -> str:
    q = _final_question(text)
    m = _Q_VT.match(q)
    if not m:
        raise _fail("vt", f"unrecognised final question {q!r}")
    env: dict[str, str] = {}
    order: list[str] = []
    for s in _VT_STATEMENT.finditer(text):
        name, literal, source = s.groups()
        if literal is None and source not in env:
            raise _fail("vt", f"variable {source!r} is read before it is assigned")
        env[name] = literal if literal is not None else env[source]
        order.append(name)
    return " ".join(n for n in order if env[n] == m.group(1))


def _recall(text: str) -> str:
    q = _final_question(text)
    m = _Q_RECALL.match(q)
    if not m:
        raise _fail("recall", f"unrecognised final question {q!r}")
    pairs: dict[str, str] = {}
    for p in _PAIR.finditer(text):
        pairs.setdefault(p.group(1), p.group(2))
    keys = m.group(1).split()
    if any(k not in pairs for k in keys):
        raise _fail("recall", f"a queried key has no pair: {keys}")
    return " , ".join(f"{k} : {pairs[k]}" for k in keys)


def _definitions(text: str) -> dict[str, int]:
    """The values of a trace prompt's ``let X = D .`` definitions."""
    return {m.group(1): int(m.group(2)) for m in _DEF.finditer(text)}


def _run_trace(text: str) -> tuple[list[str], dict[str, int], str]:
    """Interpret a trace prompt: (executed step lines, final environment, the questioned variable)."""
    env = _definitions(text)
    m = _PROGRAM.search(text)
    if not m:
        raise _fail("trace", "no 'program : ... question : what is X ? think :' at the end")
    lines = []
    for expected_step, raw in enumerate(m.group(1).split(" ; "), start=1):
        raw = raw.strip(" ;")
        s = _STEP.fullmatch(raw)
        if not s:
            raise _fail("trace", f"unrecognised program line {raw!r}")
        n, x, a, op, b = s.groups()
        if int(n) != expected_step or a not in env or b not in env:
            raise _fail("trace", f"program line {raw!r} is out of order or reads an undefined variable")
        va, vb = env[a], env[b]
        env[x] = (va + vb) % 10 if op == "+" else (va - vb) % 10
        lines.append(f"{raw} ; {a} = {va} ; {b} = {vb} ; {va} {op} {vb} = {env[x]} ; {x} = {env[x]} .")
    return lines, env, m.group(2)


def trace_steps(prompt_text: str) -> list[str]:
    """The executed program of a trace prompt, one line per step:
    ``"step N : X = A op B ; A = va ; B = vb ; va op vb = r ; X = r ."`` (what the generated trace must contain, in order)."""
    return _run_trace(prompt_text.strip())[0]


_Q_LOOKUP = re.compile(r"what is (\S+) \? think :$")


def _trace(text: str) -> str:
    if "program : " not in text:  # an in-context lookup of a dense prompt: "question : what is p ? think :"
        m = _Q_LOOKUP.match(_final_question(text))
        if not m:
            raise _fail("trace", "no 'program : ... question : what is X ? think :' at the end")
        env = _definitions(text)
        if m.group(1) not in env:
            raise _fail("trace", f"the question asks for {m.group(1)!r}, which is never defined")
        return str(env[m.group(1)])
    _, env, x = _run_trace(text)
    if x not in env:
        raise _fail("trace", f"the question asks for {x!r}, which is never defined")
    return str(env[x])


_SOLVERS = {"trace": _trace, "niah": _niah, "vt": _vt, "recall": _recall}


def solve(family: str, prompt_text: str) -> str:
    """The expected answer, recomputed from the prompt text (special tokens such as ``<bos>`` may be present).

    niah / vt / recall: the whole answer text without ``<eos>``; trace: the final value (one digit), or for an
    in-context lookup of a dense prompt (a prompt cut before its program) the asked definition's value.
    """
    check(family in _SOLVERS, f"family={family!r} is invalid: expected one of {_FAMILIES}")
    check(isinstance(prompt_text, str), f"prompt_text of type {type(prompt_text).__name__} is invalid: expected str")
    return _SOLVERS[family](prompt_text.strip())
