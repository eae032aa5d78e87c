"""The OpenAI-compatible endpoint (ptrain/serve/) driven by the `openai` client on loopback: what
it records equals the engine's own sampling of the same prompt (and, for a multi-turn
episode, the tokenizer's chat template of the whole conversation), a continuation reuses
the episode's cache, a rewritten history is recorded and handled per episode, bad input is
refused, and the recorded episodes become the rollout batch builder's rows.

The model is the tiny Qwen2.5 fixture (tests/hf_fixtures.py: its real chat template), trained
here for a few seconds to answer one prompt with one tool call, so that a turn with a call
comes from the engine's sampling, not from a stub."""

import copy
import dataclasses
import json
import os
import sys
import threading

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="pip install '.[test]'")
pytest.importorskip("transformers", reason="pip install '.[test]'")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from ptrain import chat, hf, rewards, rollout, serve, tasks  # noqa: E402
from logp_reference import dense_logp  # noqa: E402
from ptrain.generate.engine import Engine, Request  # noqa: E402

# One worker: the module's fixture (a model trained for the call, an engine) is built once.
pytestmark = pytest.mark.xdist_group("serve")

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
CALL = chat.ToolCall("add", {"a": 2, "b": 3})
SEED, TEXT_SEED = 5, 9
TEXT = "def add(a, b):\n"


def _template(tok, messages, tools=TOOLS):
    """The tokenizer's own rendering of a conversation (the reference for every prompt)."""
    whole = copy.deepcopy(list(messages))
    for m in whole:
        for call in m.get("tool_calls", ()):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return chat.encode(tok, tok.apply_chat_template(whole, tools=tools, tokenize=False,
                                                    add_generation_prompt=True))


def _memorise(model, prompt, target, steps=120):
    """Trains the model's parameters to answer `prompt` with `target` (teacher forcing)."""
    graphdef, params = nnx.split(model)
    seq = jnp.asarray([prompt + target], jnp.int32)

    def loss(p):
        logits = nnx.merge(graphdef, p)(seq[:, :-1]).astype(jnp.float32)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), seq[:, 1:, None], -1)[..., 0]
        return nll[:, len(prompt) - 1:].mean()

    tx = optax.adam(1e-2)

    @jax.jit
    def step(p, o):
        value, g = jax.value_and_grad(loss)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, value

    opt = tx.init(params)
    for _ in range(steps):
        params, opt, value = step(params, opt)
    return params


class _Served:
    pass


@pytest.fixture(scope="module")
def served(hf_dir):
    s = _Served()
    s.path = path = hf_dir("qwen2.5-instruct")
    s.tok = tok = hf.load_tokenizer(path)
    s.model = model = hf.load(path)[0]
    s.prompt = _template(tok, QUESTION)
    eot = chat.end_of_turn_ids(chat.QWEN, tok)[0]
    s.params = params = _memorise(model, s.prompt,
                                  chat.encode(tok, chat.format_turn(chat.QWEN, calls=[CALL]))
                                  + [eot])
    stop = chat.stop_ids(chat.QWEN, tok, eos_sources=hf.eos_token_ids(path))
    s.engine = engine = Engine(model, slots=2, max_len=512, max_new_tokens=32,
                               token_buckets=(64, 512), prefill_rows=1, stop_token_ids=stop)

    # The engine's own sampling, before the server holds it: a two-turn episode whose
    # observation is the template's rendering of the tool's result, and a text completion.
    s.call_message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "type": "function",
         "function": {"name": "add", "arguments": json.dumps(CALL.arguments)}}]}
    s.result = {"role": "tool", "tool_call_id": "c0", "content": "5"}

    def on_turn(traj):
        if len(traj.turns) > 1:
            return None
        s.whole = _template(tok, QUESTION + [s.call_message, s.result])
        return s.whole[len(traj.tokens):]

    s.ref_chat, = engine.generate(params, [Request(s.prompt, key=SEED, on_turn=on_turn)])
    s.ref_text, = engine.generate(params, [Request(chat.encode(tok, TEXT), key=TEXT_SEED,
                                                   max_new_tokens=16)])
    assert chat.parse_tool_calls(chat.QWEN, chat.turn_text(tok, s.ref_chat.turns[0], stop)) \
        == [CALL], "the memorised model should answer with the call"

    s.service = serve.Service(engine, params, tok, serve.ServeConfig(
        max_request_bytes=64 << 10, max_messages=16, load_weights=True))
    s.server = serve.make_server(s.service)
    thread = threading.Thread(target=s.server.serve_forever, daemon=True)
    thread.start()
    s.url = f"http://127.0.0.1:{s.server.server_address[1]}"
    yield s
    s.server.shutdown()
    s.server.server_close()
    s.service.close()
    thread.join()


