"""The testbed tokenizer: word level, one token per whitespace-separated word, vocabulary < 1024.

Canonical text is tokens separated by single spaces; a number is written digit by digit ("4 7 1 2"), each
digit one token. ``decode(encode(text)) == text`` for canonical text. The tokenizer adds no special tokens
when encoding: the generators put ``<bos>`` at the start of every prompt themselves.

Generators never tokenize strings: they build id lists from :data:`WORD_TO_ID` (a plain dict) and decode
with :func:`ids_to_text`, which is what makes a 4096-token example cost a few milliseconds of Python.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

from ..errors import KVLearnError, check
from .vocab import all_words

VOCAB: tuple[str, ...] = all_words()
WORD_TO_ID: dict[str, int] = {w: i for i, w in enumerate(VOCAB)}
VOCAB_SIZE: int = len(VOCAB)

PAD_ID: int = WORD_TO_ID["<pad>"]
BOS_ID: int = WORD_TO_ID["<bos>"]
EOS_ID: int = WORD_TO_ID["<eos>"]
UNK_ID: int = WORD_TO_ID["<unk>"]
DIGIT_IDS: tuple[int, ...] = tuple(WORD_TO_ID[str(d)] for d in range(10))

assert PAD_ID == 0 and VOCAB_SIZE <= 1024, (PAD_ID, VOCAB_SIZE)

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
MODEL_MAX_LENGTH = 16384


def word_ids(text: str) -> list[int]:
    """Ids of the space-separated words of ``text`` (a fast, strict encoder: unknown words raise)."""
    try:
        return [WORD_TO_ID[w] for w in text.split()]
    except KeyError as err:
        raise KVLearnError(f"word {err.args[0]!r} is not in the testbed vocabulary of {VOCAB_SIZE} words") from None


def ids_to_text(ids) -> str:
    """The canonical text of ``ids`` (words joined by single spaces, specials included)."""
    try:
        return " ".join(VOCAB[int(i)] for i in ids)
    except IndexError:
        bad = next(int(i) for i in ids if not 0 <= int(i) < VOCAB_SIZE)
        raise KVLearnError(f"token id {bad} is invalid: expected an id in [0, {VOCAB_SIZE - 1}]") from None


@lru_cache(maxsize=1)
def _backend():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=dict(WORD_TO_ID), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL_TOKENS.values()))
    return tok


def build_tokenizer():
    """A ``transformers.PreTrainedTokenizerFast`` over the testbed vocabulary (bos/eos/pad/unk set).

    Encoding adds no special tokens; decoding joins tokens with single spaces.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_backend(),
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
        **SPECIAL_TOKENS,
    )


def save_tokenizer(directory: str | os.PathLike) -> str:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``directory``.

    ``transformers.AutoTokenizer.from_pretrained(directory)`` loads the result. Returns the directory.
    """
    directory = os.fspath(directory)
    check(
        not os.path.isfile(directory),
        f"directory={directory!r} is invalid: expected a directory path, found a file",
    )
    os.makedirs(directory, exist_ok=True)
    build_tokenizer().save_pretrained(directory)
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump(SPECIAL_TOKENS, f, indent=2)
    return directory
