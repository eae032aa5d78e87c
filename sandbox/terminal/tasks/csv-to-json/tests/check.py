import csv
import json

with open("/app/inventory.csv", newline="") as f:
    rows = list(csv.DictReader(f))
want = [{**r, "qty": int(r["qty"]), "price": float(r["price"])} for r in rows]
try:
    with open("/app/inventory.json") as f:
        got = json.load(f)
except (OSError, ValueError) as e:
    print(f"FAIL: /app/inventory.json cannot be read as JSON: {e}")
    got = []
if not isinstance(got, list):
    print("FAIL: the JSON is not an array")
    got = []
ok = 0
for i, w in enumerate(want):
    g = got[i] if i < len(got) else None
    good = (isinstance(g, dict) and g == w and type(g["qty"]) is int
            and isinstance(g["price"], (int, float)))
    ok += good
    print(("ok  " if good else "FAIL") + f" row {i}: want {w}, got {g}")
if len(got) != len(want):
    print(f"FAIL: {len(got)} objects for {len(want)} rows")
reward = ok / len(want) if len(got) == len(want) else 0.0
with open("/logs/verifier/reward.json", "w") as f:
    json.dump({"reward": reward, "rows_correct": ok}, f)
