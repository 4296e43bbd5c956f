"""Token generation served by `mha-serving serve` beside a classifier: the official `openai` client against
/openai/v1 (a completion, a stream with the same text, usage, finish reasons, a stop string, a prompt of token ids,
batches of prompts and n choices, a model retrieved),
the Open Inference Protocol's generate and generate_stream, the model lists, the 4xx answers (over the context, n=2,
an unknown model, a classifier asked to generate and a decoder asked to classify), and a client that disconnects
mid-stream freeing its sequence's KV reservation for the next request."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time

import httpx
import openai
import pytest
from conftest import export_tiny_decoder, export_tiny_model
from prometheus import series_total

from benchmarks.harness.server import ServerProcess
from contract.tokenizer import ByteTokenizer
from service.config import AppConfig
from service.decoder_placement import ColocatedDecoder
from service.generate import GenerationSettings

LM = "lm-h4-kv1-d32"  # the tiny decoder: context 64
LONG = "lm-h4-kv4-d32"  # a decoder with a long context (2048): its streams last seconds, for the disconnect test
NO_TEMPLATE = LONG  # its tokenizer_config.json has no chat template
CLASSIFIER = "mha-h2-d32"
KV_TOKENS = 2048  # generate.kv_cache_tokens: one full context of LONG, so a second LONG sequence waits for the first
PROMPT = "def f(x):"
PROMPT_TOKENS = 1 + len(PROMPT)  # BOS, then a token per byte

pytestmark = [pytest.mark.serve, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("generation-models")
    export_tiny_decoder(out, 1, 64, seed=1)
    export_tiny_decoder(out, 4, KV_TOKENS, seed=4)
    config_file = out / NO_TEMPLATE / "tokenizer_config.json"  # a decoder exported before chat templates
    config_file.write_text(
        json.dumps({k: v for k, v in json.loads(config_file.read_text()).items() if k != "chat_template"})
    )
    export_tiny_model(out, heads=2, seed=2)
    config = {
        "models_dir": str(out),
        "backend": "cpu",
        "generate": {"kv_cache_tokens": KV_TOKENS, "threads": 1},
    }
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # Ray's export every second, as tests/serving.py
    with ServerProcess(config) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/openai/v1", api_key="unused", max_retries=0)


def _greedy() -> dict:
    return {"model": LM, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_a_completion_and_its_stream_give_the_same_text_and_usage(client):
    whole = client.completions.create(**_greedy())
    choice = whole.choices[0]
    assert whole.object == "text_completion" and whole.model == LM and whole.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.index == 0
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        PROMPT_TOKENS,
        24,
        PROMPT_TOKENS + 24,
    )
    chunks = list(client.completions.create(**_greedy(), stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    plain = list(client.completions.create(**_greedy(), stream=True))  # usage only when asked, as OpenAI's
    assert "".join(c.choices[0].text for c in plain) == choice.text
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "length"


def test_a_batch_of_prompts_gives_a_choice_each_that_equals_the_prompt_alone(client):
    """Strings and token-id lists, with n: choice j of prompt i at index i x n + j, the usage summed (each prompt
    once); streamed, each chunk carries its index and the texts are the same."""
    prompts = [PROMPT, "class A:", "import os"]
    alone = [client.completions.create(**_greedy() | {"prompt": p}) for p in prompts]
    batch = client.completions.create(**_greedy() | {"prompt": prompts})
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 3 * 24
    ids = [ByteTokenizer(64).encode(p) for p in prompts]  # what the text prompts encode to
    by_ids = client.completions.create(**_greedy() | {"prompt": ids, "n": 2})
    assert [c.index for c in by_ids.choices] == list(range(6))
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone for _ in range(2)]  # greedy: twice
    assert by_ids.usage.prompt_tokens == batch.usage.prompt_tokens and by_ids.usage.completion_tokens == 6 * 24
    chunks = list(client.completions.create(**_greedy() | {"prompt": prompts}, stream=True))
    streamed: dict[int, str] = {}
    for chunk in chunks:
        assert len(chunk.choices) == 1 and chunk.usage is None
        streamed[chunk.choices[0].index] = streamed.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert streamed == {i: a.choices[0].text for i, a in enumerate(alone)}
    counted = list(
        client.completions.create(
            **_greedy() | {"prompt": prompts}, stream=True, stream_options={"include_usage": True}
        )
    )
    assert counted[-1].choices == [] and counted[-1].usage.model_dump() == batch.usage.model_dump()
    assert (
        sorted(c.choices[0].finish_reason for c in counted if c.choices and c.choices[0].finish_reason)
        == ["length"] * 3
    )


def test_n_seeded_choices_repeat_choice_zero_is_the_single_completion_and_they_differ(client):
    sampled = {"model": LM, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 11}
    three = [c.text for c in client.completions.create(**sampled, n=3).choices]
    assert [c.text for c in client.completions.create(**sampled, n=3).choices] == three
    assert client.completions.create(**sampled).choices[0].text == three[0]
    assert len(set(three)) == 3, three  # each choice its own draws: the seed's children, not the seed again
    batched = client.completions.create(**sampled | {"prompt": ["x", PROMPT]}, n=3)
    assert [c.text for c in batched.choices[3:]] == three  # the same choices, second in a batch


def test_a_chat_is_the_completion_of_its_messages_rendered_by_the_models_template_streamed_alike(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]
    rendered = "system: Be brief.\nuser: def f(x):\nassistant:"  # export's template for the byte-level models
    asked = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    completion = client.completions.create(model=LM, prompt=rendered, **asked)
    reply = client.chat.completions.create(model=LM, messages=messages, **asked)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert (
        reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == completion.choices[0].text
    )
    assert reply.usage.model_dump() == completion.usage.model_dump()
    chunks = list(
        client.chat.completions.create(model=LM, messages=messages, stream=True, n=2, **asked | {"max_tokens": None})
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    firsts = {}
    texts: dict[int, str] = {}
    for chunk in chunks:
        choice = chunk.choices[0]
        firsts.setdefault(choice.index, choice.delta.role)
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert firsts == {0: "assistant", 1: "assistant"}  # each choice's first delta names the role
    until_end = client.completions.create(model=LM, prompt=rendered, **asked | {"max_tokens": 64 - 1 - len(rendered)})
    assert texts == {0: until_end.choices[0].text} | {1: until_end.choices[0].text}  # greedy twice
    # no max given: the chat goes on until the context (64) ends, as OpenAI's does; a completion stops at 16
    whole = client.chat.completions.create(model=LM, messages=messages, **asked | {"max_tokens": None})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 64 - 1 - len(rendered)
    default = client.completions.create(model=LM, prompt=rendered, **asked | {"max_tokens": None})
    assert default.usage.completion_tokens == 16
    parts = [{"role": "user", "content": [{"type": "text", "text": "def f"}, {"type": "text", "text": "(x):"}]}]
    assert client.chat.completions.create(model=LM, messages=parts, **asked).choices[0].message.content == (
        client.chat.completions.create(model=LM, messages=messages[1:], **asked).choices[0].message.content
    )


def test_a_chat_with_a_model_without_a_template_or_a_malformed_message_is_a_400_saying_why(client, http):
    with pytest.raises(openai.BadRequestError, match=f"model '{NO_TEMPLATE}' has no chat template"):
        client.chat.completions.create(model=NO_TEMPLATE, messages=[{"role": "user", "content": "hi"}])
    for message in ({"content": "hi"}, {"role": "robot", "content": "hi"}):
        answer = http.post("/openai/v1/chat/completions", json={"model": LM, "messages": [message]})
        assert answer.status_code == 400 and "role" in answer.json()["error"]["message"], answer.text
    empty = http.post("/openai/v1/chat/completions", json={"model": LM, "messages": []})
    assert empty.status_code == 400 and "messages" in empty.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match=r"not supported: presence_penalty=0\.5"):
        client.chat.completions.create(model=LM, messages=[{"role": "user", "content": "hi"}], presence_penalty=0.5)


def test_a_decoder_is_retrieved_by_name_and_an_unknown_one_is_a_404_in_openais_shape(client, http):
    got = client.models.retrieve(LM)
    assert (got.id, got.object, got.max_model_len, got.kv_heads) == (LM, "model", 64, 1)
    for name in ("nope", CLASSIFIER):
        with pytest.raises(openai.NotFoundError, match=f"no decoder '{name}'"):
            client.models.retrieve(name)
    assert http.get("/openai/v1/models/nope").json()["error"]["code"] == 404


def test_a_seeded_sampled_completion_repeats_and_a_prompt_of_token_ids_works(client):
    sampled = {"model": LM, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.8, "seed": 7}
    first = client.completions.create(**sampled).choices[0].text
    assert client.completions.create(**sampled).choices[0].text == first
    ids = client.completions.create(model=LM, prompt=[1, 2, 3], max_tokens=5, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens <= 5


def test_a_stop_string_ends_the_text_before_it(client):
    text = client.completions.create(**_greedy()).choices[0].text
    stop = text[6:8]
    assert len(stop) == 2, text
    stopped = client.completions.create(**_greedy() | {"stop": [stop]}).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]


def _text_of(tokens: list[str]) -> str:
    """The text that logprobs' token strings spell: `bytes:\\xNN` a byte of a character, special names none."""
    data = b"".join(
        bytes((int(t[-2:], 16),)) if t.startswith("bytes:") else b"" if t.startswith("<") else t.encode()
        for t in tokens
    )
    return data.decode("utf-8", errors="replace")


