"""ptrain/envs/: environments named by import path, checked before anything runs (each bad
input of docs/environments.md a clear error naming what to fix), the verdict and its rubric,
and the SQL worked example (examples/sql_env.py): its verdicts on right and wrong queries,
its `sql` tool in an episode, its rewards in the batch (tests/test_readme.py trains it through
the closed loop)."""

import math

import jax
import pytest

from ptrain import chat, closed_loop, envs, rewards, rollout
from ptrain.envs import Environment, Splits, Tool, TurnPolicy, Verdict
from ptrain.envs import base as envs_base
from ptrain.envs import verdict as verdict_lib

pytestmark = pytest.mark.xdist_group("sandbox")
SQL = "examples.sql_env:make"
CFG = rewards.RewardConfig(backend="process")


def _run(session, args, timeout_s):
    return "ok"


# Environments the entries below name by import path (this module's).
def bad_tool():
    return Environment(name="bad", tasks=lambda ctx: Splits((), ()), verify=lambda *a, **k: [],
                       tools=(Tool("query", "", {"type": "string"}, _run),))


def not_an_environment():
    return {"name": "sql"}


def no_heldout():
    from ptrain.tasks import Answer, Task
    return Environment(name="noheld", verify=rewards.verify_all, tasks=lambda ctx: Splits(
        [Task("t0", ctx.name, Answer("1"), prompt="code: 1 plus 1")], []))


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("entry, message", [
    ({"env": "no_such_pkg.envs:make"},
     r"tasks.envs\[0\].env='no_such_pkg.envs:make': module 'no_such_pkg.envs' does not import"),
    ({"env": "examples.sql_env"}, r"name an environment as 'module:function'"),
    ({"env": "examples.sql_env:nothing"}, r"module 'examples.sql_env' has no 'nothing'"),
    ({"env": "tests.test_envs:not_an_environment"},
     r"tests.test_envs:not_an_environment gave dict, not a ptrain.envs.Environment"),
    ({"env": "ptrain.envs.verdict:WEIGHT_TOLERANCE"}, r"gave float, not a ptrain.envs"),
    ({"env": SQL, "args": {"n_rows": 3}}, r"examples.sql_env:make\(\*\*\{'n_rows': 3\}\) "
                                          r"failed: .*unexpected keyword argument 'n_rows'"),
    ({"env": SQL, "wieght": 2.0}, r"an environment entry has keys \('env', 'args', 'weight', "
                                  r"'name', 'agent'\).*got \['env', 'wieght'\]"),
    ({"env": "tests.test_envs:bad_tool"},
     r"environment 'bad'\): tool 'query': its parameters .* has no \"type\": \"object\"; give "
     r"a JSON-schema object"),
])
def test_a_bad_environment_entry_is_an_error_naming_what_to_fix(entry, message):
    with pytest.raises(ValueError, match=message):
        envs.load_all([entry])


def test_two_environments_with_one_name_and_bad_weights():
    code = {"env": "ptrain.envs.code:generated"}
    with pytest.raises(ValueError, match=r"tasks.envs\[0\] and tasks.envs\[1\] are both named "
                                         r"'code': give one of them another name"):
        envs.load_all([code, code])
    assert [e.name for e in envs.load_all([code, {**code, "name": "code2"}])] == ["code",
                                                                              "code2"]
    with pytest.raises(ValueError, match=r"tasks.envs\[0\].weight=0 must be a number > 0"):
        envs.load_all([{**code, "weight": 0}])
    with pytest.raises(ValueError, match=r"tasks.envs is empty"):
        envs.load_all([])
    # through the config checker, before anything runs
    config = closed_loop.defaults()
    config.tasks.envs = (code, code)
    with pytest.raises(ValueError, match="both named 'code'"):
        closed_loop.check_config(config)