def _client(s, episode=None, token=None, **kw):
    base = f"{s.url}/episodes/{episode}/v1" if episode else f"{s.url}/v1"
    return openai.OpenAI(base_url=base, api_key=token or s.server.token, max_retries=0, **kw)


def _episode(s, **kw):
    return s.service.open_episode(kw)["id"]


def _ask(client):
    """The episode's first turn: the question, with the tools (the memorised call)."""
    return client.chat.completions.create(model="ptrain", messages=QUESTION, tools=TOOLS,
                                          seed=SEED)


def _answer_call(s, client, r):
    """The next turn: the model's message echoed back by the client, the tool's result."""
    return client.chat.completions.create(
        model="ptrain", tools=TOOLS,
        messages=QUESTION + [r.choices[0].message.model_dump(exclude_none=True), s.result])


def test_chat_turn_with_a_tool_call_is_the_engines_sampling_and_recorded_token_for_token(served):
    s = served
    eid = _episode(s)
    r = _client(s, eid).chat.completions.create(model="ptrain", messages=QUESTION, tools=TOOLS,
                                                seed=SEED, logprobs=True)
    choice, ref = r.choices[0], s.ref_chat
    first = ref.turns[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (CALL.name,
                                                                         CALL.arguments)
    assert choice.model_extra["token_ids"] == first
    assert r.model_extra["prompt_token_ids"] == s.prompt
    n = len(s.prompt)
    np.testing.assert_allclose([t.logprob for t in choice.logprobs.content],
                               ref.logp_temp[n:n + len(first)], atol=1e-5)
    seg = s.service.episode(eid).segments[0]
    assert seg.tokens == ref.tokens[:n + len(first)]
    assert seg.mask == [0] * n + [1] * len(first)
    assert seg.versions == [-1] * n + [0] * len(first)
    np.testing.assert_allclose(seg.logp, ref.logp_temp[:n + len(first)], atol=1e-5)


def test_a_continuation_prefills_only_the_new_messages_and_samples_as_the_engine(served):
    s = served
    eid = _episode(s)
    client = _client(s, eid)
    r = _ask(client)
    before = s.engine.tallies["prefill_tokens"]
    r2 = _answer_call(s, client, r)  # the client's own echo of the model's message
    ref = s.ref_chat
    held = len(s.prompt) + len(ref.turns[0])
    delta = s.whole[held:]
    assert r2.model_extra["prompt_token_ids"] == delta
    assert s.engine.tallies["prefill_tokens"] - before == len(delta)  # not the history
    assert r2.choices[0].model_extra["token_ids"] == ref.turns[1]
    seg, = s.service.episode(eid).segments
    assert seg.tokens == ref.tokens  # the template's conversation + the engine's 2nd turn
    assert seg.tokens[:len(s.whole)] == s.whole
    assert seg.mask == ref.mask
    np.testing.assert_allclose(seg.logp, ref.logp_temp, atol=1e-5)


def test_streamed_chat_and_completion_carry_the_same_turn(served):
    s = served
    stream = _client(s, _episode(s)).chat.completions.create(
        model="ptrain", messages=QUESTION, tools=TOOLS, seed=SEED, stream=True,
        stream_options={"include_usage": True})
    calls, finish, usage = {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for call in c.delta.tool_calls or ():
                calls.setdefault(call.index, [call.function.name, ""])
                calls[call.index][1] += call.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in calls.values()] == [(CALL.name, CALL.arguments)]
    assert finish == "tool_calls"
    assert usage.completion_tokens == len(s.ref_chat.turns[0])
    text = "".join(c.choices[0].text for c in _client(s).completions.create(
        model="ptrain", prompt=TEXT, max_tokens=16, seed=TEXT_SEED, stream=True,
        extra_headers={"X-Episode-Id": _episode(s)}) if c.choices)
    assert text == chat.verifier_text(s.tok, s.ref_text.turns[0],
                                      s.engine.settings.stop_token_ids)


def test_text_completion_is_the_engines_and_a_longer_prompt_continues_its_cache(served):
    s = served
    eid = _episode(s)
    client = _client(s, eid)
    r = client.completions.create(model="ptrain", prompt=TEXT, max_tokens=16, seed=TEXT_SEED,
                                  logprobs=0)
    ref = s.ref_text
    n = ref.prompt_len
    assert r.choices[0].model_extra["token_ids"] == ref.turns[0]
    np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs, ref.logp_temp[n:],
                               atol=1e-5)
    before = s.engine.tallies["prefill_tokens"]
    more = "\n    return"
    r2 = client.completions.create(model="ptrain", prompt=TEXT + r.choices[0].text + more,
                                   max_tokens=4)
    assert r2.model_extra["prompt_token_ids"] == chat.encode(s.tok, more)
    assert s.engine.tallies["prefill_tokens"] - before == len(chat.encode(s.tok, more))
    seg, = s.service.episode(eid).segments
    assert seg.tokens == ref.tokens + chat.encode(s.tok, more) \
        + r2.choices[0].model_extra["token_ids"]
    # token ids in: the prompt is taken as it is
    ids = seg.tokens + chat.encode(s.tok, " a")
    r3 = client.completions.create(model="ptrain", prompt=ids, max_tokens=2)
    assert r3.model_extra["prompt_token_ids"] == chat.encode(s.tok, " a")
    assert s.service.episode(eid).segments[0].tokens[:len(ids)] == ids


