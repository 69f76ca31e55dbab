"""The comparison table's ``untrained_backbone`` row and the ``kivi`` method, on tiny random GQA Qwen3 models
(float32, 3 layers, 2 KV heads, 2 query heads per KV head, testbed vocabulary):

- :func:`load_selector_onto` puts a trained folder's selector on another backbone: the selector's weights and
  choices are the trained folder's, every backbone weight the other model's (logits under one configuration equal
  the teacher's and differ from the jointly trained backbone's); backbones of other shapes are a one-line error;
- ``kivi`` rows report the realised factor (dense bytes over the KIVI stores' bytes, metadata and window counted)
  and the nominal target; a target other than 2, 4, 8 is a one-line error.
"""

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import kvlearn
from kvlearn.errors import KVLearnError
from kvlearn.eval.accuracy import EvalConfig, evaluate
from kvlearn.kaizen.actions import Backbone, KaizenConfig
from kvlearn.kaizen.apply import KaizenMethodConfig, apply_kaizen, load_selector_onto, select, selector_of
from kvlearn.testbed.tokenizer import VOCAB_SIZE


def tiny(layers=3):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      pad_token_id=0, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ub")
    teacher = tiny()
    teacher.save_pretrained(root / "teacher")
    student = copy.deepcopy(teacher)  # a "jointly trained" backbone: every weight moved, and a non-trivial selector
    apply_kaizen(student, KaizenMethodConfig(train_targets=(4.0,)))
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    student.save_pretrained(root / "student")
    return root


def logits_under(model, config, ids):
    with torch.no_grad():
        return model(input_ids=ids, kaizen_config=config, use_cache=False).logits


def test_selector_on_the_teacher_uses_the_teachers_weights(folders):
    student = kvlearn.load(folders / "student")
    mixed = load_selector_onto(kvlearn.load(folders / "teacher"), folders / "student")
    teacher = apply_kaizen(kvlearn.load(folders / "teacher"), KaizenMethodConfig())  # attached, untrained selector
    ids = torch.randint(3, VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(1))
    # the selector is the student's: same weights, same choices
    for (k, a), b in zip(selector_of(mixed).state_dict().items(), selector_of(student).state_dict().values()):
        assert torch.equal(a, b), k
    assert select(mixed, ids, target=4.0)[0] == select(student, ids, target=4.0)[0]
    # the backbone is the teacher's: under one configuration its logits are the teacher's, not the student's
    config = KaizenConfig.random(Backbone.from_config(mixed.config), 4.0, seed=3)
    ref = logits_under(teacher, config, ids)
    torch.testing.assert_close(logits_under(mixed, config, ids), ref, atol=0, rtol=0)
    assert (logits_under(student, config, ids) - ref).abs().max() > 1e-2


def test_other_backbone_shapes_are_one_line_errors(folders, tmp_path):
    tiny(layers=2).save_pretrained(tmp_path / "two")
    with pytest.raises(KVLearnError, match="expected the same shapes") as err:
        load_selector_onto(kvlearn.load(tmp_path / "two"), folders / "student")
    assert len(str(err.value).splitlines()) == 1


def test_kivi_rows_report_the_realised_factor(folders):
    model = kvlearn.load(folders / "teacher")
    rows = {}
    for target in (2.0, 8.0):
        config = EvalConfig(method="kivi", target=target, tasks=("vt",), n_per_task=2, batch_size=2, context=256,
                            chunk_size=64, options={"group_size": 32, "residual": 32})
        (rows[target],) = evaluate(model, config, progress=False)
    dense = EvalConfig(method="dense", tasks=("vt",), n_per_task=2, batch_size=2, context=256, chunk_size=64)
    (ref,) = evaluate(kvlearn.load(folders / "teacher"), dense, progress=False)
    for target, row in rows.items():
        assert row["target"] == target and row["method"] == "kivi" and row["distinct_configurations"] == 1
        # float32 dense vs codes + float32 scale/min per group + a float32 window of 32 tokens
        assert 1 < row["factor"] < 2 * target
        assert row["store_bytes"] == pytest.approx(ref["store_bytes"] / row["factor"], rel=0.03)
    assert rows[8.0]["factor"] > rows[2.0]["factor"]
    for bad in (3.0, 16.0):
        with pytest.raises(KVLearnError, match="invalid for kivi") as err:
            EvalConfig(method="kivi", target=bad)
        assert len(str(err.value).splitlines()) == 1