def test_a_config_entry_names_an_agent_program_for_its_environment():
    code = {"env": "ptrain.envs.code:generated"}
    env, = envs.load_all([{**code, "agent": {"command": ["python", "agent.py"], "backend": None,
                                             "timeout_s": 30, "env": {"STEPS": "2"}}}])
    assert env.agent == rollout.Agent(command=("python", "agent.py"), backend=None,
                                      timeout_s=30, env={"STEPS": "2"})
    assert env.name == "code" and envs.load_all([code])[0].agent is None
    for bad, message in (({"commmand": ["python"]}, "an agent is a dict with keys"),
                         ({"command": "python agent.py"}, "Agent.command=.* give the program's argv"),
                         ({"command": ["python"], "timeout_s": 0}, "Agent: timeout_s must be > 0")):
        with pytest.raises(ValueError, match=r"tasks.envs\[0\].agent: " + message):
            envs.load_all([{**code, "agent": bad}])
    # the closed loop serves no policy to agent programs: refused before anything runs
    config = closed_loop.defaults()
    config.tasks.envs = ({**code, "agent": {"command": ("python", "agent.py")}},)
    with pytest.raises(ValueError, match=r"environments \['code'\] are agent-driven"):
        closed_loop.check_config(config)


def test_tool_schemas_must_be_json_schema_objects():
    ok = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    envs_base.check_tool(Tool("q", "", ok, _run), where="here")
    for schema, problem in [("{}", "is not a dict"), ({"type": "array"}, "no \"type\": "),
                            ({"type": "object", "properties": {"q": "string"}},
                             "properties\" that is not a dict of schemas"),
                            ({"type": "object", "properties": {}, "required": ["q"]},
                             "\"required\" names that are not properties")]:
        with pytest.raises(ValueError, match=problem):
            envs_base.check_tool(Tool("q", "", schema, _run), where="here")
    with pytest.raises(ValueError, match="tool name 'run query' must be an identifier"):
        envs_base.check_tool(Tool("run query", "", ok, _run), where="here")


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf, "1.0", None, True])
def test_a_verifier_returning_a_reward_that_is_not_a_finite_number_is_refused(reward):
    env = Environment(name="odd", tasks=lambda ctx: Splits((), ()),
                      verify=lambda tasks, answers, **k: [Verdict(reward, False, 0.0, "")])
    with pytest.raises(ValueError, match=r"environment 'odd': its verifier returned reward .*; "
                                         r"a reward must be a finite number"):
        rollout.episodes.judge(env, ["t"], ["a"])


def test_a_verifier_returning_no_verdict_or_too_few():
    env = Environment(name="odd", tasks=lambda ctx: Splits((), ()),
                      verify=lambda tasks, answers, **k: [1.0])
    with pytest.raises(TypeError, match=r"environment 'odd': its verifier returned float"):
        rollout.episodes.judge(env, ["t"], ["a"])
    env = Environment(name="odd", tasks=lambda ctx: Splits((), ()),
                      verify=lambda tasks, answers, **k: [])
    with pytest.raises(ValueError, match="returned 0 verdicts for 1 answers"):
        rollout.episodes.judge(env, ["t"], ["a"])


def test_a_rubric_is_the_weighted_sum_of_its_components_whose_weights_sum_to_one():
    v = envs.rubric({"builds": 1.0, "iou": 0.5}, {"builds": 0.25, "iou": 0.75}, passed=False,
                    feedback="IoU 0.5", error_type="low_iou")
    assert v.reward == pytest.approx(0.25 * 1.0 + 0.75 * 0.5)
    assert v.to_dict()["components"] == {"builds": 1.0, "iou": 0.5}
    assert "artefacts" not in v.to_dict() and v.error_type == "low_iou"
    with pytest.raises(ValueError, match=r"weights .* sum to 1.1; they must sum to 1"):
        envs.rubric({"a": 1.0, "b": 1.0}, {"a": 0.5, "b": 0.6}, passed=True, feedback="")
    with pytest.raises(ValueError, match="must name the same parts"):
        envs.rubric({"a": 1.0}, {"b": 1.0}, passed=True, feedback="")
    made_by_hand = Verdict(1.0, True, 1.0, "", components={"a": 1.0}, weights={"a": 2.0})
    with pytest.raises(ValueError, match=r"environment 'cad': rubric: weights .* sum to 2"):
        verdict_lib.check(made_by_hand, env="cad")


def test_an_empty_held_out_split_is_an_error_when_evaluation_is_on(tmp_path):
    from ptrain.envs import synthetic
    config = closed_loop.defaults()
    config.tasks.envs = ({"env": "tests.test_envs:no_heldout"},)
    found = closed_loop.environments(config)
    tok = synthetic.WordTokenizer.for_tasks()
    with pytest.raises(ValueError, match=r"environment 'noheld': its held-out split is empty "
                                         r"and evaluation is on \(eval.n=100\)"):
        closed_loop.make_tasks(config, found, tok, str(tmp_path))
    config.eval.n = 0  # evaluation off: nothing to hold out
    train, heldout, _ = closed_loop.make_tasks(config, found, tok, str(tmp_path))
    assert len(train["noheld"]) == 1 and heldout["noheld"] == []