def test_a_rewritten_history_is_recorded_and_reprefilled_or_dropped(served):
    s = served
    eid = _episode(s)
    client = _client(s, eid)
    _ask(client)
    rewritten = dict(s.call_message, content="Let me add them.")
    messages = QUESTION + [rewritten, s.result]
    client.chat.completions.create(model="ptrain", messages=messages, tools=TOOLS)
    episode = s.service.episode(eid)
    assert [(m["at"], m["policy"]) for m in episode.mismatches] == [(1, "reprefill")]
    first, second = serve.training_segments(episode)
    assert first.tokens == s.ref_chat.tokens[:len(first.tokens)]
    # the new segment starts from the template's rendering of the rewritten history, none of
    # which is trained on (the model did not sample "Let me add them.")
    prompt = _template(s.tok, messages)
    assert second.tokens[:second.prompt_len] == prompt
    assert second.prompt_len == len(prompt) and not any(second.mask[:len(prompt)])
    assert sum(second.mask) == len(second.tokens) - len(prompt)

    drop = _client(s, _episode(s, on_rewrite="drop"))
    _ask(drop)
    with pytest.raises(openai.ConflictError, match="drops episodes"):
        drop.chat.completions.create(model="ptrain", messages=messages, tools=TOOLS)
    with pytest.raises(openai.ConflictError, match="was dropped"):
        drop.chat.completions.create(model="ptrain", messages=QUESTION, tools=TOOLS)
    dropped = s.service.episode(drop.base_url.path.split("/")[2])
    assert dropped.dropped and len(dropped.mismatches) == 1
    assert serve.training_segments(dropped) == []


def _agent(client, messages, tools, max_turns=3):
    """A scripted OpenAI-client agent: calls the model, runs its `add` calls, sends the
    results back, until the model answers without a call. Returns (answer, messages)."""
    messages = list(messages)
    for turn in range(max_turns):
        m = client.chat.completions.create(model="ptrain", messages=messages, tools=tools,
                                           seed=SEED).choices[0].message
        messages.append(m.model_dump(exclude_none=True))
        if not m.tool_calls:
            return m.content, messages
        for call in m.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(args["a"] + args["b"])})
    return None, messages


