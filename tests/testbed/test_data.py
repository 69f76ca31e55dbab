"""Training batches, labels, packing invariants and the worker-safe stream."""

import pytest
import torch
from torch.utils.data import DataLoader

from kvlearn.errors import KVLearnError
from kvlearn.testbed.data import (
    IGNORE_INDEX,
    TestbedStream,
    batch_examples,
    example_labels,
    measure_throughput,
    pack_examples,
    pack_rows,
    training_batch,
)
from kvlearn.testbed.tasks import FAMILIES, generate, seed_split
from kvlearn.testbed.tokenizer import BOS_ID, PAD_ID


def test_training_batch_rows_and_labels():
    ids, labels = training_batch(8, 512, seed=3)
    assert ids.shape == labels.shape == (8, 512) and ids.dtype == labels.dtype == torch.long
    examples = batch_examples(8, 512, seed=3)
    for row, e in enumerate(examples):
        assert ids[row].tolist() == e.input_ids
        assert seed_split(e.seed) == "train" and e.dense
        p = len(e.prompt_ids)
        # reference labels built position by position
        want = [e.prompt_ids[i] if e.loss_mask_prompt[i] else IGNORE_INDEX for i in range(p)] + e.answer_ids
        assert labels[row].tolist() == want == example_labels(e)
        assert (labels[row, p:] == ids[row, p:]).all()  # the whole answer is supervised
        sup = labels[row] != IGNORE_INDEX
        assert (labels[row][sup] == ids[row][sup]).all()
        assert labels[row, 0] == IGNORE_INDEX  # <bos> never supervised
        assert sup[:p].sum() > 0  # dense in-context answers


def test_dense_share_mixes_training_and_evaluation_format_rows():
    mixed = batch_examples(400, 256, seed=5, dense=0.75)
    share = sum(e.dense for e in mixed) / len(mixed)
    assert 0.68 < share < 0.82
    # the same batch seed draws the same families and example seeds whatever the share: only the format differs
    for a, b in zip(mixed, batch_examples(400, 256, seed=5, dense=True)):
        assert (a.family, a.seed) == (b.family, b.seed)
        assert a.input_ids == (b.input_ids if a.dense else generate(a.family, a.seed, 256, dense=False).input_ids)
    ids, labels = training_batch(16, 256, seed=5, dense=0.0)
    for row, e in enumerate(batch_examples(16, 256, seed=5, dense=False)):
        assert not e.dense and ids[row].tolist() == e.input_ids
        assert (labels[row, : len(e.prompt_ids)] == IGNORE_INDEX).all()  # only the final answer is supervised
    for bad in (1.5, -0.1, "half"):
        with pytest.raises(KVLearnError, match=f"dense={bad!r} is invalid"):
            training_batch(2, 256, 0, dense=bad)
        with pytest.raises(KVLearnError, match="dense="):
            TestbedStream(256, 2, dense=bad)


def test_training_batch_determinism_and_disjoint_seeds():
    a = training_batch(4, 256, seed=11)
    b = training_batch(4, 256, seed=11)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    seeds = [e.seed for s in range(20) for e in batch_examples(6, 256, seed=s)]
    assert len(set(seeds)) == len(seeds)


def test_family_mixture():
    fams = [e.family for e in batch_examples(400, 256, seed=0, families=("niah", "vt"), weights=[3, 1])]
    assert set(fams) == {"niah", "vt"}
    assert 0.65 < fams.count("niah") / 400 < 0.85
    assert {e.family for e in batch_examples(20, 256, seed=1, families="recall")} == {"recall"}
    all_fams = {e.family for e in batch_examples(100, 256, seed=2)}
    assert all_fams == set(FAMILIES)


def test_training_batch_bad_input():
    with pytest.raises(KVLearnError, match="families"):
        training_batch(2, 256, 0, families=("niah", "bogus"))
    with pytest.raises(KVLearnError, match="weights"):
        training_batch(2, 256, 0, families=("niah", "vt"), weights=[1.0])
    with pytest.raises(KVLearnError, match="batch_size"):
        training_batch(0, 256, 0)
    with pytest.raises(KVLearnError, match="length"):
        training_batch(2, 32, 0)


