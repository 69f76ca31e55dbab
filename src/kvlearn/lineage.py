"""Which teacher a retrofitted student was distilled from.

A student folder written by ``kvlearn retrofit`` (:func:`kvlearn.train.distill.save_checkpoint`) holds
``teacher.json``: ``{"path": <the teacher folder as given>, "weights_sha256": <SHA-256 of its model.safetensors>}``.
Comparing a student with a teacher (``kvlearn demo``: dense and streaming rows of the teacher beside the student's
KVpop rows) is like for like only when the student descends from that teacher; :func:`teacher_mismatch` says when it
does not. The digest is of the file's bytes: the same weights saved again in another layout count as another teacher.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

TEACHER_FILE = "teacher.json"
WEIGHTS_FILE = "model.safetensors"


def weights_digest(folder: str | os.PathLike) -> str | None:
    """SHA-256 (hex) of ``folder/model.safetensors``; None when the folder has no such file. Remembered per file
    (path, size, modification time), so a trainer that saves every few hundred steps hashes its teacher once."""
    path = os.path.join(os.fspath(folder), WEIGHTS_FILE)
    if not os.path.isfile(path):
        return None
    st = os.stat(path)
    return _file_digest(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_teacher_record(student_folder: str | os.PathLike, teacher_folder: str | os.PathLike) -> dict:
    """Write ``student_folder/teacher.json`` naming ``teacher_folder`` and its weights' digest; returns the record."""
    record = {"path": os.fspath(teacher_folder), "weights_sha256": weights_digest(teacher_folder)}
    with open(os.path.join(os.fspath(student_folder), TEACHER_FILE), "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    return record


def read_teacher_record(student_folder: str | os.PathLike) -> dict | None:
    """The student's ``teacher.json`` (None for a folder without one, e.g. a model not made by ``kvlearn retrofit``)."""
    path = os.path.join(os.fspath(student_folder), TEACHER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def teacher_mismatch(student_folder: str | os.PathLike, teacher_folder: str | os.PathLike) -> str | None:
    """A one-line message when the student records a teacher whose weights differ from ``teacher_folder``'s; None when
    they match or when either side has nothing to compare (no record, no weights file)."""
    record = read_teacher_record(student_folder)
    if record is None or not record.get("weights_sha256"):
        return None
    have = weights_digest(teacher_folder)
    if have is None or have == record["weights_sha256"]:
        return None
    return (f"the student {os.fspath(student_folder)!r} was distilled from another teacher ({record.get('path')!r}, "
            f"weights {record['weights_sha256'][:12]}) than {os.fspath(teacher_folder)!r} (weights {have[:12]}): "
            "its rows are not like for like with this teacher's")
