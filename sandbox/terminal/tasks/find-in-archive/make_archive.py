"""Writes /app/incoming.tar.gz: 300 files, one of them with the token."""
import io
import random
import tarfile

rng = random.Random(3)
words = "alpha beta gamma delta epsilon zeta eta theta".split()
with tarfile.open("/app/incoming.tar.gz", "w:gz") as tar:
    for i in range(300):
        lines = [" ".join(rng.choice(words) for _ in range(8)) for _ in range(5)]
        if i == 217:
            lines.insert(2, "TOKEN=7f3a-kiwi-42")
        data = ("\n".join(lines) + "\n").encode()
        info = tarfile.TarInfo(f"batch{i // 100}/file{i:03d}.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
