"""Images through the RL episode path (`ptrain.rollout.images`): image prompts, tools that
return images, the learner batch's vision arrays; against transformers' Qwen2.5-VL processor
with Qwen3-VL-Instruct's chat template (tools and images in tool messages), and against the
learner's teacher-forced forward. A tiny random VL model built here (no download)."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

transformers = pytest.importorskip("transformers", reason="pip install '.[test]'")
pytest.importorskip("PIL.Image", reason="PIL reads and resizes images")

import hf_fixtures  # noqa: E402
from ptrain import chat, model as model_lib, rollout, step  # noqa: E402
from ptrain.envs import base as envs_base  # noqa: E402
from ptrain.envs.verdict import Verdict  # noqa: E402
from ptrain.generate.sampler import Sampler, Samples  # noqa: E402
from ptrain.rollout import images as images_lib  # noqa: E402
from ptrain.tasks import Task  # noqa: E402
from ptrain.vision import config as vision_config, image_processing as ip, vl  # noqa: E402
from sandbox.tools import Tool, ToolOutput  # noqa: E402

PROC = ip.ImageProcessing(max_pixels=28 * 28 * 12)  # a few merged tokens per image
G = 2


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tokenizer = hf_fixtures.save_tokenizer("qwen2.5-instruct",
                                           str(tmp_path_factory.mktemp("vl_tok")))
    tokenizer.chat_template = hf_fixtures.QWEN3_VL_TEMPLATE
    return tokenizer


def _vl_config(tokenizer) -> vl.VLConfig:
    ids = tokenizer.convert_tokens_to_ids
    text = model_lib.ModelConfig(vocab_size=len(tokenizer), d_model=64, n_layers=2, n_heads=4,
                                 n_kv_heads=2, d_ff=96, qkv_bias=True, mrope_section=(2, 3, 3),
                                 family="qwen2", attention_impl="reference")
    tower = vision_config.VisionConfig(depth=2, d_model=32, n_heads=2, d_ff=48, out_d=64,
                                       fullatt_blocks=(1,), window_size=56,
                                       attention_impl="reference")
    return vl.VLConfig(text, tower, image_token_id=ids("<|image_pad|>"),
                       video_token_id=ids("<|video_pad|>"),
                       vision_start_token_id=ids("<|vision_start|>"),
                       vision_end_token_id=ids("<|vision_end|>"))


def _image(seed, h, w):
    return np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)


RENDERS = [_image(1, 56, 84), _image(2, 84, 56)]  # what the tool returns, turn by turn


def _look(session, args, timeout_s):
    del session, timeout_s
    return ToolOutput(f"view {args['view']}", (RENDERS[args["view"]],))


LOOK = Tool("look", "Look at the part from one side.",
            {"type": "object", "properties": {"view": {"type": "integer"}},
             "required": ["view"], "additionalProperties": False}, _look, images=True)
ENV = envs_base.Environment(
    name="vis", tasks=lambda ctx: envs_base.Splits((), ()), tools=(LOOK,),
    opens_session=lambda task: False,
    verify=lambda tasks, answers, **kw: [Verdict(float(a == "3"), a == "3", float(a == "3"),
                                                 "The answer is a count.") for a in answers])
TASK = Task("v1", "vis", None, tools=("look",), messages=(
    {"role": "user", "content": [{"type": "image", "image": _image(0, 60, 90)},
                                 {"type": "text", "text": "How many holes? Look first."}]},))


def _calls(view):
    """A turn's text that calls `look`, as the template writes an assistant's tool call."""
    return chat.format_turn(chat.QWEN, calls=[chat.ToolCall("look", {"view": view})])


class Scripted:
    """A vision-language policy's sampler that answers each turn with `script[turn]` (an
    <|im_end|>-closed text), recording the images it was given."""

    def __init__(self, tokenizer, script, vl_config):
        self.tok, self.script, self.vl_config = tokenizer, script, vl_config
        self.images = []

    def sample(self, params, prompts, *, max_new_tokens, num_samples=1, images=None, **kw):
        self.images.append(images)
        turn = chat.encode(self.tok, self.script[len(self.images) - 1] + "<|im_end|>")
        rows = len(prompts) * num_samples
        tokens = np.zeros((rows, max_new_tokens), np.int32)
        tokens[:, :len(turn)] = turn
        logp = np.zeros(tokens.shape, np.float32)
        return Samples(tokens=tokens, logp=logp, logp_temp=logp, logp_t1=logp,
                       lengths=np.full(rows, len(turn), np.int32), finish_reasons=["stop"] * rows,
                       prompt_index=np.repeat(np.arange(len(prompts)), num_samples))


def test_history_with_image_prompt_and_image_observations_matches_the_processor(tok):
    """Token for token (placeholders expanded per merged patch) and pixel for pixel,
    the episode's history equals Qwen2_5_VLProcessor.apply_chat_template of the same
    conversation: an image prompt, two tool calls whose results carry text and an image."""
    c = _vl_config(tok)
    vision = images_lib.Vision(c, PROC, prompt_patches=64, observation_patches=128)
    sampler = Scripted(tok, [_calls(0), _calls(1), "3"], c)
    config = rollout.RolloutConfig(num_samples=G, max_new_tokens=48, max_turns=3, max_len=400)
    episodes = rollout.generate(sampler, None, [TASK], tokenizer=tok, key=jax.random.key(0),
                                config=config, fmt=chat.QWEN, envs={"vis": ENV}, vision=vision)
    assert [e.finish for e in episodes] == ["answered"] * G and episodes[0].answers == ["3"]
    # the first turn's G samples share one prompt and its image; later turns get each
    # history's images (the prompt's, then each observation's)
    assert len(sampler.images[0]) == 1 and sampler.images[0][0][1].shape == (1, 3)
    assert [len(x) for x in sampler.images[1:]] == [G, G]
    assert [len(i[1]) for i in sampler.images[2]] == [3, 3]

    processor = hf_fixtures.qwen25_vl_processor(tok, min_pixels=PROC.min_pixels,
                                                max_pixels=PROC.max_pixels,
                                                chat_template=hf_fixtures.QWEN3_VL_TEMPLATE)
    messages = [*TASK.messages]
    for view in (0, 1):
        messages += [
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function",
                             "function": {"name": "look", "arguments": {"view": view}}}]},
            {"role": "tool", "content": [{"type": "text", "text": f"view {view}"},
                                         {"type": "image", "image": RENDERS[view]}]}]
    want = processor.apply_chat_template(messages, tools=[LOOK.schema()],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=True, return_tensors="np")
    history = episodes[0].tokens[:-len(chat.encode(tok, "3<|im_end|>"))]
    assert history == want["input_ids"][0].tolist()
    patches, grids = images_lib.joined(episodes[0].images)
    np.testing.assert_array_equal(grids, want["image_grid_thw"])
    np.testing.assert_allclose(patches, want["pixel_values"], atol=1e-6, rtol=0)
    # the learner's rows: the prompt's image with the prompt, the two renders after it
    batch = rollout.to_batch(episodes, config, prompt_len=512, length=320, vision=vision)
    assert batch.vision_full_seg_bn[0].max() == 1 and batch.vision_obs_full_seg_bn[0].max() == 2
    n_obs = int((want["input_ids"][0] == c.image_token_id).sum()) - int(
        (np.asarray(episodes[0].tokens[:episodes[0].prompt_len]) == c.image_token_id).sum())
    assert (batch.vision_obs_dest_bm[0] < 320).sum() == n_obs


def test_sampled_logprobs_of_a_multi_turn_image_episode_equal_the_learners(tok):
    """Real sampling from the tiny VL model: an image prompt, then a turn, an image
    observation, a turn, an image observation (every turn is a `look` call here). Each
    sampled token's log-prob equals the learner's teacher-forced one on the `to_batch` rows
    (prompt images per group, each row's observation images and M-RoPE positions)."""
    c = _vl_config(tok)
    model = vl.init(c, seed=0)
    vision = images_lib.Vision(c, PROC, prompt_patches=64, observation_patches=128)
    fmt = dataclasses.replace(chat.QWEN, parse_calls=lambda text: [
        chat.ToolCall("look", {"view": len(text) % 2})])
    config = rollout.RolloutConfig(num_samples=G, max_new_tokens=6, max_turns=2, max_len=200)
    sampler = Sampler(model, seed=0, decode=tok.decode)
    episodes = rollout.generate(sampler, nnx.state(model), [TASK], tokenizer=tok,
                                key=jax.random.key(3), config=config, fmt=fmt,
                                envs={"vis": ENV}, vision=vision)
    assert all(len(e.images) == 3 and e.tool_calls == 2 for e in episodes)
    batch = rollout.to_batch(episodes, config, prompt_len=512, length=256)  # their vision
    batch.check_groups(G)
    keys = ("prompt_bp", "prompt_lens_b", "tokens_bn", "lengths_b") + vl.LEARNER_KEYS + \
        vl.OBSERVATION_KEYS
    graphdef, params = nnx.split(model)
    logp = jax.jit(lambda p, b: step.token_logprobs(graphdef, p, b, group_size=G)[0])(
        params, {k: v for k, v in batch.arrays().items() if k in keys})
    mask = batch.loss_mask_bn > 0
    assert mask.sum() >= 2 * G  # two sampled turns per episode
    np.testing.assert_allclose(np.where(mask, np.asarray(logp), 0),
                               np.where(mask, batch.rollout_logp_bn, 0), atol=1e-5, rtol=0)


def test_text_only_policy_refuses_image_tasks_before_generating(tok):
    c = _vl_config(tok)
    text_only = Scripted(tok, ["3"], None)
    config = rollout.RolloutConfig(num_samples=1, max_new_tokens=8, max_len=64)
    run = dict(params=None, tokenizer=tok, key=jax.random.key(0), config=config, fmt=chat.QWEN,
               envs={"vis": ENV})
    with pytest.raises(ValueError, match="images in its prompt.*text-only model"):
        rollout.generate(text_only, tasks=[TASK], **run)
    tool_task = Task("v2", "vis", None, prompt="Count the holes.", tools=("look",))
    with pytest.raises(ValueError, match=r"tools that return images \(look\).*text-only"):
        rollout.generate(text_only, tasks=[tool_task], **run)
    assert text_only.images == []  # nothing was sampled
    with pytest.raises(ValueError, match="text-only policy"):
        rollout.generate(text_only, tasks=[tool_task], vision=images_lib.Vision(c), **run)


def _echo(session, args, timeout_s):
    del session, timeout_s
    return ToolOutput("<|image_pad|>" + args["text"], (RENDERS[0],))


ECHO = Tool("echo", "Print a text (after an image marker) beside a render.",
            {"type": "object", "properties": {"text": {"type": "string"}},
             "required": ["text"], "additionalProperties": False}, _echo, images=True)


def test_printed_or_sampled_image_markers_and_cut_observations_never_misplace_images(tok):
    """A tool printing "<|image_pad|>" gets no placeholder (written "<image_pad>"); a turn
    whose sampled tokens hold one ends its episode (finish "vision_token") and the learner
    reads it as text; an observation cut at max_len keeps only whole image runs."""
    c = _vl_config(tok)
    vision = images_lib.Vision(c, PROC, prompt_patches=64, observation_patches=128)
    env = dataclasses.replace(ENV, tools=(LOOK, ECHO))
    task = dataclasses.replace(TASK, tools=("look", "echo"))
    n_render = 6  # RENDERS[0], 56 x 84: a (1, 4, 6) grid, 6 merged tokens

    def run(script, vision=vision, **config):
        sampler = Scripted(tok, script, c)
        config = rollout.RolloutConfig(**{"num_samples": 1, "max_new_tokens": 48,
                                          "max_turns": 3, "max_len": 300, **config})
        (e,) = rollout.generate(sampler, None, [task], tokenizer=tok, key=jax.random.key(0),
                                config=config, fmt=chat.QWEN, envs={"vis": env}, vision=vision)
        batch = rollout.to_batch([e], config, prompt_len=512, length=config.max_len)
        placed = int((batch.vision_obs_dest_bm[0] < config.max_len).sum())
        return e, sampler, placed

    e, _, placed = run([chat.format_turn(chat.QWEN, calls=[chat.ToolCall("echo", {"text": "!"})]),
                        "3"])
    assert e.finish == "answered" and len(e.images) == 2 and placed == n_render
    observation = tok.decode(e.tokens[e.prompt_len:])
    assert "<image_pad>!<|vision_start|>" in observation
    assert e.tokens[e.prompt_len:].count(c.image_token_id) == n_render

    e, sampler, placed = run(["<|image_pad|>" + _calls(0), "3"])
    assert e.finish == "vision_token" and len(sampler.images) == 1 and len(e.images) == 1
    assert placed == 0 and e.tokens[e.prompt_len:].count(c.image_token_id) == 1
    # a failed answer with a sampled marker is judged and not retried
    e, sampler, _ = run(["<|image_pad|>4", "3"], max_attempts=2, max_turns=1)
    assert e.attempts == 1 and len(sampler.images) == 1 and not e.verdicts[0].passed

    turn = chat.encode(tok, _calls(0) + "<|im_end|>")
    obs, _ = images_lib.observation_ids([_look(None, {"view": 0}, 1)], tok, chat.QWEN, vision,
                                        closed=True)
    start = obs.index(c.vision_start_token_id)
    e, _, placed = run([_calls(0), "3"], max_len=len(turn) + start + 3, max_new_tokens=len(turn))
    assert e.finish == "max_len" and len(e.images) == 1 and placed == 0
    assert e.tokens[len(e.tokens) - start:] == obs[:start]  # cut before the image's run
    # a tool's unreadable image, or one past the budget, is not shown and its text says why
    ids, shown = images_lib.observation_ids(
        [ToolOutput("x", (b"junk", RENDERS[0], RENDERS[1]))], tok, chat.QWEN, vision,
        closed=True, patch_room=30)  # each render is 24 patches
    text = tok.decode(ids)
    assert len(shown) == 1 and ids.count(c.image_token_id) == n_render
    assert "[image 1 is not shown: 4 bytes is not a readable image" in text
    assert "[image 3 is not shown: the episode's images would pass" in text
    with pytest.raises(ValueError, match="observation_patches is 0"):
        run(["3"], vision=images_lib.Vision(c, PROC))
