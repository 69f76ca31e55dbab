"""The synthetic long-context testbed: tokenizer, task generators with independent checkers, training data.

See ``docs/TESTBED.md`` for the formats and the design rationale.
"""

from .checkers import solve, trace_steps
from .data import (
    IGNORE_INDEX,
    TestbedStream,
    batch_examples,
    example_labels,
    measure_throughput,
    pack_examples,
    pack_rows,
    training_batch,
)
from .tasks import (
    FAMILIES,
    MAX_LENGTH,
    MIN_LENGTH,
    SPLITS,
    VARIANTS,
    Example,
    example_seed,
    generate,
    informative_positions,
    needed_positions,
    score,
    seed_split,
)
from .tokenizer import (
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

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "FAMILIES",
    "IGNORE_INDEX",
    "MAX_LENGTH",
    "MIN_LENGTH",
    "PAD_ID",
    "SPLITS",
    "UNK_ID",
    "VARIANTS",
    "VOCAB",
    "VOCAB_SIZE",
    "WORD_TO_ID",
    "Example",
    "TestbedStream",
    "batch_examples",
    "build_tokenizer",
    "example_labels",
    "example_seed",
    "generate",
    "ids_to_text",
    "informative_positions",
    "measure_throughput",
    "needed_positions",
    "pack_examples",
    "pack_rows",
    "save_tokenizer",
    "score",
    "seed_split",
    "solve",
    "trace_steps",
    "training_batch",
    "word_ids",
]
