"""Writes /app/access.log: a deterministic mix of status codes."""
import random

rng = random.Random(7)
codes = [200] * 50 + [404] * 12 + [500] * 5 + [301] * 12 + [403] * 3
rng.shuffle(codes)
with open("/app/access.log", "w") as f:
    for i, code in enumerate(codes):
        f.write(f'10.0.0.{i % 250} - - [01/Jan/2025:10:{i % 60:02d}:00 +0000] '
                f'"GET /page/{i} HTTP/1.1" {code} {100 + i}\n')
