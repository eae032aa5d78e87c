import gzip
import hashlib
import os
import tarfile
from pathlib import Path

ARCHIVE = "/app/backup.tar.gz"


def digests(root):
    out = {}
    for top, _, files in os.walk(root):
        for name in files:
            path = Path(top, name)
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def test_is_gzip_tar():
    assert os.path.isfile(ARCHIVE), f"{ARCHIVE} is missing"
    with open(ARCHIVE, "rb") as f:
        assert f.read(2) == b"\x1f\x8b", "not gzip-compressed"
    with gzip.open(ARCHIVE) as f:
        f.read()
    assert tarfile.is_tarfile(ARCHIVE)


def test_extracts_to_the_project_without_cache(tmp_path):
    with tarfile.open(ARCHIVE) as tar:
        assert all(not m.name.startswith(("/", "..")) for m in tar.getmembers())
        tar.extractall(tmp_path)
    want = {k: v for k, v in digests("/app/project").items() if not k.startswith("cache/")}
    got = digests(tmp_path / "project")
    assert got == want
