"""A task's image: built from its Dockerfile and context, never pulled.

There is no registry to pull from, so every `FROM` (and `COPY --from=`) image must be on this
machine, or be mapped to one that is (`image_map={"python:3.12-slim": "ptrain-term-base:latest"}`,
`--image_map=python:3.12-slim=ptrain-term-base:latest` on the command line). Builds are cached
by a hash of what goes in (the Dockerfile as built, every context file's path, mode and bytes,
the base images' ids): the same task builds once per machine, and a changed file rebuilds.
"""

import fnmatch
import hashlib
import io
import os
import re
import stat
import tarfile
import tempfile
import threading
import time

from sandbox.terminal.container import tar_add

BASE_IMAGE = "ptrain-term-base:latest"  # built by `bash sandbox/setup_host.sh`
IMAGE_REPO = "ptrain-term-env"
_HASH_VERSION = b"ptrain-term-image-1"
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


class ImageError(RuntimeError):
    """The task's image cannot be had: a missing base image, or a failed build."""


def parse_image_map(items) -> dict[str, str]:
    """`{"FROM": "LOCAL"}` from a dict, or from "FROM=LOCAL" strings (the command line)."""
    if isinstance(items, dict):
        return dict(items)
    out = {}
    for item in items or ():
        name, sep, local = item.partition("=")
        if not sep or not name or not local:
            raise ValueError(f"image map entries are FROM-IMAGE=LOCAL-IMAGE, got {item!r}")
        out[name] = local
    return out


def _mapped(name: str, image_map: dict[str, str]) -> str:
    if name in image_map:
        return image_map[name]
    if ":" not in name.rsplit("/", 1)[-1] and f"{name}:latest" in image_map:
        return image_map[f"{name}:latest"]
    return name


def _how_to_provide(name: str) -> str:
    return (f"there is no registry to pull from. Provide it on this machine (`docker load -i "
            f"IMAGE.tar`, or `docker import ROOTFS.tar {name}`), or map it to a local image: "
            f"image_map={{{name!r}: {BASE_IMAGE!r}}} (--image_map={name}={BASE_IMAGE})")


def _image_id(client, name: str) -> str | None:
    import docker
    try:
        return client.images.get(name).id
    except docker.errors.ImageNotFound:
        return None


def ensure_image(task, client, *, image_map=None, network: bool = False, log=None) -> str:
    """The local image to run `task` in (a tag), building it if needed."""
    image_map = parse_image_map(image_map)
    if task.docker_image:
        name = _mapped(task.docker_image, image_map)
        if _image_id(client, name) is None:
            raise ImageError(f"{os.path.join(task.path, 'task.toml')}: [environment] "
                             f"docker_image {task.docker_image!r} is not present locally"
                             + (f" (mapped to {name!r})" if name != task.docker_image else "")
                             + "; " + _how_to_provide(task.docker_image))
        return name
    with open(task.dockerfile, encoding="utf-8") as f:
        text = f.read()
    text, bases = rewrite_bases(text, image_map)
    ids = []
    for line, original, name in bases:
        image_id = _image_id(client, name)
        if image_id is None:
            mapped = f" (mapped to {name!r})" if name != original else ""
            raise ImageError(f"{task.dockerfile}:{line}: image {original!r}{mapped} is not "
                             f"present locally; " + _how_to_provide(original))
        ids.append(image_id)
    files = _context_files(task.context_dir, task.context_exclude, task.dockerfile)
    digest = _digest(text, files, ids)
    tag = f"{IMAGE_REPO}:{digest[:20]}"
    with _lock_for(tag):
        if _image_id(client, tag) is not None:
            return tag
        with tempfile.TemporaryFile() as context:
            _write_context(context, task.context_dir, files, _dockerfile_in_context(task), text)
            context.seek(0)
            _build(client, context, tag, task, network, log)
    return tag


def _lock_for(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


# ---------------------------------------------------------------------------------------------
# Dockerfile: the images it starts from
# ---------------------------------------------------------------------------------------------

def _logical_lines(text: str):
    """(first line number, last line number, joined text) of each instruction; comments and
    blank lines inside a continuation are dropped, as docker does."""
    escape = "`" if re.match(r"(?is)\s*#\s*escape\s*=\s*`", text) else "\\"
    start, parts = None, []
    for i, raw in enumerate(text.split("\n"), 1):
        stripped = raw.strip()
        if start is None and (not stripped or stripped.startswith("#")):
            continue
        if start is not None and stripped.startswith("#"):
            continue
        if start is None:
            start = i
        if stripped.endswith(escape):
            parts.append(stripped[:-1])
            continue
        parts.append(stripped)
        yield start, i, " ".join(p for p in parts if p)
        start, parts = None, []
    if start is not None:
        yield start, len(text.split("\n")), " ".join(parts)


def _substitute(word: str, args: dict[str, str]) -> str:
    def sub(m):
        name = m.group(1) or m.group(3)
        default = m.group(2)
        value = args.get(name)
        return value if value else (default[2:] if default else "")
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-[^}]*)?\}|\$([A-Za-z_][A-Za-z0-9_]*)", sub,
                  word)


