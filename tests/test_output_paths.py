"""``kvlearn.output_paths``: every command that writes a folder or a file refuses, in one line and before any work, an
output it could not create (a pseudo-filesystem such as /proc or /sys, which ``os.access`` calls writable for root; a
path under a file; a folder's place taken by a file), and the check leaves nothing behind. Before session 58, ``retrofit``,
``kaizen-train``, ``convert-mla`` and ``reproduce`` raised ``FileNotFoundError`` from deep inside, and ``pretrain``
trained on until it saved. Tiny random GQA teacher (2 KV heads, 2 query heads each)."""

from pathlib import Path

import pytest

from kvlearn import KVLearnError
from kvlearn.cli import main
from kvlearn.output_paths import check_writable_location

PSEUDO = Path("/proc")


def test_a_writable_location_passes_and_the_probe_leaves_nothing(tmp_path):
    (tmp_path / "file.json").write_text("{}")
    before = sorted(tmp_path.rglob("*"))
    for path in (tmp_path / "new" / "deeper", tmp_path / "file.json", tmp_path, tmp_path / "r.json"):
        assert check_writable_location(path, "--out") == path
    assert sorted(tmp_path.rglob("*")) == before


def test_a_path_under_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(KVLearnError, match=r"--out '.*file/sub/x' cannot be written: '.*file' is not a directory"):
        check_writable_location(tmp_path / "file" / "sub" / "x", "--out")


@pytest.mark.parametrize("command", ["retrofit", "kaizen-train", "pretrain", "convert-mla", "reproduce", "eval"])
@pytest.mark.parametrize("where", ["pseudo-filesystem", "existing file"])
def test_every_command_refuses_an_output_it_cannot_create_before_any_work(command, where, make_teacher, capsys,
                                                                           monkeypatch, tmp_path):
    import kvlearn.train.distill as distill
    import kvlearn.train.kaizen_train as kaizen
    import kvlearn.train.pretrain as pretrain

    ran = []  # the trainers must never start
    monkeypatch.setattr(distill, "retrofit", lambda *a, **k: ran.append("retrofit"))
    monkeypatch.setattr(kaizen, "kaizen_train", lambda *a, **k: ran.append("kaizen"))
    monkeypatch.setattr(pretrain, "pretrain", lambda *a, **k: ran.append("pretrain"))
    if where == "pseudo-filesystem" and not (PSEUDO / "self").is_dir():
        pytest.skip("no /proc on this system")
    teacher = make_teacher(2, 0)
    out = str(PSEUDO / "kvlearn-out")
    if where == "existing file":  # a folder's place taken by a file (eval writes a file: its place taken by a folder)
        out = str(tmp_path / "taken")
        if command == "eval":
            Path(out + ".json").mkdir()
        else:
            Path(out).write_text("{}")
    argv = {"retrofit": ["retrofit", "--model", teacher, "--out", out, "--method", "kvpop", "--budget", "64",
                         "--seq-len", "128", "--steps", "1"],
            "kaizen-train": ["kaizen-train", "--model", teacher, "--out", out, "--seq-len", "128", "--steps", "1"],
            "pretrain": ["pretrain", "--out", out, "--steps", "1"],
            "convert-mla": ["convert-mla", "--model", teacher, "--out", out, "--rope-dim", "8",
                            "--calibration-length", "256"],
            "reproduce": ["reproduce", "kvpop", "--out", out, "--steps", "1"],
            "eval": ["eval", "--model", teacher, "--method", "dense", "--out", out + ".json"]}[command]
    capsys.readouterr()
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    expected = {"pseudo-filesystem": "cannot be written",
                "existing file": "is a directory: expected a file" if command == "eval" else "is a file: expected a folder"}
    assert len(err.splitlines()) == 1 and f"'{out}" in err and expected[where] in err, err
    assert ran == []
