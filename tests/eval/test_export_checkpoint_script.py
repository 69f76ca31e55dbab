"""``benchmarks/export_checkpoint.py``: a KVpop student (tiny GQA Qwen3, 2 layers, 2 KV heads, 2 query heads per KV
head, mLSTM scorers) exported in bf16 loads back with its scorers and decays, every weight equal to the source's rounded
to bf16 (KVpop's modules keep float32), its lineage file beside it; bad input is one line."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import export_checkpoint  # noqa: E402

import kvlearn  # noqa: E402
from kvlearn.config import KVpopConfig  # noqa: E402
from kvlearn.kvpop.apply import apply_kvpop  # noqa: E402


@pytest.fixture
def student(make_teacher, tmp_path):
    model = kvlearn.load(make_teacher(2, 3))
    apply_kvpop(model, KVpopConfig(sinks=2, window=8, topk=22, scorer="mlstm"))
    with torch.no_grad():  # non-trivial added weights, so that a dropped module would show
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    folder = tmp_path / "student"
    model.save_pretrained(folder)
    (folder / "teacher.json").write_text(json.dumps({"teacher": "tiny"}))
    return folder


def test_bf16_export_keeps_every_weight_and_the_lineage(student, tmp_path):
    dst = tmp_path / "exported"
    assert export_checkpoint.main([str(student), str(dst)]) == 0
    src, got = load_file(str(student / "model.safetensors")), load_file(str(dst / "model.safetensors"))
    assert set(got) == set(src) and any(".kvpop." in k for k in got)
    for k, v in src.items():  # the backbone in bf16; KVpop's modules keep their float32 (kvlearn.kvpop.apply)
        assert got[k].dtype == (torch.float32 if ".kvpop." in k else torch.bfloat16), k
        assert torch.equal(got[k], v.to(got[k].dtype)), k
    assert (dst / "teacher.json").read_text() == (student / "teacher.json").read_text()
    back = kvlearn.load(dst)
    assert json.loads((dst / "config.json").read_text())["kvpop"]["scorer"] == "mlstm"
    ids = torch.randint(3, 100, (1, 40))
    with torch.no_grad():
        assert torch.isfinite(back(input_ids=ids).logits).all()


def test_existing_folder_needs_overwrite_and_bad_input_is_one_line(student, tmp_path, capsys):
    dst = tmp_path / "exported"
    assert export_checkpoint.main([str(student), str(dst)]) == 0
    assert export_checkpoint.main([str(student), str(dst)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    (dst / "stale.txt").write_text("x")
    assert export_checkpoint.main([str(student), str(dst), "--overwrite"]) == 0
    assert not (dst / "stale.txt").exists()  # replaced, not merged
    assert export_checkpoint.main([str(student), str(tmp_path / "e2"), "--dtype", "int8"]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert errors == ["error: dtype='int8' is invalid: expected one of bfloat16, float16, float32"]
    assert export_checkpoint.main([str(tmp_path / "nothing"), str(tmp_path / "e3")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert export_checkpoint.main([str(student), str(student), "--overwrite"]) == 2
    assert "is the source folder" in capsys.readouterr().err