def test_an_agent_episode_end_to_end_becomes_the_rollout_batch(served):
    s = served
    eid = _episode(s, metadata={"task": "add"})
    answer, messages = _agent(_client(s, eid), QUESTION, TOOLS, max_turns=2)
    assert messages[2]["content"] == "5"  # the agent ran the model's call
    assert s.service.close_episode(eid)["closed"]
    [closed] = s.service.take_closed()
    assert closed.id == eid and eid not in s.service.episodes
    task = tasks.Task(id="add", domain="math", verifier=tasks.Answer("5"), messages=QUESTION)
    [episode] = serve.training_episodes(closed, task, group_id=3)
    episode.answers.append(answer or "")
    episode.verdicts.append(rewards.check_answer(task.verifier, answer or ""))
    batch = rollout.to_batch([episode], rollout.RolloutConfig(), prompt_len=512, length=128)
    ref, n = s.ref_chat, len(s.prompt)  # the engine's own two-turn episode
    rest = len(ref.tokens) - n
    assert batch.prompt_lens_b.tolist() == [n] and batch.group_ids_b.tolist() == [3]
    assert batch.tokens_bn[0, :rest].tolist() == ref.tokens[n:]
    assert batch.loss_mask_bn[0, :rest].tolist() == ref.mask[n:]
    np.testing.assert_allclose(batch.rollout_logp_bn[0, :rest], ref.logp_temp[n:], atol=1e-5)
    assert batch.versions_bn[0, :rest].tolist() == [0 if m else -1 for m in ref.mask[n:]]
    assert batch.rewards_b.tolist() == [episode.verdicts[0].reward]


