"""The LLM clients people use, unchanged, against `mha-serving serve`'s /openai/v1: langchain-openai's `OpenAI` LLM
(invoke, batch, stream) and `ChatOpenAI`, litellm's `text_completion` and `completion`, and lm-evaluation-harness's
`local-completions` running the repository's docs-lm tasks (evaluation/lm_eval) through the server, batched and
concurrent, with the model folder's tokenizer. A tiny decoder with the context of `make run`'s."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from conftest import export_tiny_decoder

from benchmarks import served_quality
from benchmarks.harness.server import ServerProcess
from evaluation import docs_tasks

pytestmark = [pytest.mark.serve, pytest.mark.slow]
LM = "lm-h4-kv1-d32"
CONTEXT = 128  # `make run`'s decoder's, the smallest the tasks are sized for
PROMPTS = ["def f(x):", "The with statement", "class A:"]
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm reads its model list from the package


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llm-client-models")
    export_tiny_decoder(out, 1, CONTEXT, seed=1)
    return out


@pytest.fixture(scope="module")
def server(models_dir):
    with ServerProcess({"models_dir": str(models_dir), "backend": "cpu", "generate": {"threads": 1}}) as running:
        yield running


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"http://127.0.0.1:{server.port}/openai/v1"


def _completion(base_url: str, prompt: str, max_tokens: int = 12) -> str:
    """The server's own greedy completion, over plain HTTP."""
    body = {"model": LM, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    answer = httpx.post(f"{base_url}/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def test_langchain_openais_llm_invokes_batches_and_streams_the_servers_completions(base_url):
    from langchain_openai import OpenAI

    llm = OpenAI(model=LM, base_url=base_url, api_key="unused", max_tokens=12, temperature=0, max_retries=0)
    want = [_completion(base_url, p) for p in PROMPTS]
    assert llm.invoke(PROMPTS[0]) == want[0]
    assert llm.batch(PROMPTS) == want
    assert "".join(llm.stream(PROMPTS[1])) == want[1]


def test_langchain_chat_openai_answers_in_the_chat_format_alike_streamed(base_url):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=LM, base_url=base_url, api_key="unused", max_tokens=12, temperature=0, max_retries=0)
    whole = chat.invoke("Say something about lists.")
    assert isinstance(whole.content, str) and whole.response_metadata["finish_reason"] in ("stop", "length")
    assert "".join(chunk.content for chunk in chat.stream("Say something about lists.")) == whole.content


def test_litellm_text_completion_and_chat_completion_work_against_the_openai_route(base_url):
    import litellm

    done = litellm.text_completion(
        model=f"openai/{LM}", api_base=base_url, api_key="unused", prompt=PROMPTS[2], max_tokens=12, temperature=0
    )
    assert done.choices[0].text == _completion(base_url, PROMPTS[2])
    chat = litellm.completion(
        model=f"openai/{LM}",
        api_base=base_url,
        api_key="unused",
        messages=[{"role": "user", "content": "Say something about lists."}],
        max_tokens=12,
        temperature=0,
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 12


def test_lm_eval_runs_the_repositorys_three_docs_tasks_through_the_server_batched_and_concurrent(server, models_dir):
    """`lm_eval --model local-completions` with the model folder as its Hugging Face tokenizer, batch_size 4 and 2
    concurrent requests: the rolling perplexity, the multiple choice and the greedy continuation all run to the end
    on a few documents each and report their metrics (an untrained model's: near the uniform, not its quality)."""
    limit = 3
    results = served_quality.evaluate(f"http://127.0.0.1:{server.port}", LM, models_dir / LM, CONTEXT, limit=limit)
    got = served_quality.scores(results)
    assert 0 < got["docs_lm_perplexity.bits_per_byte"] < 12 and got["docs_lm_perplexity.byte_perplexity"] > 1
    assert 0 <= got["docs_lm_choice.acc"] <= 1 and 0 <= got["docs_lm_continue.exact_match"] <= 1
    assert all(results["n-samples"][task]["effective"] == limit for task in served_quality.METRICS)


def test_the_committed_task_files_are_what_the_generator_writes_from_this_pythons_docs(tmp_path):
    """They hold the held-out split of the corpus the decoders train on; made on the Python the manifest names (its
    pydoc topics change between releases)."""
    committed = docs_tasks.TASKS_DIR / "data"
    made_on = json.loads((committed / docs_tasks.MANIFEST).read_text())["python"]
    if made_on != docs_tasks.platform.python_version():
        pytest.skip(f"the task files were made on Python {made_on}, this is {docs_tasks.platform.python_version()}")
    docs_tasks.write(tmp_path)
    for name in (docs_tasks.DOCUMENTS, docs_tasks.CHOICES, docs_tasks.CONTINUATIONS, docs_tasks.MANIFEST):
        assert (tmp_path / "data" / name).read_bytes() == (committed / name).read_bytes(), name
