"""Whether an output path can be written, checked before any work starts: a one-line error instead of a
``FileNotFoundError`` or ``PermissionError`` when the checkpoint or table is saved minutes later.

``os.access`` answers for permissions only: a pseudo-filesystem (``/proc``, ``/sys``) reports a folder writable to root
yet refuses new files, so :func:`check_writable_location` also creates (and at once removes) a temporary file in the
nearest folder that exists."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import KVLearnError, check

__all__ = ["check_writable_location", "check_output_folder"]


def nearest_existing(path: Path) -> Path:
    """``path`` itself if it exists, else its nearest ancestor that does (``.`` for a bare relative name)."""
    p = path if str(path) else Path(".")
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable_location(path: str | os.PathLike, name: str) -> Path:
    """One-line errors unless ``path`` (a folder or a file, existing or not) can be created or written: its nearest
    existing ancestor must be a folder that accepts new files (``name``: the option or field, e.g. ``--out``).
    Creates nothing that stays behind. Returns ``Path(path)``."""
    p = Path(path)
    if p.exists() and not p.is_dir():  # an existing file: its permissions decide (a read-only mount says so too)
        check(os.access(p, os.W_OK), f"{name} {str(path)!r} cannot be written: permission denied")
        return p
    folder = nearest_existing(p)
    check(folder.is_dir(), f"{name} {str(path)!r} cannot be written: {str(folder)!r} is not a directory")
    check(os.access(folder, os.W_OK | os.X_OK), f"{name} {str(path)!r} cannot be written: permission denied")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kvlearn-write-probe-"):
            pass
    except OSError as error:
        raise KVLearnError(f"{name} {str(path)!r} cannot be written: {str(folder)!r} refuses new files "
                           f"({error.strerror or error})") from None
    return p


def check_output_folder(path: str | os.PathLike, name: str) -> Path:
    """One-line errors unless ``path`` is a folder, existing or not, that can be created and written (a trainer's or a
    converter's ``out``): an existing file is refused, then :func:`check_writable_location`. Returns ``Path(path)``."""
    p = Path(path)
    check(not p.exists() or p.is_dir(), f"{name}={str(path)!r} is a file: expected a folder")
    return check_writable_location(p, name)