def test_bad_requests_get_clear_http_errors_and_touch_no_other_episode(served):
    s = served
    eid = _episode(s, max_len=310)  # the prompt is 300 tokens
    with pytest.raises(openai.AuthenticationError, match="Bearer"):
        _client(s, eid, token="not-the-servers-token").chat.completions.create(
            model="ptrain", messages=QUESTION)
    with pytest.raises(openai.NotFoundError, match="unknown episode"):
        _client(s, "nobody").chat.completions.create(model="ptrain", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="belongs to an episode"):
        _client(s).chat.completions.create(model="ptrain", messages=QUESTION)
    client = _client(s, eid)
    bad_tool = [{"type": "function", "function": {"name": "add me", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError, match="name"):
        client.chat.completions.create(model="ptrain", messages=QUESTION, tools=bad_tool)
    with pytest.raises(openai.BadRequestError, match="budget"):
        client.chat.completions.create(model="ptrain", messages=QUESTION, tools=TOOLS,
                                       max_tokens=20)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="ptrain", messages=QUESTION, temperature=0.2)
    with pytest.raises(openai.APIStatusError, match="limit") as big:
        client.chat.completions.create(model="ptrain",
                                       messages=[{"role": "user", "content": "x" * (70 << 10)}])
    assert big.value.status_code == 413
    with pytest.raises(openai.APIStatusError, match="messages") as many:
        client.chat.completions.create(model="ptrain", messages=QUESTION * 17)
    assert many.value.status_code == 413
    episode = s.service.episode(eid)
    assert episode.segments == [] and episode.mismatches == []


def test_an_evicted_episode_is_prefilled_again_and_its_record_goes_on(served):
    s = served
    first = _episode(s)
    client = _client(s, first)
    r = _ask(client)
    for _ in range(s.engine.slots):  # newer episodes take the slots; the oldest idle goes
        _client(s, _episode(s)).completions.create(model="ptrain", prompt=TEXT, max_tokens=2)
    held = list(s.service.episode(first).segments[0].tokens)
    before = s.engine.tallies["prefill_tokens"]
    r2 = _answer_call(s, client, r)
    episode = s.service.episode(first)
    seg, = episode.segments
    delta = r2.model_extra["prompt_token_ids"]
    assert episode.reprefills == 1 and s.service.runner.evictions >= 1
    assert seg.tokens[:len(held)] == held and delta == s.whole[len(held):]
    assert s.engine.tallies["prefill_tokens"] - before == len(held) + len(delta)
    assert seg.tokens[len(held) + len(delta):] == r2.choices[0].model_extra["token_ids"]
    assert seg.mask == [0] * len(s.prompt) + [1] * (len(held) - len(s.prompt)) \
        + [0] * len(delta) + [1] * len(r2.choices[0].model_extra["token_ids"])


def test_published_weights_sample_the_next_turn_with_their_version(served):
    """(Late: the server's policy version is 1 after it.)"""
    s = served
    eid = _episode(s)
    client = _client(s, eid)
    r = _ask(client)
    assert r.model_extra["policy_version"] == 0
    s.service.runner.publish(1, s.params)
    r2 = _answer_call(s, client, r)
    assert r2.model_extra["policy_version"] == 1
    seg, = s.service.episode(eid).segments
    n1 = len(s.prompt) + len(r.choices[0].model_extra["token_ids"])
    second = r2.choices[0].model_extra["token_ids"]
    assert seg.versions[len(s.prompt):n1] == [0] * (n1 - len(s.prompt))
    assert seg.versions[-len(second):] == [1] * len(second)
    # same weights, recomputed cache: the engine's own second turn, token for token
    assert second == s.ref_chat.turns[1]


def _add_env(name, verify, backend):
    """An agent-driven environment: tests/agents/openai_agent.py (the `openai` client, the
    `add` tool, several turns) against the served policy."""
    from ptrain import envs
    from ptrain.envs.base import Environment, Splits, Tool

    add = Tool("add", TOOLS[0]["function"]["description"], TOOLS[0]["function"]["parameters"],
               run=lambda session, args, timeout_s: None)  # (the agent program runs it)
    program = os.path.join(os.path.dirname(__file__), "agents", "openai_agent.py")
    agent = rollout.Agent(command=(sys.executable, program), backend=backend, timeout_s=120,
                          env={"AGENT_SEED": str(SEED), "AGENT_MAX_TURNS": "2"})
    env = Environment(name=name, tasks=lambda ctx: Splits((), ()), verify=verify, tools=(add,),
                      agent=agent)
    envs.base.check(env, key=name)
    return env, tasks.Task(id=f"{name}-1", domain=name, verifier=tasks.Answer("5"),
                           messages=QUESTION, tools=("add",))


def test_agent_driven_environments_give_the_rl_batch_of_the_recorded_tokens(served):
    """Two agent-driven environments, their episodes run by an external program that uses the
    `openai` client: one in a sandbox box, judged on the file it left in its work dir, one a
    host subprocess, judged on its printed answer. The batch's tokens are the engine's own
    sampling of the same conversation, its rewards the verifiers'."""
    from ptrain import closed_loop
    s = served

    def judge_state(task_list, answers, *, sessions, pool, config):
        out = [sess.run(command=["cat", "result.txt"]) for sess in sessions]
        return [rewards.check_answer(t.verifier, r.stdout.decode()) for t, r in
                zip(task_list, out)]

    def judge_answer(task_list, answers, *, sessions, pool, config):
        return [rewards.check_answer(t.verifier, a) for t, a in zip(task_list, answers)]

    # (the "process" box: bwrap's sandbox user cannot read this interpreter under /root)
    boxed, boxed_task = _add_env("add_boxed", judge_state, "process")
    host, host_task = _add_env("add_host", judge_answer, None)
    config = closed_loop.defaults()
    config.update_from_flattened_dict({"sampling.num_samples": 1, "rollout.max_len": 256,
                                       "data.max_prompt_len": 512})
    producer = rollout.Agents(s.server, s.tok, config, {"add_boxed": boxed, "add_host": host})
    version, others = s.service.runner.version + 1, set(s.service.episodes)
    episodes = producer.generate(s.params, [boxed_task, host_task], jax.random.key(0))
    batch = producer.score(episodes)

    assert [e.group_id for e in episodes] == [0, 1]
    assert set(s.service.episodes) == others  # its episodes were closed and taken
    ref, n = s.ref_chat, len(s.prompt)  # the engine's own two-turn episode (same seed)
    rest = len(ref.tokens) - n
    for row, e in enumerate(episodes):
        assert e.tokens == ref.tokens and batch.prompt_lens_b[row] == n
        assert batch.tokens_bn[row, :rest].tolist() == ref.tokens[n:]
        assert batch.loss_mask_bn[row, :rest].tolist() == ref.mask[n:]
        np.testing.assert_allclose(batch.rollout_logp_bn[row, :rest], ref.logp_temp[n:],
                                   atol=1e-5)
        assert batch.versions_bn[row, :rest].tolist() == \
            [version if m else -1 for m in ref.mask[n:]]
        # the answer is the model's last turn as the agent printed it
        last = ref.turns[-1]
        assert e.answers == [chat.turn_text(s.tok, last, s.engine.settings.stop_token_ids)
                             .strip()]
    # the boxed agent ran the model's call (add(2, 3)) and left 5 in its work dir
    assert episodes[0].verdicts[0].passed and batch.rewards_b[0] == 1.0
    assert batch.rewards_b[1] == rewards.check_answer(tasks.Answer("5"),
                                                      episodes[1].answers[0]).reward


def test_an_external_engine_samples_the_synced_weights_with_its_token_ids_and_logprobs(
        served, tmp_path):
    """ptrain's own endpoint as the "external" engine (`serve.ExternalSampler`, server
    "ptrain"): each sync exports the learner's weights (hf.save) and the engine loads them
    (POST /update_weights_from_disk); the rows are the ids and log-probs the engine recorded,
    and they match the synced weights' dense log-probs (the train/engine mismatch the
    truncated IS corrects is ~0), not the other weights'."""
    from ptrain import losses
    s = served
    st = s.engine.settings
    sampler = serve.ExternalSampler(s.model, serve.ExternalConfig(
        base_url=s.url, token=s.server.token, server="ptrain", sync_dir=str(tmp_path)),
        tokenizer=s.tok)
    untrained = nnx.split(hf.load(s.path)[0])[1]
    prompt = chat.encode(s.tok, TEXT)
    kw = dict(max_new_tokens=12, num_samples=2, temperature=st.temperature, top_k=st.top_k,
              top_p=st.top_p, key=jax.random.key(1))
    try:
        for params, other in ((untrained, s.params), (s.params, untrained)):
            before = s.service.runner.version
            out = sampler.sample(params, [prompt], **kw)
            assert s.service.runner.version == before + 1  # the export was loaded
            assert os.path.isfile(os.path.join(tmp_path, f"v{sampler.version}", "config.json"))
            recorded = s.service.take_closed()
            assert len(recorded) == 2 and out.prompt_index.tolist() == [0, 0]
            for r in range(2):  # (the rows' requests ran concurrently: matched by tokens)
                n = int(out.lengths[r])
                seg, = next(e.segments for e in recorded
                            if e.segments[0].tokens == prompt + out.tokens[r, :n].tolist())
                np.testing.assert_allclose(seg.logp[len(prompt):], out.logp_temp[r, :n])
                assert seg.versions[len(prompt):] == [before + 1] * n
                ids = out.tokens[r, :n]
                mine = dense_logp(s.model, params, prompt, ids, st.temperature)
                theirs = dense_logp(s.model, other, prompt, ids, st.temperature)
                mask = jnp.ones((1, n))
                weights = losses.truncated_is_weights(jnp.asarray(mine)[None],
                                                      jnp.asarray(out.logp_temp[r, :n])[None],
                                                      mask)
                np.testing.assert_allclose(out.logp_temp[r, :n], mine, atol=2e-3)
                np.testing.assert_allclose(np.asarray(weights), 1.0, atol=5e-3)
                assert np.abs(theirs - mine).mean() > 0.05  # (the sync changed the engine)
    finally:
        s.service.runner.publish(s.service.runner.version + 1, s.params)


MINI_PYTHON = os.environ.get("PTRAIN_MINI_SWE_AGENT_PYTHON", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "mini-venv", "bin",
    "python"))


