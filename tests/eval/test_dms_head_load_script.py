"""benchmarks/dms_head_load.py: the capped set equals a query-by-query simulation of the cache's rule (ties
included); on a tiny DMS checkpoint (testbed vocabulary, GQA 2 KV heads x 2 query heads) the counts match a
recount from the hard training forward's logits, a budget that holds every eligible token never binds and keeps
what the gates keep, a tight one binds; bad input is one line."""

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvlearn.config import DMSConfig
from kvlearn.dms.apply import apply_dms, dms_gates
from kvlearn.testbed.tokenizer import VOCAB_SIZE
from benchmark_loader import load_benchmark


def load_script():
    return load_benchmark("dms_head_load")


def simulate(alpha_next, eligible_end, sinks, topk):
    """Query by query, as DMSPolicy: key k leaves the window in position order; dropped iff its logit > 0; else it
    joins the held set, and over ``topk`` the held key with the highest logit goes (the later key on ties)."""
    heads, T = alpha_next.shape
    out = torch.zeros(heads, T, dtype=torch.bool)
    for h in range(heads):
        held = []
        for k in range(sinks, eligible_end):
            a = float(alpha_next[h, k])
            if a > 0:
                continue
            held.append(k)
            if len(held) > topk:
                worst = max(held, key=lambda j: (float(alpha_next[h, j]), j))
                held.remove(worst)
        out[h, held] = True
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_capped_set_equals_the_online_rule(seed):
    script = load_script()
    g = torch.Generator().manual_seed(seed)
    heads, T, sinks = 3, 60, 4
    alpha = torch.randn(heads, T, generator=g)
    alpha[:, ::7] = -0.5  # ties between kept keys
    alpha[1] = -1.0  # a head whose gates keep everything, all tied
    for topk in (1, 5, 17, 100):
        kept, capped = script.capped_keep(alpha, 50, sinks, topk)
        assert torch.equal(capped, simulate(alpha, 50, sinks, topk))
        assert torch.equal(kept, simulate(alpha, 50, sinks, 10_000))
        assert int(capped.sum(-1).max()) <= topk


def checkpoint(path, window=16, budget=64):
    torch.manual_seed(5)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      pad_token_id=0, tie_word_embeddings=True)
    model = apply_dms(Qwen3ForCausalLM(cfg), DMSConfig(sinks=4, window=window, budget=budget))
    for gate in dms_gates(model):  # random gates: some heads keep most tokens, some few
        torch.nn.init.normal_(gate.proj.weight, std=0.02)
    model.save_pretrained(path)
    return str(path)


def test_counts_match_a_recount_and_a_loose_budget_never_binds(tmp_path):
    script = load_script()
    ck = checkpoint(tmp_path / "ck")
    out = tmp_path / "r.json"
    png = tmp_path / "h.png"
    assert script.main(["--model", ck, "--budget", "64,400", "--families", "niah,vt", "--n", "2", "--length", "256",
                        "--out", str(out), "--heatmap", str(png)]) == 0
    data = json.loads(out.read_text())
    rows = {(r["budget"], r["family"]): r for r in data["rows"]}
    assert png.stat().st_size > 1000
    loose, tight = rows[(400, "all")], rows[(64, "all")]
    assert loose["binds_share"] == 0.0 and loose["needles_capped_mean"] == loose["needles_gates_mean"]
    assert tight["topk"] == 64 - 4 - 16 and tight["binds_share"] > 0
    assert tight["needles_capped_mean"] <= tight["needles_gates_mean"]

    # recount from the hard forward's logits, independently of the script's helpers
    import kvlearn
    from kvlearn.dms.attention import DMSTrainForward, use_train_attention
    from kvlearn.testbed import tasks

    model = kvlearn.load(ck, dtype=torch.float32, device="cpu")
    use_train_attention(model)
    binds, kept_all, needles, by_head = [], [], [], {}
    for family in ("niah", "vt"):
        for i in range(2):
            ex = tasks.generate(family, tasks.example_seed(family, "eval", i), 256)
            state = DMSTrainForward(DMSConfig(sinks=4, window=16, budget=64), hard=True, noise=False)
            with torch.no_grad():
                model(input_ids=torch.tensor([ex.prompt_ids]), dms_train=state, use_cache=False)
            q = len(ex.prompt_ids) - 1
            need = [t for t in tasks.needed_positions(ex) if 4 <= t <= q - 16]
            shares = []
            for layer in sorted(state.records):
                a = state.records[layer].alpha[0]
                for h in range(a.shape[0]):
                    n = sum(1 for k in range(4, q - 16 + 1) if float(a[h, k + 1]) <= 0)  # key k <- token k + 1
                    kept_all.append(n)
                    binds.append(n > 44)
                    if need:
                        shares.append(sum(float(a[h, t + 1]) <= 0 for t in need) / len(need))
                        by_head.setdefault((layer, h), []).append(shares[-1])
            if shares:
                needles.append(sum(shares) / len(shares))
    assert tight["binds_share"] == pytest.approx(sum(binds) / len(binds), abs=1e-4)
    assert needles and tight["needles_gates_mean"] == pytest.approx(sum(needles) / len(needles), abs=1e-4)
    grid = tight["needles_gates_by_layer_head"]
    for (layer, h), v in by_head.items():
        assert grid[layer][h] == pytest.approx(sum(v) / len(v), abs=1e-3)
    assert loose["needles_capped_by_layer_head"] == loose["needles_gates_by_layer_head"]
    assert all(c <= g for rc, rg in zip(tight["needles_capped_by_layer_head"], grid) for c, g in zip(rc, rg))
    per_example = [e for e in data["examples"]]
    assert max(e["kept_max"] for e in per_example) == max(kept_all)
    assert min(e["kept_min"] for e in per_example) == min(kept_all)
    # 0 < some heads' eviction ratio < 1: the random gates drop some and keep some
    ratios = [x for row in tight["eviction_ratio_median_by_layer_head"] for x in row]
    assert all(0.0 <= x <= 1.0 for x in ratios) and 0 < sum(ratios) < len(ratios)


def test_bad_input_is_one_line(tmp_path, capsys):
    script = load_script()
    ck = checkpoint(tmp_path / "ck")
    assert script.main(["--model", ck, "--budget", "10"]) == 2
    assert "--budget 10 is invalid: expected > sinks + window = 20" in capsys.readouterr().err
    assert script.main(["--model", ck, "--budget", "x"]) == 2
    assert "expected one or more integers" in capsys.readouterr().err
    assert script.main(["--model", ck, "--families", "nope"]) == 2
    assert "expected one or more of" in capsys.readouterr().err
    teacher = tmp_path / "plain"
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    Qwen3ForCausalLM(cfg).save_pretrained(teacher)
    assert script.main(["--model", str(teacher)]) == 2
    assert "holds no DMS gates" in capsys.readouterr().err
