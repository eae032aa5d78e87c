import time
import urllib.request

BASE = "http://127.0.0.1:8080"


def get(path):
    last = None
    for _ in range(20):  # a server that is still starting gets two seconds
        try:
            with urllib.request.urlopen(BASE + path, timeout=2) as r:
                return r.status, r.read()
        except OSError as e:
            last = e
            time.sleep(0.1)
    raise AssertionError(f"nothing answers at {BASE}{path}: {last}")


def test_index():
    status, body = get("/index.html")
    assert status == 200
    assert body == b"<h1>ptrain</h1>\n"


def test_health():
    status, body = get("/health")
    assert status == 200
    assert body.strip() == b"ok"