def _examples(lengths, seed=0):
    fams = list(FAMILIES)
    return [generate(fams[i % 4], seed + i, n, dense=True) for i, n in enumerate(lengths)]


def _check_row(row, examples, seq_len):
    ids, labels, pos, doc = row["input_ids"], row["labels"], row["position_ids"], row["document_ids"]
    assert ids.shape == labels.shape == pos.shape == doc.shape == (seq_len,)
    offset = 0
    for d, k in enumerate(row["example_indices"].tolist()):
        e = examples[k]
        span = slice(offset, offset + e.length)
        assert ids[span].tolist() == e.input_ids
        assert labels[span].tolist() == example_labels(e)
        assert pos[span].tolist() == list(range(e.length))
        assert (doc[span] == d).all()
        assert ids[offset] == BOS_ID and labels[offset] == IGNORE_INDEX
        offset += e.length
    assert (ids[offset:] == PAD_ID).all() and (labels[offset:] == IGNORE_INDEX).all()
    assert (doc[offset:] == -1).all()
    assert pos[offset:].tolist() == list(range(seq_len - offset))
    # a new document starts exactly where position_ids reset to 0 (padding is one pseudo-document)
    starts = (pos == 0).nonzero().flatten().tolist()
    changes = [0] + [i for i in range(1, seq_len) if doc[i] != doc[i - 1]]
    assert starts == changes
    return offset


def test_pack_examples_greedy_in_order():
    examples = _examples([300, 200, 400, 150, 128, 600])
    row = pack_examples(examples, 1024)
    # 300 + 200 fit (500), 400 fits (900), 150 does not, 128 does not, 600 does not
    assert row["example_indices"].tolist() == [0, 1, 2]
    used = _check_row(row, examples, 1024)
    assert used == 900
    row = pack_examples(examples[3:5], 300)  # 150 + 128 = 278 fit
    assert row["example_indices"].tolist() == [0, 1]
    assert _check_row(row, examples[3:5], 300) == 278
    with pytest.raises(KVLearnError, match="seq_len=300"):
        pack_examples(examples, 300)


def test_pack_rows_first_fit():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(128, 700) for _ in range(25)]
    examples = _examples(lengths, seed=5)
    seq_len = 1024
    rows = pack_rows(examples, seq_len)
    placed = sorted(i for r in rows for i in r["example_indices"].tolist())
    assert placed == list(range(len(examples)))  # every example exactly once
    fills = [_check_row(r, examples, seq_len) for r in rows]
    assert all(f <= seq_len for f in fills)
    # first fit: when example i was placed in row r, it did not fit in any earlier row at that time
    row_of = {i: r for r, row in enumerate(rows) for i in row["example_indices"].tolist()}
    fill = [0] * len(rows)
    for i, e in enumerate(examples):
        r = row_of[i]
        assert all(fill[q] + e.length > seq_len for q in range(r))
        fill[r] += e.length
        assert fill[r] <= seq_len
    assert sum(lengths) <= len(rows) * seq_len


def test_stream_matches_training_batch_and_splits_workers():
    stream = TestbedStream(length=256, batch_size=2, seed=7, families=("niah", "recall"))
    loader = DataLoader(stream, batch_size=None, num_workers=2)
    got = []
    for k, (ids, labels) in enumerate(loader):
        got.append((ids, labels))
        if k == 5:
            break
    for b, (ids, labels) in enumerate(got):  # in-order delivery: batch numbers 0, 1, 2, ...
        want_ids, want_labels = training_batch(2, 256, (7 << 40) | b, ("niah", "recall"))
        assert torch.equal(ids, want_ids) and torch.equal(labels, want_labels)


def test_stream_ranks_and_workers_draw_disjoint_batches():
    numbers = []
    for rank in range(3):
        s = TestbedStream(256, 2, seed=1, rank=rank, world_size=3, start_batch=10)
        for w in range(4):
            it = s.batch_numbers(w, 4)
            numbers.append([next(it) for _ in range(50)])
    flat = [b for ns in numbers for b in ns]
    assert len(set(flat)) == len(flat)
    assert set(flat) == set(range(10, 10 + 12 * 50))  # together they cover every batch number, no gaps
    with pytest.raises(KVLearnError, match="rank=3"):
        TestbedStream(256, 2, rank=3, world_size=3)
    with pytest.raises(KVLearnError, match="length"):
        TestbedStream(16, 2)


