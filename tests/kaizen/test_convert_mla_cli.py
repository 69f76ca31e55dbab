"""``kvlearn convert-mla``: a saved GQA model converted at full rank (RoPE key n_kv x head_dim, latent 2 n_kv head_dim)
loads back as MLA with the GQA model's logits (the conversion's exactness, through the command and a save/load);
bad arguments give one-line errors before any work."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import kvlearn
from kvlearn.cli import main
from kvlearn.kaizen.mla import is_mla
from kvlearn.kaizen.sharing import attach
from kvlearn.testbed.tokenizer import VOCAB_SIZE, save_tokenizer


@pytest.fixture(scope="module")
def gqa_path(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      pad_token_id=0, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("gqa") / "qwen3"
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    save_tokenizer(path)
    return path


def test_full_rank_conversion_through_the_command_keeps_the_logits(gqa_path, tmp_path, capsys):
    out = tmp_path / "mla"
    assert main(["convert-mla", "--model", str(gqa_path), "--out", str(out), "--rope-dim", "32", "--rank", "64",
                 "--calibration-examples", "2", "--calibration-length", "128", "--device", "cpu"]) == 0
    assert "kaizen-train --model" in capsys.readouterr().out
    assert (out / "tokenizer.json").is_file()
    converted, original = attach(kvlearn.load(out)), kvlearn.load(gqa_path)
    assert is_mla(converted) and not is_mla(original)
    ids = torch.randint(1, VOCAB_SIZE, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(converted(input_ids=ids, use_cache=False).logits,
                                   original(input_ids=ids, use_cache=False).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("extra, needle", [
    (["--rope-dim", "31"], "31"),
    (["--rope-dim", "16", "--rank", "7"], "rank"),
    (["--rope-dim", "16", "--calibration-length", "100000"], "--calibration-length=100000"),
    (["--rope-dim", "16", "--calibration-examples", "0"], "--calibration-examples=0"),
])
def test_bad_arguments_one_line(gqa_path, tmp_path, capsys, extra, needle):
    # later options win: each case overrides the valid defaults given first
    code = main(["convert-mla", "--model", str(gqa_path), "--out", str(tmp_path / "o"), "--device", "cpu",
                 "--calibration-length", "128", "--calibration-examples", "1", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("kvlearn: error:") and needle in err, err


def test_existing_output_is_refused_before_any_work(gqa_path, tmp_path, capsys):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("x")
    code = main(["convert-mla", "--model", str(gqa_path), "--out", str(tmp_path / "o"), "--rope-dim", "16",
                 "--calibration-length", "128"])
    assert code == 2 and "--overwrite" in capsys.readouterr().err