def test_mini_swe_agent_runs_an_agent_driven_episode_offline(served):
    """A third-party harness from PyPI (mini-swe-agent 2.4.6, its own virtualenv: `python -m
    venv .cache/mini-venv && .cache/mini-venv/bin/pip install mini-swe-agent==2.4.6`, or
    $PTRAIN_MINI_SWE_AGENT_PYTHON) as an agent-driven environment's program, offline against
    the endpoint: whatever it did to its history, every row is tokens the engine sampled
    (mask 1 exactly where the record says the model sampled), judged by the verifier."""
    import subprocess
    from ptrain import closed_loop
    s = served
    if not os.path.exists(MINI_PYTHON) or subprocess.run(
            [MINI_PYTHON, "-c", "import minisweagent"], capture_output=True).returncode:
        pytest.skip(f"mini-swe-agent is not installed at {MINI_PYTHON} (see the docstring)")

    def judge_answer(task_list, answers, *, sessions, pool, config):
        return [rewards.check_answer(t.verifier, a) for t, a in zip(task_list, answers)]

    env, task = _add_env("mini", judge_answer, None)
    program = os.path.join(os.path.dirname(__file__), "agents", "mini_swe_agent.py")
    env = dataclasses.replace(env, tools=(), agent=rollout.Agent(
        command=(MINI_PYTHON, program), backend=None, timeout_s=300, env={"STEPS": "2"}))
    task = dataclasses.replace(task, tools=(), messages=(),
                               prompt="Print the sum of 2 and 3 with bash.")
    config = closed_loop.defaults()
    config.update_from_flattened_dict({"sampling.num_samples": 1, "rollout.max_len": 512,
                                       "data.max_prompt_len": 512})
    producer = rollout.Agents(s.server, s.tok, config, {"mini": env})
    episodes = producer.generate(None, [task], jax.random.key(0))
    batch = producer.score(episodes)
    assert episodes, "mini-swe-agent's requests were not recorded"
    for row, e in enumerate(episodes):  # one row per segment (a rewrite starts a new one)
        n = len(e.tokens) - e.prompt_len
        assert batch.tokens_bn[row, :n].tolist() == e.tokens[e.prompt_len:]
        assert batch.loss_mask_bn[row, :n].tolist() == e.mask[e.prompt_len:] and any(e.mask)
        sampled = [lp for lp, m in zip(e.logp, e.mask) if m]
        assert all(lp <= 0 for lp in sampled) and all(v >= 0 for v, m in
                                                      zip(e.versions, e.mask) if m)
    # (the untrained model calls no tool: a format error, whose retry rewrites the history)
    assert all(e.answers == [""] for e in episodes)  # its submission: nothing submitted
    assert batch.rewards_b.tolist() == [
        rewards.check_answer(task.verifier, episodes[0].answers[0]).reward] * len(episodes)


