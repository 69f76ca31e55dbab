"""Tokenizer and vocabulary: size, disjoint pools, round trips, AutoTokenizer loading."""

import json
import subprocess
import sys

import pytest

from kvlearn.errors import KVLearnError
from kvlearn.testbed import vocab as V
from kvlearn.testbed.tasks import FAMILIES, VARIANTS, generate
from kvlearn.testbed.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    VOCAB,
    VOCAB_SIZE,
    WORD_TO_ID,
    build_tokenizer,
    ids_to_text,
    save_tokenizer,
    word_ids,
)

POOLS = {
    "specials": V.SPECIALS,
    "digits": V.DIGITS,
    "punct": V.PUNCT,
    "keywords": V.KEYWORDS,
    "keys": V.KEYS,
    "vt_names": V.VT_NAMES,
    "trace_names": V.TRACE_NAMES,
    "think": V.THINK_WORDS,
    "filler": V.FILLER_WORDS,
}


def test_vocab_size_and_special_ids():
    assert 600 <= VOCAB_SIZE <= 1024
    assert len(set(VOCAB)) == VOCAB_SIZE
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert len(V.KEYS) >= 256


def test_pools_are_disjoint():
    names = list(POOLS)
    for i, a in enumerate(names):
        assert len(set(POOLS[a])) == len(POOLS[a]), a
        for b in names[i + 1 :]:
            assert not set(POOLS[a]) & set(POOLS[b]), (a, b, set(POOLS[a]) & set(POOLS[b]))
    # filler words are plain lowercase words of >= 2 letters: no digits, no single-letter variable names
    assert all(w.isalpha() and w.islower() and len(w) >= 2 for w in V.FILLER_WORDS)
    # "the" is the only word shared by the niah template and the filler
    assert "the" in V.FILLER_WORDS and "the" not in V.KEYWORDS


def test_vocab_is_deterministic_across_processes():
    code = "from kvlearn.testbed.vocab import all_words; print('|'.join(all_words()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out.split("|") == list(VOCAB)


def test_digits_are_single_tokens():
    tok = build_tokenizer()
    for d in range(10):
        assert tok.encode(str(d)) == [WORD_TO_ID[str(d)]]
    assert tok.encode("4 7 1 2") == [WORD_TO_ID[c] for c in "4712"]
    assert tok.decode(tok.encode("4 7 1 2")) == "4 7 1 2"


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_on_generated_text(family):
    tok = build_tokenizer()
    for i, variant in enumerate(VARIANTS[family]):
        e = generate(family, 100 + i, 512, variant, dense=True)
        text = ids_to_text(e.input_ids)
        body = ids_to_text(e.input_ids[1:-1])  # canonical text without specials
        assert tok.encode(text) == e.input_ids
        assert tok.decode(e.input_ids) == text
        assert tok.decode(tok.encode(body)) == body
        assert word_ids(body) == e.input_ids[1:-1]
        assert UNK_ID not in tok.encode(body)


def test_unknown_words():
    tok = build_tokenizer()
    assert tok.encode("the zzzunknownzzz river") == [WORD_TO_ID["the"], UNK_ID, WORD_TO_ID["river"]]
    with pytest.raises(KVLearnError, match="zzzunknownzzz"):
        word_ids("the zzzunknownzzz river")
    with pytest.raises(KVLearnError, match="token id"):
        ids_to_text([1, VOCAB_SIZE])


def test_save_and_auto_load(tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path / "tok")
    files = {p.name for p in (tmp_path / "tok").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= files
    assert json.loads((tmp_path / "tok" / "special_tokens_map.json").read_text())["bos_token"] == "<bos>"
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == VOCAB_SIZE
    text = "question : what is the special number for piano ? answer : 4 7 1 2 , 0 0 9 1"
    ids = tok.encode(text)
    assert ids == word_ids(text)  # no special tokens added
    assert tok.decode(ids) == text
    assert tok.decode([BOS_ID] + ids + [EOS_ID], skip_special_tokens=True) == text
    # batch padding pads with <pad> (id 0)
    batch = tok(["the river", "the old river moves"], padding=True)
    assert batch["input_ids"][0][-2:] == [PAD_ID, PAD_ID]


def test_save_into_a_file_path_raises(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(KVLearnError, match="directory"):
        save_tokenizer(f)