def test_measure_throughput():
    r = measure_throughput(length=1024, batch_size=4, n_batches=2)
    assert r["tokens"] == 4 * 2 * 1024 and r["tokens_per_s"] > 0


def test_training_stream_never_emits_a_heldout_style_or_regime():
    """What training sees is drawn from train seeds only, and a train seed never takes a held-out style or depth
    regime: the ``heldout`` evaluation split is truly unseen."""
    from kvlearn.testbed.data import batch_examples
    from kvlearn.testbed.filler import HELDOUT_STYLES, TRAIN_STYLES
    from kvlearn.testbed.tasks import HELDOUT_REGIMES, TRAIN_REGIMES, seed_split

    styles, regimes = set(), set()
    for b in range(6):
        for dense in (True, False, 0.75):
            for e in batch_examples(64, 256, seed=(7 << 40) | b, dense=dense):
                assert seed_split(e.seed) == "train"
                styles.add(e.style)
                regimes.add(e.regime)
    assert not styles & set(HELDOUT_STYLES) and not regimes & set(HELDOUT_REGIMES)
    assert styles == set(TRAIN_STYLES) and regimes == set(TRAIN_REGIMES)  # and it does vary the haystack


# SHA-256 (first 16 hex digits) of json.dumps([input_ids.tolist(), labels.tolist()]) of training_batch(16, 1024, 3,
# dense=0.75), made by the code of commit 1880c5c (the shipped teacher's training data, before e1df32b)
BATCH_1880C5C = "0880c4fab6d12559"


def _batch_digest(ids, labels) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps([ids.tolist(), labels.tolist()]).encode()).hexdigest()[:16]


def test_multivalue_share_is_threaded_through_batches_and_the_stream():
    """``multivalue_share`` reaches every row: share 0 gives the batch of 1880c5c (produced once with that commit's
    code: ``git worktree add /tmp/wt1880 1880c5c``, ``PYTHONPATH=/tmp/wt1880/src``, ``training_batch(16, 1024, 3,
    dense=0.75)`` hashed as :func:`_batch_digest`; the worktree removed after), the default share (0.25, what
    retrofit / Kaizen training use) does not; the stream stores the share and passes it on; bad values are one line."""
    from kvlearn.testbed.tasks import MULTIVALUE_PROBE_SHARE

    assert _batch_digest(*training_batch(16, 1024, 3, dense=0.75, multivalue_share=0.0)) == BATCH_1880C5C
    assert _batch_digest(*training_batch(16, 1024, 3, dense=0.75)) != BATCH_1880C5C
    rows = batch_examples(16, 1024, 3, dense=0.75, multivalue_share=0.0)
    assert [e.input_ids for e in rows] == training_batch(16, 1024, 3, dense=0.75, multivalue_share=0.0)[0].tolist()
    assert TestbedStream(1024, 2).multivalue_share == MULTIVALUE_PROBE_SHARE
    for share in (0.0, MULTIVALUE_PROBE_SHARE, 1.0):
        stream = TestbedStream(1024, 4, seed=2, families=("niah",), multivalue_share=share)
        assert stream.multivalue_share == share
        for b, (ids, labels) in zip(range(2), stream):
            want_ids, want_labels = training_batch(4, 1024, (2 << 40) | b, ("niah",), multivalue_share=share)
            assert torch.equal(ids, want_ids) and torch.equal(labels, want_labels)
    first = [next(iter(TestbedStream(1024, 4, seed=2, families=("niah",), multivalue_share=s)))[0] for s in (0.0, 1.0)]
    assert not torch.equal(*first)
    for bad in (1.5, -0.1, "half", True):
        with pytest.raises(KVLearnError, match=rf"multivalue_share={bad!r} is invalid: expected a number in \[0, 1\]"):
            training_batch(2, 256, 0, multivalue_share=bad)
        with pytest.raises(KVLearnError, match="multivalue_share="):
            TestbedStream(256, 2, multivalue_share=bad)
