#!/bin/bash
python3 - <<'PY'
import csv, json
with open("/app/inventory.csv", newline="") as f:
    rows = [{**r, "qty": int(r["qty"]), "price": float(r["price"])} for r in csv.DictReader(f)]
with open("/app/inventory.json", "w") as f:
    json.dump(rows, f, indent=2)
PY
