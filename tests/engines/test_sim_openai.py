"""The official ``openai`` client against the simulated engine."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator

import pytest
from openai import AsyncOpenAI, AuthenticationError, InternalServerError, NotFoundError

from llmgw.engines.sim import SimConfig, SimEngine


@pytest.fixture(params=["vllm", "llamacpp"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[SimEngine]:
    eng = SimEngine(SimConfig(model="m", engine=request.param, api_key="k", ttft_ms=1.0,
                              tokens_per_second=5000.0, embedding_dim=16))
    await eng.start("127.0.0.1", 0)
    yield eng
    await eng.stop(timeout=1.0)


@pytest.fixture
async def client(engine: SimEngine) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=engine.url + "/v1", api_key="k", max_retries=0, timeout=10) as c:
        yield c


async def test_chat(client: AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hi"}], max_completion_tokens=5
    )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 2


async def test_chat_stream(client: AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )
    text, reasons, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text.append(ch.delta.content or "")
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert reasons == ["length"]
    assert len("".join(text).split(" ")) == 6
    assert usage is not None and usage.completion_tokens == 6


async def test_completions(client: AsyncOpenAI) -> None:
    r = await client.completions.create(model="m", prompt="Once upon a time", max_tokens=4)
    assert r.object == "text_completion"
    assert r.usage is not None and r.usage.completion_tokens == 4 and r.usage.prompt_tokens == 4
    stream = await client.completions.create(model="m", prompt="Once", max_tokens=3, stream=True)
    pieces = [c.choices[0].text async for c in stream if c.choices]
    assert "".join(pieces).count(" ") == 2


async def test_embeddings(client: AsyncOpenAI) -> None:
    r = await client.embeddings.create(model="m", input=["one", "two"])
    assert [d.index for d in r.data] == [0, 1]
    assert len(r.data[0].embedding) == 16
    # The client asks for base64 by default when numpy is around; check both agree.
    raw = await client.embeddings.with_raw_response.create(model="m", input="one", encoding_format="base64")
    b64 = raw.http_response.json()["data"][0]["embedding"]
    assert list(struct.unpack("<16f", base64.b64decode(b64))) == pytest.approx(r.data[0].embedding)


async def test_models(client: AsyncOpenAI) -> None:
    page = await client.models.list()
    assert [m.id for m in page.data] == ["m"]


async def test_errors(engine: SimEngine, client: AsyncOpenAI) -> None:
    async with AsyncOpenAI(base_url=engine.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(AuthenticationError):
            await bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    engine.set_faults(error_next=1)
    with pytest.raises(InternalServerError):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    if engine.config.engine == "vllm":
        with pytest.raises(NotFoundError):
            await client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
