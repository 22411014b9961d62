"""Atomic checkpoint writes: every file goes to a temporary name in the target directory and is
renamed only once all of them are complete (``os.replace`` within one directory is atomic).

An interrupted save therefore never leaves a half-written file under a final name, and never
touches the previous checkpoint's files before the new one is whole. The temporary names start
with a dot and end in ``.tmp``; a later successful save in the same directory removes leftovers
of a killed one.
"""

from __future__ import annotations

import os
import tempfile

from .files import TEMP_SUFFIX, is_weight_file


class Staging:
    """Temporary files in ``out_dir`` that become their final names together on ``commit``."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.staged: list[tuple[str, str]] = []  # (temporary path, final path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:
            self.discard()

    def new_file(self, final_name: str) -> str:
        """A fresh temporary path that ``commit`` will rename to ``final_name``."""
        fd, tmp = tempfile.mkstemp(prefix=f".{final_name}.", suffix=TEMP_SUFFIX, dir=self.out_dir)
        os.close(fd)
        self.staged.append((tmp, os.path.join(self.out_dir, final_name)))
        return tmp

    def commit(self) -> list[str]:
        """Rename every staged file to its final name; returns the final names."""
        umask = os.umask(0)
        os.umask(umask)
        for tmp, final in self.staged:
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give what a plain open() would
            os.replace(tmp, final)
        names, self.staged = [os.path.basename(final) for _, final in self.staged], []
        return names

    def discard(self) -> None:
        for tmp, _ in self.staged:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.staged = []


def remove_stale(out_dir: str, keep: set[str]) -> None:
    """After a commit: drop weight files of an earlier save (either form) that the new one did not
    write, as transformers does, and temporary files an interrupted save left behind."""
    for name in os.listdir(out_dir):
        leftover = name.startswith(".") and name.endswith(TEMP_SUFFIX) and is_weight_file(name[1:].rsplit(".", 2)[0])
        if (is_weight_file(name) and name not in keep) or leftover:
            os.remove(os.path.join(out_dir, name))
