"""logprobs, n and prefix caching through the official `openai` client (issue #30).

The whole stack (launcher, gateway, verifier, ngram drafter) on a tiny random model in
fp32: what the client receives must be well formed in OpenAI's shapes, and exact: the
logprobs with speculation equal those without it.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.served_stack import Stack, served_stack
from tests.support.tiny_models import make_tiny_llama

MAX_NUM_SEQS = 8
# Word-level tokenizer: one word, one token. Repeats give the ngram drafter matches.
PROMPT = "w10 w11 w12 w13 w10 w11 w12 w13 w10 w11"
SYSTEM = " ".join(f"w{3 + (i * 7) % 90}" for i in range(80))  # 80 tokens


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-parity"))
    with served_stack(model, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "256") as running:
        yield running


@pytest.fixture()
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, **kwargs: object):
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}  # type: ignore[dict-item]
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": PROMPT}], max_tokens=12, extra_body=extra,
        **kwargs)  # type: ignore[arg-type]


def test_chat_logprobs_are_exact_under_speculation(client) -> None:
    plain = chat(client, temperature=0, logprobs=True, top_logprobs=3,
                 extra_body={"speculation": False})
    spec = chat(client, temperature=0, logprobs=True, top_logprobs=3)
    assert spec.usage.speculation["num_draft_tokens"] > 0  # type: ignore[attr-defined]
    assert spec.usage.speculation["num_accepted_tokens"] > 0  # type: ignore[attr-defined]
    plain_content = plain.choices[0].logprobs.content
    spec_content = spec.choices[0].logprobs.content
    assert len(spec_content) == spec.usage.completion_tokens == 12
    assert [(c.token, c.logprob) for c in spec_content] == [(c.token, c.logprob) for c in plain_content]
    for entry in spec_content:
        tops = entry.top_logprobs
        assert len(tops) == 3
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == entry.token and tops[0].logprob == entry.logprob  # greedy
        assert entry.bytes == list(entry.token.encode())
    assert "".join(c.token for c in spec_content).replace("w", " w").strip() == \
        spec.choices[0].message.content.strip()


def test_streamed_logprobs_equal_the_whole_answer(client) -> None:
    whole = chat(client, temperature=0, logprobs=True, top_logprobs=2)
    stream = chat(client, temperature=0, logprobs=True, top_logprobs=2, stream=True)
    entries = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                entries += choice.logprobs.content
    assert [(e.token, e.logprob) for e in entries] == [
        (e.token, e.logprob) for e in whole.choices[0].logprobs.content]


def test_completion_logprobs_shape(client) -> None:
    completion = client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=8, temperature=0,
        logprobs=2, extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top[token] == value and len(top) <= 3


def test_n_seeded_samples_are_reproducible_and_differ(client) -> None:
    first = chat(client, n=3, temperature=1.0, seed=1234)
    again = chat(client, n=3, temperature=1.0, seed=1234)
    texts = [choice.message.content for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1, 2]
    assert texts == [choice.message.content for choice in again.choices]
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == 3 * 12


def test_n_greedy_choices_are_identical_and_share_the_prompt(client) -> None:
    response = chat(client, n=2, temperature=0)
    assert response.choices[0].message.content == response.choices[1].message.content
    assert response.usage.completion_tokens == 24


def test_n_streams_every_index(client) -> None:
    stream = chat(client, n=2, temperature=0.7, seed=3, stream=True,
                  stream_options={"include_usage": True})
    texts = {0: "", 1: ""}
    finished = set()
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
        if chunk.usage is not None:
            usage = chunk.usage
    assert finished == {0, 1} and all(texts.values())
    assert usage is not None and usage.completion_tokens == 24


def test_n_above_max_num_seqs_is_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, n=MAX_NUM_SEQS + 1)
    assert info.value.body["param"] == "n"  # type: ignore[index]


def test_repeated_system_prompt_reports_cached_tokens(client) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                           temperature=0)
    second = client.chat.completions.create(
        model=model, messages=[messages[0], {"role": "user", "content": "w40 w41"}],
        max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    assert first.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens_details.cached_tokens


def test_cache_salt_isolates_the_prefix_cache(client) -> None:
    """Issue 44 item 8: a prompt another tenant sent is no hit under another salt (nor
    under none); the same salt still hits."""
    system = " ".join(f"w{5 + (i * 11) % 90}" for i in range(80))  # 80 tokens, fresh
    messages = [{"role": "system", "content": system}, {"role": "user", "content": PROMPT}]
    model = client.models.list().data[0].id

    def cached(salt: str | None, user: str) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        response = client.chat.completions.create(
            model=model, messages=[messages[0], {"role": "user", "content": user}],
            max_tokens=2, temperature=0, extra_body=extra)
        return response.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a", PROMPT) == 0
    assert cached("tenant-b", "w40 w41") == 0
    assert cached(None, "w40 w42") == 0
    assert cached("tenant-a", "w40 w43") >= 64


def test_an_empty_cache_salt_is_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, extra_body={"cache_salt": ""})
    assert info.value.body["param"] == "cache_salt"  # type: ignore[index]
