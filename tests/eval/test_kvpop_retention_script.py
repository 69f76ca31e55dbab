"""benchmarks/kvpop_retention.py on a tiny KVpop checkpoint (testbed vocabulary, GQA 2 KV heads x 2 query heads):
with a budget that keeps every token every share is 1; with a tight one the shares are fractions that match a
brute-force recount from the dense retention mask; the heatmap is written; a non-KVpop folder is one line."""

import json

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvlearn import KVpopConfig
from kvlearn.kvpop.apply import apply_kvpop
from kvlearn.testbed.tokenizer import VOCAB_SIZE
from benchmark_loader import load_benchmark



def load_script():
    return load_benchmark("kvpop_retention")


def checkpoint(path, window, topk, **kvpop):
    torch.manual_seed(3)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      pad_token_id=0, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    apply_kvpop(model, KVpopConfig(sinks=4, window=window, topk=topk, **{"scorer": "mlp", **kvpop}))
    for p in model.parameters():  # random scorers, so the learned ranking is neither recency nor the target's
        if p.dim() == 1 and p.numel() < 16:
            torch.nn.init.normal_(p, std=1.0)
    model.save_pretrained(path)
    return str(path)


def test_everything_kept_gives_ones_and_a_tight_budget_fractions(tmp_path, capsys):
    script = load_script()
    out = tmp_path / "r.json"
    full = checkpoint(tmp_path / "full", window=16, topk=300)
    assert script.main(["--model", full, "--length", "256", "--n", "1", "--queries", "8", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["recall_mean"] == row["needles_mean"] == row["needles_teacher_mean"] == 1.0

    tight = checkpoint(tmp_path / "tight", window=16, topk=24)
    png = tmp_path / "h.png"
    assert script.main(["--model", tight, "--family", "niah", "--length", "256", "--n", "1", "--queries", "8",
                        "--out", str(out), "--heatmap", str(png)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert 0.0 <= row["recall_mean"] <= 1.0 and png.stat().st_size > 1000
    assert (row["window"], row["topk"]) == (16, 24)
    # brute force: the learned share of needed tokens kept at the answer query, from the full dense mask
    import kvlearn
    from kvlearn.kvpop.train_attention import TrainForward, use_train_attention
    from kvlearn.ops.masks import retention_mask_dense
    from kvlearn.testbed import tasks

    model = kvlearn.load(tight, dtype=torch.float32, device="cpu")
    use_train_attention(model)
    ex = tasks.generate("niah", tasks.example_seed("niah", "eval", 0), 256)
    P = len(ex.prompt_ids)
    need = [t for t in tasks.needed_positions(ex) if t < P - 16]
    state = TrainForward(model.config.kvpop if isinstance(model.config.kvpop, KVpopConfig)
                         else KVpopConfig(**model.config.kvpop))
    with torch.no_grad():
        model(input_ids=torch.tensor([ex.prompt_ids + ex.answer_ids]), kvpop_train=state, use_cache=False)
    shares = []
    for layer in sorted(state.records):
        r = state.records[layer]
        mask = retention_mask_dense(r.ranks, r.cutoffs, 4, 16)[0, :, P - 1]
        shares += [sum(bool(mask[h, t]) for t in need) / len(need) for h in range(mask.shape[0])]
    assert abs(row["needles_mean"] - sum(shares) / len(shares)) < 1e-3

    plain = tmp_path / "plain"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)).save_pretrained(plain)
    capsys.readouterr()
    assert script.main(["--model", str(plain), "--length", "256", "--n", "1"]) == 2
    assert "holds no KVpop modules" in capsys.readouterr().err


def test_the_script_leaves_autograd_on(tmp_path):
    """Run in-process (as the tests do), the script must not switch gradients off for the rest of the process."""
    script = load_script()
    full = checkpoint(tmp_path / "m", window=16, topk=300)
    assert script.main(["--model", full, "--length", "256", "--n", "1", "--queries", "4"]) == 0
    assert torch.is_grad_enabled()


def test_decay_override_sets_every_head_and_a_slower_decay_keeps_older_tokens(tmp_path, capsys):
    """``--decay G`` records G for every layer and head; with the teacher policy, a decay near 1 (almost no recency
    prior) keeps more far needed tokens than a fast one (the same targets, only the age term changes;
    measured 0.129 vs 0.116); a G outside the checkpoint's range is a one-line error."""
    script = load_script()
    out = tmp_path / "d.json"
    tight = checkpoint(tmp_path / "tight", window=16, topk=24)
    shares = {}
    for g in (0.9991, 0.99999):
        assert script.main(["--model", tight, "--family", "niah", "--length", "256", "--n", "2", "--queries", "8",
                            "--decay", str(g), "--out", str(out)]) == 0
        row = json.loads(out.read_text())["rows"][0]
        assert row["decay_override"] == g
        assert all(abs(x - g) < 2e-6 for layer in row["decay_by_layer_head"] for x in layer)
        shares[g] = row["needles_teacher_mean"]
    assert shares[0.99999] > shares[0.9991]  # 0.129 vs 0.116 here
    capsys.readouterr()
    assert script.main(["--model", tight, "--length", "256", "--n", "1", "--decay", "0.5"]) == 2
    assert "--decay=0.5 is invalid: expected a decay strictly between 0.999 and 0.999999" in capsys.readouterr().err


def test_target_options_change_the_teacher_policy_only(tmp_path):
    """``--target-aggregation`` / ``--count-normalize`` are recorded and change what the teacher policy keeps, not
    the learned ranking (the learned needles share is the same)."""
    script = load_script()
    out = tmp_path / "t.json"
    tight = checkpoint(tmp_path / "tight", window=16, topk=24)
    rows = []
    for extra in ([], ["--target-aggregation", "mean", "--count-normalize", "0"]):
        assert script.main(["--model", tight, "--family", "niah", "--length", "256", "--n", "2", "--queries", "8",
                            "--out", str(out), *extra]) == 0
        rows.append(json.loads(out.read_text())["rows"][0])
    assert (rows[0]["target_aggregation"], rows[0]["target_count_normalize"]) == ("max", True)
    assert (rows[1]["target_aggregation"], rows[1]["target_count_normalize"]) == ("mean", False)
    assert rows[0]["needles_by_layer_head"] == rows[1]["needles_by_layer_head"]
    assert rows[0]["needles_teacher_by_layer_head"] != rows[1]["needles_teacher_by_layer_head"]


def test_split_heldout_measures_the_held_out_haystacks(tmp_path):
    """``--split heldout`` draws its prompts from the held-out haystack styles and depth regimes (the examples the
    row reports are those of ``tasks.example_seed(family, "heldout", i)``), recorded as ``split``; the default is
    the eval split."""
    from kvlearn.testbed import tasks

    script = load_script()
    out = tmp_path / "s.json"
    tight = checkpoint(tmp_path / "tight", window=16, topk=24)
    styles = {}
    for split in ("eval", "heldout"):
        assert script.main(["--model", tight, "--family", "recall", "--length", "256", "--n", "2", "--queries", "4",
                            "--split", split, "--out", str(out)]) == 0
        row = json.loads(out.read_text())["rows"][0]
        assert row["split"] == split
        expected = [tasks.generate("recall", tasks.example_seed("recall", split, i), 256) for i in range(2)]
        assert [(e["style"], e["regime"]) for e in row["examples"]] == [(x.style, x.regime) for x in expected]
        styles[split] = {e["style"] for e in row["examples"]}
    assert not styles["eval"] & styles["heldout"]  # training's styles never appear in the held-out split


def test_an_mlstm_student_with_its_state_in_the_budget_is_measured_with_its_own_top_k(tmp_path):
    """The retrofit trains a ``state_in_budget`` mLSTM student with fewer top-k slots (its state's bytes take some):
    the script measures that pattern, not the recorded top-k. By hand, head_dim 16: the state is float32
    ``C [16, 8]`` + ``n [16]`` + ``m``, 4 * (128 + 16 + 1) = 580 bytes per KV head; one bf16 token's key and value
    2 * 16 * 2 = 64 bytes; ceil(580 / 64) = 10 slots, so top-k 24 becomes 14. Without the flag it stays 24."""
    script = load_script()
    out = tmp_path / "m.json"
    for flag, topk in ((True, 14), (False, 24)):
        path = checkpoint(tmp_path / f"mlstm{flag}", window=16, topk=24, scorer="mlstm", state_in_budget=flag)
        assert script.main(["--model", path, "--family", "niah", "--length", "256", "--n", "1", "--queries", "4",
                            "--out", str(out)]) == 0
        row = json.loads(out.read_text())["rows"][0]
        assert (row["window"], row["topk"], row["state_in_budget"]) == (16, topk, flag)
