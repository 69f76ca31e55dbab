"""The registry's one-line errors, the protocols' question boundary and batch layout, split and time guard."""

import time

import pytest
import torch

from kvlearn.errors import KVLearnError
from kvlearn.eval.accuracy import EvalConfig, eval_splits, evaluate, tasks_not_started
from kvlearn.eval.protocols import layout, question_start
from kvlearn.methods import DenseConfig, Method, get_method, make_config
from kvlearn.testbed import tasks
from kvlearn.testbed.tokenizer import WORD_TO_ID


def one_line(err) -> str:
    text = str(err.value)
    assert len(text.splitlines()) == 1
    return text


def test_registry_errors_are_one_line():
    with pytest.raises(KVLearnError) as e:
        get_method("bogus")
    assert "expected one of dense, streaming, tova, h2o, snapkv, pyramidkv, knorm, random" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        make_config("streaming", budget=None)
    assert "needs a budget" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        make_config("streaming", budget=64, kernel=3)
    assert "has no option(s) kernel" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        make_config("streaming", budget=64, window=3)
    assert "window=3 is invalid: StreamingConfig's window is budget - sinks = 60" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        make_config("streaming", budget=64, context=64)
    assert "budget=64 is invalid" in one_line(e)
    assert make_config("dense") == DenseConfig()
    assert make_config("streaming", budget=64, sinks=2, context=256).budget == 64


def test_a_protocol_the_method_does_not_define_is_a_one_line_error():
    only_context = Method("snapkv-like", "keeps what the question attends to", DenseConfig, lambda c, m: None,
                          protocols=("context",))
    only_context.check_protocol("context")
    with pytest.raises(KVLearnError) as e:
        only_context.check_protocol("bounded")
    assert one_line(e) == "method 'snapkv-like' does not define protocol 'bounded': expected one of context"
    with pytest.raises(KVLearnError) as e:
        EvalConfig(method="dense", protocol="sideways")
    assert "protocol='sideways' is unknown: expected one of bounded, context" in one_line(e)


@pytest.mark.parametrize("family", tasks.FAMILIES)
def test_question_starts_at_the_last_question_or_program_token(family):
    word = "program" if family == "trace" else "question"
    for i in range(4):
        ex = tasks.generate(family, tasks.example_seed(family, "eval", i), 512)
        start = question_start(ex)
        ids = ex.prompt_ids
        assert ids[start] == WORD_TO_ID[word]
        assert WORD_TO_ID[word] not in ids[start + 1:]  # the last one
        if family != "trace":
            assert WORD_TO_ID["program"] not in ids


def test_context_layout_pads_context_and_question_separately():
    exs = [tasks.generate(f, tasks.example_seed(f, "eval", 0), 256) for f in ("niah", "trace", "recall")]
    b = layout(exs, "context", pad_id=0)
    for i, ex in enumerate(exs):
        c = question_start(ex)
        ctx, q = b.ids[i, : b.split], b.ids[i, b.split :]
        assert ctx[b.mask[i, : b.split].bool()].tolist() == ex.prompt_ids[:c]
        assert q[b.mask[i, b.split :].bool()].tolist() == ex.prompt_ids[c:]
        assert b.mask[i, -1] == 1 and b.mask[i, b.split - 1] == 1  # each segment is left-padded
    bounded = layout(exs, "bounded", pad_id=0, chunk_size=64)
    assert bounded.split is None and bounded.ids.shape[1] == 4 * 64 + 1  # 255 tokens before the last: 4 chunks
    for i, ex in enumerate(exs):
        real = bounded.mask[i].bool()
        assert bounded.ids[i, real].tolist() == ex.prompt_ids and bounded.mask[i, -1] == 1
        # each 64-column prefill forward holds the row's own k-th chunk of 64 real tokens (the last one partial)
        per_chunk = [int(bounded.mask[i, k * 64:(k + 1) * 64].sum()) for k in range(4)]
        body = len(ex.prompt_ids) - 1
        own = [64] * (body // 64) + ([body % 64] if body % 64 else [])
        assert per_chunk == [0] * (4 - len(own)) + own


def test_split_is_validated_and_recorded():
    assert "train" not in eval_splits() and "eval" in eval_splits()
    with pytest.raises(KVLearnError) as e:
        EvalConfig(split="train")
    assert f"split='train' is invalid: expected one of {', '.join(eval_splits())}" == one_line(e)


def test_heldout_split_draws_other_examples():
    a = EvalConfig(split="eval", tasks=("vt",), n_per_task=1, context=256)
    b = EvalConfig(split="heldout", tasks=("vt",), n_per_task=1, context=256)
    from kvlearn.eval.accuracy import examples_for

    assert examples_for(a, "vt")[0].prompt_ids != examples_for(b, "vt")[0].prompt_ids


def test_deadline_stops_cleanly_and_marks_incomplete_rows():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvlearn.testbed.tokenizer import VOCAB_SIZE

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, max_position_embeddings=512, pad_token_id=0)).eval()
    config = EvalConfig(method="streaming", budget=32, tasks=("vt", "recall"), n_per_task=2, context=256,
                        batch_size=1, protocol="context")
    assert evaluate(model, config, progress=False, deadline=time.monotonic() - 1) == []
    ticks = iter([0.0, 0.0, 1e6, 1e6, 1e6, 1e6])  # the deadline passes after the first batch
    rows = evaluate(model, config, progress=False, deadline=10.0, clock=lambda: next(ticks))
    assert len(rows) == 1 and rows[0]["n"] == 1 and rows[0]["incomplete"] is True
    assert tasks_not_started(config, rows) == ["recall"] and tasks_not_started(config, []) == ["vt", "recall"]
    assert rows[0]["protocol"] == "context" and rows[0]["split"] == "eval"


def test_peak_bytes_are_read_when_the_cache_reports_them():
    from types import SimpleNamespace

    from kvlearn.eval.accuracy import peak_cache_bytes

    assert peak_cache_bytes(SimpleNamespace(), 16) is None
    assert peak_cache_bytes(SimpleNamespace(peak_bytes=lambda chunk: 100 + chunk), 16) == 116


def test_context_protocol_compresses_a_full_attention_prefill_once():
    """Under `context`, the cache holds after the context exactly the streaming survivors of the context, with the
    keys a full-attention forward computes (layer 2's keys depend on layer 1's attention, so a bounded prefill
    would give different ones); the question is not in the cache yet."""
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    from kvlearn.eval.protocols import prefill_columns
    from kvlearn.hf import attach
    from kvlearn.testbed.tokenizer import VOCAB_SIZE

    torch.manual_seed(0)
    model = attach(Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=8, max_position_embeddings=512)).eval())
    ex = tasks.generate("niah", tasks.example_seed("niah", "eval", 0), 256)
    b = layout([ex], "context", pad_id=0)
    cfg = make_config("streaming", budget=24, sinks=4)
    cache = get_method("streaming").make_cache(cfg, model.config)
    with torch.no_grad():
        prefill_columns(model, cache, b, 0, b.split, chunk_size=16, dense=True)
        dense = DynamicCache(config=model.config)
        model(input_ids=b.ids[:, : b.split], past_key_values=dense, use_cache=True)
    n = b.split
    assert cache.get_seq_length() == n
    keep = list(range(4)) + list(range(n - 20, n))
    layer = cache.layers[1]
    held = layer.slot_positions[0, 0].tolist()
    assert sorted(held) == keep
    order = torch.tensor(held)
    torch.testing.assert_close(layer.keys[0, :, :], dense.layers[1].keys[0, :, order], atol=1e-5, rtol=1e-4)
