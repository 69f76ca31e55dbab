"""teacher.json: the record of which teacher a retrofitted student descends from, and its comparison."""

import hashlib
import json

from kvlearn.lineage import read_teacher_record, teacher_mismatch, weights_digest, write_teacher_record


def folder(path, content: bytes):
    path.mkdir()
    (path / "model.safetensors").write_bytes(content)
    return path


def test_digest_is_sha256_of_the_weights_file(tmp_path):
    t = folder(tmp_path / "t", b"weights of the teacher" * 100_000)  # several read blocks
    assert weights_digest(t) == hashlib.sha256(b"weights of the teacher" * 100_000).hexdigest()
    assert weights_digest(tmp_path) is None


def test_record_and_mismatch(tmp_path):
    teacher, other = folder(tmp_path / "teacher", b"A"), folder(tmp_path / "other", b"B")
    student = folder(tmp_path / "student", b"C")
    assert teacher_mismatch(student, teacher) is None  # nothing recorded: nothing to say
    record = write_teacher_record(student, teacher)
    assert json.loads((student / "teacher.json").read_text()) == record == read_teacher_record(student)
    assert record["weights_sha256"] == hashlib.sha256(b"A").hexdigest()
    assert teacher_mismatch(student, teacher) is None
    msg = teacher_mismatch(student, other)
    assert msg is not None and "\n" not in msg and "another teacher" in msg
    assert hashlib.sha256(b"A").hexdigest()[:12] in msg and hashlib.sha256(b"B").hexdigest()[:12] in msg
    copy = folder(tmp_path / "copy", b"A")  # the same bytes elsewhere: the same teacher
    assert teacher_mismatch(student, copy) is None


def test_digest_follows_a_rewritten_file(tmp_path):
    t = folder(tmp_path / "t", b"first")
    first = weights_digest(t)
    (t / "model.safetensors").write_bytes(b"second, longer")  # another size: not the remembered digest
    assert weights_digest(t) == hashlib.sha256(b"second, longer").hexdigest() != first