def _id(token: str) -> int:
    """The id a logprobs token string names (byte-v1: a byte + 4)."""
    return (int(token[-2:], 16) if token.startswith("bytes:") else ord(token)) + 4


def test_logprobs_name_each_greedy_token_first_among_its_alternatives_whole_and_streamed(client):
    whole = client.completions.create(**_greedy() | {"logprobs": 3}).choices[0]
    logprobs = whole.logprobs
    assert len(logprobs.tokens) == 24 and _text_of(logprobs.tokens) == whole.text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and max(top, key=top.get) == token and top[token] == logprob <= 0
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    chunks = client.completions.create(**_greedy() | {"logprobs": 3, "stream": True})
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == logprobs.token_logprobs
    chat = client.chat.completions.create(
        model=LM,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    ).choices[0]
    content = chat.logprobs.content
    assert _text_of([t.token for t in content]) == chat.message.content and len(content) == 6
    assert all(t.top_logprobs[0].token == t.token and len(t.bytes) == 1 for t in content)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        client.chat.completions.create(model=LM, messages=[{"role": "user", "content": "hi"}], top_logprobs=2)


def test_echo_with_max_tokens_0_scores_a_continuation_as_its_completion_did(client):
    """lm-eval's loglikelihood: the prompt and a continuation echoed with their logprobs, nothing generated; the
    continuation's tokens get the logprobs the completion that made them gave them."""
    made = client.completions.create(**_greedy() | {"max_tokens": 8, "logprobs": 1}).choices[0]
    ids = ByteTokenizer(64).encode(PROMPT) + [_id(token) for token in made.logprobs.tokens]  # as token ids: exact
    scored = client.completions.create(model=LM, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == PROMPT + made.text and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == PROMPT_TOKENS + 8
    tokens = choice.logprobs.tokens
    assert (
        tokens[0] == "<bos>" and choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    )
    assert _text_of(tokens) == PROMPT + made.text and len(tokens) == PROMPT_TOKENS + 8
    assert choice.logprobs.token_logprobs[-8:] == pytest.approx(made.logprobs.token_logprobs, abs=1e-4)
    echoed = client.completions.create(**_greedy() | {"max_tokens": 4, "echo": True})  # echo alone: text, no logprobs
    assert echoed.choices[0].text.startswith(PROMPT) and echoed.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="logprobs=21 must be an integer from 0 to 20"):
        client.completions.create(model=LM, prompt=PROMPT, logprobs=21)
    with pytest.raises(
        openai.BadRequestError,
        match=r"max_tokens=0 must be an integer >= 1 \(0: the prompt's logprobs only, with echo\)",
    ):
        client.completions.create(model=LM, prompt=PROMPT, max_tokens=0)


