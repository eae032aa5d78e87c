"""A terminal task's environment as files on an unpacked base: what the bwrap backend runs.

`plan(task)` reads the task's Dockerfile: FROM a base whose root file system is unpacked on
this machine (`bases()`: `bash sandbox/setup_host.sh` unpacks ptrain-term-base's into
$PTRAIN_TERM_ROOTFS_DIR, default /var/lib/ptrain/rootfs, with NAME.json beside it), then only
WORKDIR, ENV and COPY of context files (`.dockerignore` and the TB 1.0 exclusions applied, as
for a docker build); metadata (LABEL, EXPOSE, CMD, ...) is ignored, since nothing runs it.
Anything else (RUN, ADD, USER, ARG, COPY --from, a second stage, a prebuilt docker_image)
raises `NeedsImage` naming the line: that task needs the image its Dockerfile builds.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os

from sandbox.terminal.image import _context_files, _logical_lines, _mapped, _substitute

ROOTFS_DIR = os.environ.get("PTRAIN_TERM_ROOTFS_DIR", "/var/lib/ptrain/rootfs")
_METADATA = {"LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "HEALTHCHECK", "MAINTAINER",
             "STOPSIGNAL", "SHELL", "VOLUME", "ONBUILD"}


class NeedsImage(RuntimeError):
    """The task's environment is more than files on a known base: use the docker backend."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """A task's environment for bwrap: the base's root, the work dir, the environment and
    the files its Dockerfile copies in ((host path, sandbox path), in order)."""
    image: str
    rootfs: str
    workdir: str
    env: tuple[tuple[str, str], ...]
    copies: tuple[tuple[str, str], ...]
    dirs: tuple[str, ...]  # made empty (WORKDIR, COPY of an empty directory)


def bases(rootfs_dir: str = ROOTFS_DIR) -> dict[str, dict]:
    """{image name: its description (rootfs dir, env, workdir)} of the unpacked bases."""
    out = {}
    for name in sorted(os.listdir(rootfs_dir)) if os.path.isdir(rootfs_dir) else ():
        if name.endswith(".json"):
            with open(os.path.join(rootfs_dir, name)) as f:
                meta = json.load(f)
            meta["rootfs"] = os.path.join(rootfs_dir, name[:-len(".json")])
            if os.path.isdir(meta["rootfs"]):
                out[meta["image"]] = meta
    return out


def plan(task, *, image_map=None, rootfs_dir: str = ROOTFS_DIR) -> Plan:
    """The task's environment as files on an unpacked base, or `NeedsImage` saying why not."""
    image_map = dict(image_map or {})
    if task.dockerfile is None:
        raise NeedsImage(f"{task.name}: runs in the prebuilt image {task.docker_image!r}, "
                         f"which bwrap cannot provide; use the docker backend")
    known = bases(rootfs_dir)
    with open(task.dockerfile, encoding="utf-8") as f:
        text = f.read()
    allowed = {rel: host for rel, host, _ in
               _context_files(task.context_dir, task.context_exclude, task.dockerfile)}
    where = os.path.relpath(task.dockerfile, task.path)
    base, workdir, env, copies, dirs = None, None, {}, [], []

    def refuse(line, why):
        raise NeedsImage(f"{task.name}: {where} line {line}: {why}; it needs the image its "
                         f"Dockerfile builds: use the docker backend")

    for line, _, inst in _logical_lines(text):
        word, _, rest = inst.partition(" ")
        op, rest = word.upper(), rest.strip()
        if op == "FROM":
            if base is not None:
                refuse(line, "a second FROM (a multi-stage build)")
            tokens = [t for t in rest.split() if not t.startswith("--")]
            name = _mapped(tokens[0], image_map) if tokens else ""
            if name not in known and f"{name}:latest" in known:
                name = f"{name}:latest"
            if name not in known:
                refuse(line, f"FROM {tokens[0] if tokens else ''}: no unpacked root file "
                             f"system of {name!r} in {rootfs_dir} (bases there: "
                             f"{sorted(known) or 'none'})")
            base = known[name]
            workdir, env = base.get("workdir") or "/", dict(base.get("env") or {})
        elif base is None:
            refuse(line, f"{op} before FROM")
        elif op == "WORKDIR":
            workdir = os.path.normpath(os.path.join(workdir, _expand(rest, env)))
            dirs.append(workdir)
        elif op == "ENV":
            env.update(_env_pairs(rest))
        elif op == "COPY":
            args = rest.split()
            if any(a.startswith("--") for a in args) or len(args) < 2:
                refuse(line, f"COPY {rest} (only `COPY SRC... DEST` of context files)")
            *srcs, dest = [_expand(a, env) for a in args]
            dest = os.path.normpath(os.path.join(workdir, dest)) + ("/" if dest.endswith("/")
                                                                   else "")
            for src in srcs:
                found = sorted(rel for rel in allowed
                               if fnmatch.fnmatch(rel, os.path.normpath(src)))
                if not found:
                    refuse(line, f"COPY {src}: not in the build context")
                into_dir = dest.endswith("/") or len(srcs) > 1 or any(
                    ch in src for ch in "*?[")
                for rel in found:
                    host = allowed[rel]
                    if os.path.isdir(host) and not os.path.islink(host):
                        below = [r for r in allowed if r.startswith(rel + "/")]
                        target = dest.rstrip("/")
                        dirs.append(target)
                        for r in below:
                            h = allowed[r]
                            path = os.path.join(target, os.path.relpath(r, rel))
                            if os.path.isdir(h) and not os.path.islink(h):
                                dirs.append(path)
                            elif os.path.isfile(h) and not os.path.islink(h):
                                copies.append((h, path))
                            else:
                                refuse(line, f"COPY {src}: {r} is not a regular file")
                    elif os.path.isfile(host) and not os.path.islink(host):
                        path = (os.path.join(dest, os.path.basename(rel)) if into_dir
                                else dest.rstrip("/"))
                        copies.append((host, path))
                    else:
                        refuse(line, f"COPY {src}: {rel} is not a regular file")
        elif op not in _METADATA:
            refuse(line, f"{op} {rest[:60]}")
    if base is None:
        raise NeedsImage(f"{task.name}: {where} has no FROM")
    env.update(dict(task.env))
    return Plan(name, base["rootfs"], workdir, tuple(env.items()), tuple(copies),
                tuple(dict.fromkeys(dirs)))


def _expand(word: str, env: dict) -> str:
    return _substitute(word.strip('"\''), env)


def _env_pairs(rest: str) -> dict[str, str]:
    import shlex
    words = shlex.split(rest)
    if words and "=" not in words[0]:  # the old form: ENV KEY VALUE...
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words)
