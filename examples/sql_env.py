"""A SQL environment, written as a user writes one (docs/environments.md walks through it).

    dict(env="examples.sql_env:make", args=dict(n_train=200, n_heldout=20), weight=1.0)

Tasks are generated from a schema: a question about a small shop database (stdlib sqlite3)
and the reference query's result. The model answers with a query (in a ```sql fence, or the
whole answer), and may first explore with the `sql` tool. The verifier runs the answer in the
sandbox against a fresh copy of the database and compares result sets (as multisets: row
order is not judged); the feedback names the SQL error or the first wrong row.
"""

import collections
import dataclasses
import json
import random
import re
import sqlite3

import sandbox

from ptrain.envs import Environment, Splits, Tool, Verdict, base, synthetic
from ptrain.rewards import extract_code
from ptrain.tasks import Task

PEOPLE = ("ann", "bob", "cid", "dee", "eve", "fay", "gus", "hal")
CITIES = ("oslo", "rome", "lima")
ITEMS = ("pen", "cup", "hat", "map")
QUESTIONS = (  # (question, reference query): {x} is filled from the data
    ("people who live in {city}", "SELECT name FROM people WHERE city = '{city}'"),
    ("people older than {age}", "SELECT name FROM people WHERE age > {age}"),
    ("how many orders {name} placed",
     "SELECT COUNT(*) FROM orders JOIN people ON orders.person = people.id "
     "WHERE people.name = '{name}'"),
    ("the total price of orders of {item}",
     "SELECT SUM(price) FROM orders WHERE item = '{item}'"),
)
# Run in the sandbox: build the database from db.sql, run the query, print rows as JSON.
RUN = """import json, sqlite3, sys
db = sqlite3.connect(":memory:")
db.executescript(open("db.sql").read())
try:
    rows = db.execute({query!r}).fetchall()
except sqlite3.Error as e:
    print(json.dumps({{"error": f"{{type(e).__name__}}: {{e}}"}}))
else:
    print(json.dumps({{"rows": [list(r) for r in rows]}}))
"""


@dataclasses.dataclass(frozen=True)
class Rows:
    """The verifier's data: the reference query's rows."""
    rows: tuple


def database(rng: random.Random) -> str:
    """A fresh database as SQL: eight people, a dozen orders."""
    people = [(i, n, rng.choice(CITIES), rng.randint(18, 70)) for i, n in enumerate(PEOPLE)]
    orders = [(i, rng.randrange(len(PEOPLE)), rng.choice(ITEMS), rng.randint(1, 9))
              for i in range(12)]
    return ("CREATE TABLE people (id INTEGER, name TEXT, city TEXT, age INTEGER);\n"
            "CREATE TABLE orders (id INTEGER, person INTEGER, item TEXT, price INTEGER);\n"
            + "".join(f"INSERT INTO people VALUES {p!r};\n" for p in people)
            + "".join(f"INSERT INTO orders VALUES {o!r};\n" for o in orders))


def outcome(result) -> dict:
    """What a sandbox run of RUN printed: {"rows": [...]} or {"error": "..."}."""
    if not result.ok:
        return {"error": result.describe()}
    return json.loads(result.stdout_text)


def _sql_tool(session, args, timeout_s):  # in the episode's work dir, which holds db.sql
    out = outcome(session.run(RUN.format(query=args["query"]), language="python",
                              timeout_s=timeout_s))
    return out.get("error") or "\n".join(" | ".join(map(str, r)) for r in out["rows"]) or "(none)"


SQL = Tool("sql", "Run a SQL query on the shop database (tables people(id, name, city, age) and "
           "orders(id, person, item, price)); returns its rows.",
           {"type": "object", "properties": {"query": {"type": "string"}},
            "required": ["query"], "additionalProperties": False}, _sql_tool)


def generate(n: int, seed: int, split: str, tools: bool, exclude=()) -> list:
    rng, out, seen = random.Random(f"{seed}/sql/{split}"), [], set(exclude)
    while len(out) < n:
        setup = database(rng)
        db = sqlite3.connect(":memory:")
        db.executescript(setup)
        question, query = rng.choice(QUESTIONS)
        fill = dict(city=rng.choice(CITIES), age=rng.randint(20, 60), name=rng.choice(PEOPLE),
                    item=rng.choice(ITEMS))
        prompt = f"sql: write a query for {question.format(**fill)}\n"
        if prompt in seen:
            continue
        seen.add(prompt)
        rows = tuple(tuple(r) for r in db.execute(query.format(**fill)).fetchall())
        out.append(Task(
            id=f"{split}/sql/{len(out)}", domain="sql", prompt=prompt, verifier=Rows(rows),
            tools=("sql",) if tools else (), files={"db.sql": setup},
            metadata={"reference": query.format(**fill)}))
    return out


def verify(tasks, answers, *, sessions, pool, config) -> list:
    """Each answer's query run in the sandbox (on `pool`) on a fresh database, its rows
    compared with the reference's."""
    runs = [base.submit(pool, sandbox.run, RUN.format(query=extract_code(a, "sql")),
                        files={"db.sql": t.files["db.sql"]}, timeout_s=config.timeout_s,
                        memory_mb=config.memory_mb, backend=config.backend)
            for t, a in zip(tasks, answers)]
    verdicts = []
    for task, run in zip(tasks, runs):
        out, want = outcome(run.result()), [list(r) for r in task.verifier.rows]
        if "error" in out:
            verdicts.append(Verdict(0.0, False, 0.0, f"SQL error: {out['error']}", "sql_error"))
            continue
        missing = collections.Counter(map(json.dumps, want))
        missing.subtract(map(json.dumps, out["rows"]))
        wrong = [r for r in out["rows"] if missing[json.dumps(r)] < 0] or [
            json.loads(r) for r, k in missing.items() if k > 0]
        ok = not wrong and len(out["rows"]) == len(want)
        feedback = "Correct." if ok else (
            f"{len(out['rows'])} rows, expected {len(want)}; first wrong row: {wrong[0]}"
            if wrong else f"{len(out['rows'])} rows, expected {len(want)}")
        verdicts.append(Verdict(float(ok), ok, float(ok), feedback, "" if ok else "wrong_rows"))
    return verdicts


def tokenizer():
    text = " ".join([q + " " + s for q, s in QUESTIONS] + list(PEOPLE + CITIES + ITEMS)) + \
        " sql write a query for SQL error rows expected first wrong row Correct none"
    return synthetic.WordTokenizer(re.findall(r"[A-Za-z]+", text) + [
        chr(i) for i in range(33, 127)] + [" " * n for n in range(1, 9)] + ["\n"])


def make(n_train: int = 200, n_heldout: int = 20, tools: bool = False) -> Environment:
    """The SQL environment; `tools`: offer the `sql` tool to explore before answering."""
    def tasks(ctx):
        held = generate(n_heldout, ctx.seed, "heldout", tools)
        return Splits(generate(n_train, ctx.seed, "train", tools, {t.prompt for t in held}),
                      held)
    return Environment(name="sql", tasks=tasks, verify=verify, tools=(SQL,),
                       tokenizer=tokenizer)