def test_agents_and_external_engines_refuse_bad_input_before_work(served, tmp_path):
    from ptrain import closed_loop
    s = served
    for bad in ("python agent.py", (), ("python", "")):
        with pytest.raises(ValueError, match="give the program's argv"):
            rollout.Agent(command=bad)
    with pytest.raises(ValueError, match="server='sglang'"):
        serve.ExternalConfig(base_url="http://127.0.0.1:1", server="sglang")
    with pytest.raises(ValueError, match="give http"):
        serve.ExternalConfig(base_url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="weight_sync='nccl'"):
        serve.ExternalConfig(base_url="http://127.0.0.1:1", weight_sync="nccl")
    # vLLM's in-place reload keeps a tied output head's old tensor (tests/test_vllm.py)
    with pytest.raises(ValueError, match="tied embeddings"):
        serve.ExternalSampler(s.model, serve.ExternalConfig(
            base_url="http://127.0.0.1:1", server="vllm", sync_dir=str(tmp_path)))
    with pytest.MonkeyPatch.context() as mp:  # (a learner on two processes)
        mp.setattr(jax, "process_count", lambda: 2)
        with pytest.raises(ValueError, match="runs on one process; this run has 2"):
            serve.ExternalSampler(s.model, serve.ExternalConfig(base_url=s.url))
    env, _ = _add_env("plain", lambda *a, **k: [], None)
    with pytest.raises(ValueError, match="has no agent program"):
        rollout.Agents(s.server, s.tok, closed_loop.defaults(),
                       {"plain": dataclasses.replace(env, agent=None)})
    sampler = serve.ExternalSampler(s.model, serve.ExternalConfig(
        base_url=s.url, token=s.server.token, server="ptrain", sync_dir=str(tmp_path)))
    version, others = s.service.runner.version, set(s.service.episodes)
    with pytest.raises(serve.EngineError, match="HTTP 400: .*model_path"):
        sampler._post("/update_weights_from_disk", {"model_path": str(tmp_path / "none")})
    with pytest.raises(ValueError, match="stop strings"):
        sampler.sample(None, [[1, 2]], max_new_tokens=4, stop_strings=("\n",))
    with pytest.raises(serve.EngineError, match="HTTP 404: .*VLLM_SERVER_DEV_MODE=1"):
        sampler._post("/collective_rpc", {"method": "reload_weights"})  # (a route it lacks)
    assert s.service.runner.version == version and set(s.service.episodes) == others