def rewrite_bases(text: str, image_map: dict[str, str]):
    """The Dockerfile with every external base image mapped through `image_map`, and
    [(line, image as written, image to use)] for each. Stage names, `scratch` and
    `COPY --from=<stage number>` are not images."""
    lines = text.split("\n")
    args, stages, bases, edits = {}, set(), [], []
    seen_from = False
    for first, last, inst in _logical_lines(text):
        word, _, rest = inst.partition(" ")
        op = word.upper()
        if op == "ARG" and not seen_from:
            name, _, default = rest.strip().partition("=")
            args[name.strip()] = default.strip().strip('"\'')
            continue
        refs = []
        if op == "FROM":
            seen_from = True
            tokens = [t for t in rest.split() if not t.startswith("--")]
            if not tokens:
                continue
            refs.append(tokens[0])
            if len(tokens) >= 3 and tokens[1].upper() == "AS":
                stages_after = tokens[2].lower()
            else:
                stages_after = None
        elif op in ("COPY", "ADD"):
            refs += re.findall(r"--from=(\S+)", rest)
            stages_after = None
        else:
            continue
        new_inst = inst
        for ref in refs:
            name = _substitute(ref, args)
            if name.lower() in stages or name.lower() == "scratch" or name.isdigit():
                continue
            target = _mapped(name, image_map)
            bases.append((first, name, target))
            if target != ref:
                new_inst = new_inst.replace(ref, target, 1)
        if stages_after:
            stages.add(stages_after)
        if new_inst != inst:
            edits.append((first, last, new_inst))
    for first, last, new_inst in reversed(edits):
        lines[first - 1:last] = [new_inst] + [""] * (last - first)  # keeps line numbers
    return "\n".join(lines), bases


# ---------------------------------------------------------------------------------------------
# Context: what is sent to the builder, and its hash
# ---------------------------------------------------------------------------------------------

def _dockerignore(context: str) -> list[tuple[bool, str]]:
    path = os.path.join(context, ".dockerignore")
    if not os.path.isfile(path):
        return []
    rules = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            pattern = os.path.normpath(line[1:] if negate else line).lstrip("/")
            rules.append((negate, pattern))
    return rules


def _ignored(rel: str, rules) -> bool:
    """.dockerignore semantics: the last matching rule wins; a pattern also matches what is
    below a matching directory; `**` matches any number of directories."""
    result = False
    for negate, pattern in rules:
        regex = fnmatch.translate(pattern).replace(".*.*", ".*")
        parts = rel.split("/")
        if any(re.match(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            result = not negate
    return result


def _context_files(context: str, exclude, dockerfile: str):
    """(relative path, host path, lstat) of every entry the build may use, sorted."""
    rules = _dockerignore(context) + [(False, p) for p in exclude]
    out = []
    for top, dirs, names in os.walk(context):
        for name in sorted(dirs) + sorted(names):
            host = os.path.join(top, name)
            rel = os.path.relpath(host, context)
            if _ignored(rel, rules) and host != dockerfile:
                if name in dirs:
                    dirs.remove(name)
                continue
            out.append((rel, host, os.lstat(host)))
    return sorted(out, key=lambda e: e[0])


def _digest(dockerfile_text: str, files, base_ids) -> str:
    h = hashlib.sha256(_HASH_VERSION)
    h.update(dockerfile_text.encode())
    for image_id in base_ids:
        h.update(image_id.encode())
    for rel, host, st in files:
        h.update(f"\0{rel}\0{stat.S_IFMT(st.st_mode)}\0{stat.S_IMODE(st.st_mode)}\0".encode())
        if stat.S_ISREG(st.st_mode):
            with open(host, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        elif stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(host).encode())
    return h.hexdigest()


def _dockerfile_in_context(task) -> str:
    rel = os.path.relpath(task.dockerfile, task.context_dir)
    return ".ptrain.Dockerfile" if rel.startswith("..") else rel


def _write_context(out, context: str, files, dockerfile_rel: str, dockerfile_text: str):
    """The build context as a tar, with the Dockerfile as it is built (bases mapped)."""
    with tarfile.open(fileobj=out, mode="w") as tar:
        for rel, host, st in files:
            if rel == dockerfile_rel:
                continue
            tar_add(tar, host, rel)
        data = dockerfile_text.encode()
        info = tarfile.TarInfo(dockerfile_rel)
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))


def _build(client, context, tag: str, task, network: bool, log) -> None:
    import docker
    import requests
    lines, error = [], None
    deadline = time.monotonic() + task.build_timeout_s
    try:
        stream = client.api.build(
            fileobj=context, custom_context=True, dockerfile=_dockerfile_in_context(task), tag=tag,
            rm=True, forcerm=True, pull=False, decode=True,
            network_mode="host" if network else "none", timeout=task.build_timeout_s,
            labels={"ptrain.term.task": task.name})
        for chunk in stream:
            if "stream" in chunk:
                lines.append(chunk["stream"])
                if log is not None:
                    log(chunk["stream"].rstrip("\n"))
            if "error" in chunk:
                error = chunk["error"]
            if time.monotonic() > deadline:
                stream.close()
                error = f"took over {task.build_timeout_s:g} s ([environment] build_timeout_sec)"
                break
    except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError) as e:
        error = (f"no progress for {task.build_timeout_s:g} s ([environment] "
                 f"build_timeout_sec): {e}")
    except docker.errors.APIError as e:
        error = str(e)
    if error is not None:
        tail = "".join(lines)[-3000:]
        raise ImageError(f"{task.dockerfile}: the build failed: {error.strip()}\n"
                         f"--- build log (tail) ---\n{tail}")