def test_the_oip_generate_and_generate_stream_agree_with_the_completion(client, http):
    text = client.completions.create(**_greedy()).choices[0].text
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 24, "temperature": 0, "ignore_eos": True}}
    whole = http.post(f"/v2/models/{LM}/generate", json=body)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    assert answer["model_name"] == LM and answer["text_output"] == text
    assert answer["details"] == {"finish_reason": "length", "prompt_tokens": PROMPT_TOKENS, "generated_tokens": 24}
    with http.stream("POST", f"/v2/models/{LM}/generate_stream", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: ") :]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == text
    assert events[-1]["details"]["finish_reason"] == "length"
    eos = http.post(f"/v2/models/{LM}/generate", json={"text_input": PROMPT, "parameters": {"max_tokens": 3}})
    assert eos.json()["details"]["finish_reason"] in ("length", "eos_token")


def test_the_model_lists_say_which_models_generate(http):
    listed = {m["name"]: m for m in http.get("/v1/models").json()["models"]}
    assert listed[LM]["arch"] == "decoder" and listed[LM]["kv_heads"] == 1 and listed[LM]["context_length"] == 64
    assert listed[CLASSIFIER]["arch"] == "classifier"
    params = http.get(f"/v2/models/{LM}").json()["parameters"]
    assert (params["arch"], params["kv_heads"], params["context_length"]) == ("decoder", 1, 64)
    openai_models = http.get("/openai/v1/models").json()
    assert openai_models["object"] == "list"
    assert {m["id"] for m in openai_models["data"]} == {LM, LONG}


def test_bad_requests_are_4xx_that_say_why(client, http):
    over = http.post("/openai/v1/completions", json={"model": LM, "prompt": PROMPT, "max_tokens": 60})
    error = over.json()["error"]  # OpenAI's shape under /openai/
    assert over.status_code == 400 and error["type"] == "invalid_request_error" and error["code"] == 400
    assert f"{PROMPT_TOKENS} tokens + max_tokens 60" in error["message"] and "length of 64" in error["message"]
    for n in (0, 17):
        with pytest.raises(openai.BadRequestError, match=f"n={n} must be 1 to 16"):
            client.completions.create(model=LM, prompt=PROMPT, n=n)
    with pytest.raises(openai.BadRequestError, match="not supported: best_of=2"):
        client.completions.create(model=LM, prompt=PROMPT, best_of=2)
    with pytest.raises(openai.BadRequestError, match="prompt is an empty list"):
        client.completions.create(model=LM, prompt=[])
    with pytest.raises(openai.BadRequestError, match="5 prompts x n=16 is 80 choices, over 64"):
        client.completions.create(model=LM, prompt=["a"] * 5, n=16)
    too_long = {"model": LM, "prompt": [PROMPT, "x" * 60], "max_tokens": 4}
    with pytest.raises(openai.BadRequestError, match=r"^Error code: 400 - .*prompt 1: model 'lm-h4-kv1-d32': the "):
        client.completions.create(**too_long)
    with pytest.raises(openai.BadRequestError, match="prompt 0: prompt token id 999"):
        client.completions.create(model=LM, prompt=[[999], [1]])
    with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
        client.completions.create(model="nope", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="is a classifier"):
        client.completions.create(model=CLASSIFIER, prompt=PROMPT)
    asked = http.post(f"/v1/models/{LM}/predict", json={"text": "hello"})
    assert asked.status_code == 400 and "a decoder: use /openai/v1/completions" in asked.json()["error"]
    v2 = http.post(f"/v2/models/{LM}/infer", json={"inputs": []})
    assert v2.status_code == 400, v2.text
    stream = http.post(f"/v2/models/{LM}/generate_stream", json={"text_input": PROMPT, "parameters": {"top_p": 0}})
    assert stream.status_code == 400 and "top_p" in stream.json()["error"]
    assert http.post(f"/v2/models/{CLASSIFIER}/generate", json={"text_input": "x"}).status_code == 400


def test_classifiers_answer_beside_the_decoders(http):
    answer = http.post(f"/v1/models/{CLASSIFIER}/predict", json={"text": "hello"})
    assert answer.status_code == 200 and len(answer.json()["logits"][0]) == 2


def _long(max_tokens: int, stream: bool = False) -> dict:
    body = {"model": LONG, "prompt": [1], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return body | {"stream": stream}


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(server, http):
    """Each LONG request reserves the whole KV budget: the second one starts only once the first has left."""
    start = time.perf_counter()
    whole = http.post("/openai/v1/completions", json=_long(KV_TOKENS - 1))
    full_s = time.perf_counter() - start
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == KV_TOKENS - 1
    with (
        httpx.Client(base_url=http.base_url, timeout=60) as gone,
        gone.stream("POST", "/openai/v1/completions", json=_long(KV_TOKENS - 1, stream=True)) as r,
    ):
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk: the sequence runs, holding the whole budget
    # leaving the block closed the connection before the stream ended
    start = time.perf_counter()
    after = http.post("/openai/v1/completions", json=_long(8))
    waited_s = time.perf_counter() - start
    assert after.status_code == 200, after.text
    print(f"a whole {KV_TOKENS - 1}-token completion: {full_s:.2f} s; the next after a disconnect: {waited_s:.2f} s")
    assert waited_s < full_s / 2


def test_the_generate_block_becomes_the_engines_settings():
    settings = AppConfig.model_validate({"generate": {"kv_cache_tokens": 128, "max_running": 4}}).generate
    assert settings.settings("cpu") == GenerationSettings(kv_cache_tokens=128, max_running=4, backend="cpu")
    with pytest.raises(ValueError, match="max_waiting"):
        AppConfig.model_validate({"generate": {"max_waiting": 0}})


def test_a_decoder_that_cannot_load_is_served_as_not_ready_saying_why(server):
    settings = GenerationSettings(kv_cache_tokens=32, threads=1)  # less than one context of 64
    placement = ColocatedDecoder.open(server.config["models_dir"], LM, settings)
    status = asyncio.run(placement.status())
    assert not status.ready and "cannot hold one context of 64 tokens" in status.reason
    assert not placement.busy()
    placement.close()


def test_the_generation_metrics_carry_the_kv_heads_and_count_the_disconnect(server):
    """After the tests above: time to first token, inter-token latency and tokens per decoder, and the request
    whose client went away counted as 499."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    deadline, text = time.monotonic() + 30, ""
    wanted = {
        "ray_mha_time_to_first_token_seconds_count": {"model": LM, "kv_heads": "1"},
        "ray_mha_inter_token_latency_seconds_count": {"model": LONG, "kv_heads": "4"},
        "ray_mha_generation_tokens_total": {"model": LONG, "kv_heads": "4"},
        "ray_mha_requests_total": {"model": LONG, "endpoint": "openai_completions", "code": "499"},
    }
    while time.monotonic() < deadline:
        text = httpx.get(url, timeout=10).text
        if all(series_total(text, name, **labels) > 0 for name, labels in wanted.items()):
            break
        time.sleep(1)
    for name, labels in wanted.items():
        assert series_total(text, name, **labels) > 0, (name, labels, re.findall(rf"^{name}.*$", text, re.M)[:5])
    served = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10)  # where aiperf and GenAI-Perf look
    assert served.status_code == 200 and served.headers["content-type"].startswith("text/plain")
    for name, labels in wanted.items():
        assert series_total(served.text, name, **labels) >= series_total(text, name, **labels) > 0, name
    # the whole completion, the few tokens of the one cancelled, the 8 after it: far from two whole ones
    assert KV_TOKENS - 1 <= series_total(text, "ray_mha_generation_tokens_total", model=LONG) < 2 * (KV_TOKENS - 1)
