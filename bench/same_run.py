"""Number for number: two runs' metrics.jsonl, rollouts.jsonl and eval.jsonl are identical,
time/* keys aside.

    python bench/same_run.py /work/baseline/grpo_toy runs/grpo_toy

Prints one line per file (rows compared, keys compared, the differences) and exits 1 if any
value differs (exactly: the runs are deterministic on one machine).
"""

import os
import sys

from ptrain import jsonl


def compare(a_dir, b_dir, name):
    a_path, b_path = os.path.join(a_dir, name), os.path.join(b_dir, name)
    if not os.path.exists(a_path) and not os.path.exists(b_path):
        return []
    a, b = jsonl.read(a_path), jsonl.read(b_path)
    diffs = [] if len(a) == len(b) else [f"{name}: {len(a)} rows vs {len(b)}"]
    keys = 0
    for i, (x, y) in enumerate(zip(a, b)):
        x = {k: v for k, v in x.items() if not k.startswith("time/")}
        y = {k: v for k, v in y.items() if not k.startswith("time/")}
        keys += len(x)
        for k in sorted(set(x) | set(y)):
            if x.get(k, "<absent>") != y.get(k, "<absent>"):
                diffs.append(f"{name} row {i} {k}: {x.get(k, '<absent>')} vs "
                             f"{y.get(k, '<absent>')}")
    print(f"{name}: {len(a)} rows, {keys} values compared, {len(diffs)} differences")
    return diffs


def main(a_dir, b_dir):
    diffs = [d for name in ("metrics.jsonl", "rollouts.jsonl", "eval.jsonl")
             for d in compare(a_dir, b_dir, name)]
    for d in diffs[:20]:
        print("  " + d)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
