"""A session's work dir kept on the host between runs, so that the session needs no sandbox of
its own: each run lays it into whichever warm sandbox is free and collects it back.

The fork server collects it (`forkserver.collect_state`) as entries in an order it can
replay, `[path, kind, mode, mtime_ns]` plus the size of a file (kind "f") or the target of a
symlink ("l"); kinds "d" (directory) and "p" (fifo) have nothing more; path "." is the work
dir itself. The regular files' contents are one byte string, in entry order.
"""

import dataclasses
import posixpath
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class WorkDir:
    """The entries and file contents of a work dir, and `pending` files to write over it at
    the next lay-in (what `Session.write_files` adds without a round trip)."""

    entries: tuple = ()
    data: bytes = b""
    pending: Mapping[str, bytes] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_reply(cls, entries: list, data: bytes) -> "WorkDir":
        size = sum(e[4] for e in entries if e[1] == "f")
        if size != len(data):
            raise ValueError(f"work dir of {size} bytes came with {len(data)}")
        return cls(tuple(entries), data)

    def files(self) -> dict[str, bytes]:
        """The regular files (relative path -> bytes), pending ones included."""
        out, at = {}, 0
        for entry in self.entries:
            if entry[1] == "f":
                out[entry[0]] = self.data[at:at + entry[4]]
                at += entry[4]
        out.update(self.pending)
        return out

    def others(self) -> dict[str, str]:
        """The kind of every entry that is not a regular file (as `Result.other_files`)."""
        kinds = {"d": "directory", "l": "symlink", "p": "fifo"}
        return {e[0]: kinds[e[1]] for e in self.entries
                if e[1] in kinds and e[0] != "." and e[0] not in self.pending}

    def with_files(self, files: Mapping[str, bytes]) -> "WorkDir | None":
        """This work dir with `files` (validated, normalised paths) added as pending, or
        None when writing them could go differently than into a plain directory tree (a
        path that is a directory, a symlink or fifo, or a read-only file; a parent that is
        not a writable directory): then only the sandbox can say what happens."""
        kinds = {e[0]: (e[1], e[2]) for e in self.entries}
        for path in self.pending:
            kinds[path] = ("f", 0o644)
            for parent in _parents(path):
                kinds.setdefault(parent, ("d", 0o755))
        for path in files:
            kind, mode = kinds.get(path, ("f", 0o644))
            if kind != "f" or not mode & 0o200:
                return None
            for parent in _parents(path):
                kind, mode = kinds.get(parent, ("d", 0o755))
                if kind != "d" or mode & 0o300 != 0o300:
                    return None
        return dataclasses.replace(self, pending={**self.pending, **files})

    def to_wire(self) -> tuple[list, list, list[bytes]]:
        """(entries, pending files as [path, size], raw bytes in the order they are sent:
        the contents of the entries' files, then of the pending ones)."""
        pending = [[path, len(data)] for path, data in self.pending.items()]
        return list(self.entries), pending, [self.data, *self.pending.values()]


def entry_at(files: Mapping[str, bytes], others: Mapping[str, str], path: str):
    """What a work dir holds at `path` (a relative path): the bytes of a regular file, the
    kind of any other entry ("directory", "symlink", "fifo", "socket", "device"; "symlink"
    too for a path whose parent is a symlink, which may lead anywhere), or None only where
    there is nothing at all. `files`, `others`: `Result.files` and `Result.other_files`, or
    `Session.listing()`. `path` is normalised first ("./a", "a/" and "a//b" name "a" and
    "a/b")."""
    path = posixpath.normpath(path)
    if path in files:
        return files[path]
    if path in others:
        return others[path]
    for parent in _parents(path):
        if others.get(parent) == "symlink":
            return "symlink"
    return None


def _parents(path: str):
    """The directories `path` is in, up to the work dir itself (".")."""
    parent = posixpath.dirname(path)
    while parent:
        yield parent
        parent = posixpath.dirname(parent)
    yield "."