def test_an_environment_without_retries_refuses_max_attempts():
    config = closed_loop.defaults()
    config.tasks.envs = ({"env": "ptrain.envs.terminal:make"},)
    config.rollout.max_attempts = 2
    with pytest.raises(ValueError, match=r"environments \['terminal'\] have no retries"):
        closed_loop.check_config(config)
    assert TurnPolicy().retries


# ----------------------------------------------------------------------------- the SQL example

@pytest.fixture(scope="module")
def sql():
    env = envs.load({"env": SQL, "args": {"n_train": 12, "n_heldout": 4, "tools": True}})
    splits = env.tasks(envs.Context(name="sql", seed=0, workdir=""))
    return env, splits


def test_sql_verdicts_of_right_and_wrong_queries(sql):
    env, splits = sql
    task = next(t for t in splits.train if "people who live in" in t.prompt)
    city = task.prompt.split()[-1]
    right = f"```sql\nSELECT name FROM people WHERE city = '{city}'\n```"
    everyone = "SELECT name FROM people"
    got = rollout.episodes.judge(env, [task] * 4, [right, everyone, "SELEC name", "SELECT 1, 2"],
                             sessions=[None] * 4, pool=None, config=CFG)
    assert [v.passed for v in got] == [True, False, False, False]
    assert [v.reward for v in got] == [1.0, 0.0, 0.0, 0.0]
    want = [list(r) for r in task.verifier.rows]
    extra = next(r for r in (["ann"], ["bob"], ["cid"], ["dee"]) if r not in want)
    assert got[1].error_type == "wrong_rows" and got[1].feedback.startswith(
        f"8 rows, expected {len(want)}; first wrong row: ")
    assert "first wrong row: " + str(extra) in got[1].feedback or want == []
    assert got[2].error_type == "sql_error" and got[2].feedback == \
        'SQL error: OperationalError: near "SELEC": syntax error'
    assert got[3].feedback.startswith("1 rows, expected")
    # the reference's rows are the database's (sqlite3 here, on the task's own db.sql)
    import sqlite3
    db = sqlite3.connect(":memory:")
    db.executescript(task.files["db.sql"])
    assert task.verifier.rows == tuple(db.execute(task.metadata["reference"]).fetchall())


def test_sql_tool_in_an_episode_and_rewards_in_the_batch(sql):
    """A scripted model explores with the `sql` tool (the call runs in the episode's sandbox
    session, on its own database), then answers: the reference query on one task, a wrong
    one on the other; the batch carries their rewards and feedback."""
    from examples import sql_env
    from tests.test_rollout import ScriptedSampler
    env, splits = sql
    tok = sql_env.tokenizer()
    picked = splits.train[:2]
    answers = {picked[0].prompt: picked[0].metadata["reference"],
               picked[1].prompt: "SELECT id FROM orders"}
    call = chat.format_turn(chat.PLAIN, calls=[chat.ToolCall(
        "sql", {"query": "SELECT COUNT(*) FROM people"})])

    def script(history):
        prompt = next(p for p in answers if history.startswith(p))
        return call if "<tool_response>" not in history else answers[prompt]
    config = closed_loop.defaults()
    config.update_from_flattened_dict({"sandbox.backend": "process", "sampling.num_samples": 1,
                                       "sampling.max_new_tokens": 64, "rollout.max_len": 400,
                                       "data.max_prompt_len": 32})
    producer = rollout.Tasks(ScriptedSampler(script, tok), tok, config, None, envs={"sql": env})
    batch = producer.score(producer.generate(None, picked, jax.random.key(0)))
    assert batch.rewards_b.tolist() == [1.0, 0.0]
    assert [m["passed"] for m in batch.meta] == [True, False]
    assert [m["domain"] for m in batch.meta] == ["sql", "sql"]
    assert [m["tool_calls"] for m in batch.meta] == [1, 1]
    assert batch.meta[1]["error_type"] == "wrong_rows"
    assert "\n8\n" in batch.meta[0]["completion"]  # the tool's answer: 8 people
