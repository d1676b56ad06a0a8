"""The simulated engines' dialects read their engine's facts from its module.

``docs/architecture.md`` ("Where knowledge lives"): what llmgw knows of an engine
is in ``engines/<engine>.py``, and the simulated engine reads its dialect from
there. These tests swap a dialect's :class:`~llmgw.engines.base.EngineInfo` for a
changed copy and check that its answers follow the record, not literals.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson
import pytest

from llmgw import engines
from llmgw.engines import llamacpp
from llmgw.engines.sim.config import SimConfig
from llmgw.engines.sim.dialects import DIALECTS, Dialect
from llmgw.engines.sim.openai import RequestError
from llmgw.engines.sim.scheduler import Scheduler, Stats


def make(cls: type[Dialect], name: str) -> Any:
    cfg = SimConfig(engine=name, model="m", max_model_len=2048)
    stats = Stats(cls.buckets_for(cfg))
    return cls(cfg, Scheduler(cfg.slots, cfg.max_queue, cfg.kv_tokens, stats), stats, 1_700_000_000)


@pytest.mark.parametrize("name", engines.SIMULATED_ENGINES)
def test_owned_by_is_the_engine_modules(name: str) -> None:
    cls = DIALECTS[name]
    assert cls.info is engines.get(name)
    card = make(cls, name).model_card()
    assert card["owned_by"] == engines.get(name).owned_by
    assert list(card)[:4] == ["id", "object", "created", "owned_by"]

    probe = type(f"Probe{cls.__name__}", (cls,), {"info": replace(cls.info, owned_by=f"probe-{name}")})
    dialect = make(probe, name)
    assert dialect.model_card()["owned_by"] == f"probe-{name}"
    assert [c["owned_by"] for c in dialect.models()["data"]] == [f"probe-{name}"]
    # the engine's own extra fields are still there
    assert {k: v for k, v in dialect.model_card().items() if k != "owned_by"} == {
        k: v for k, v in card.items() if k != "owned_by"
    }


def test_llamacpp_error_types_are_the_engine_modules() -> None:
    d = make(DIALECTS["llamacpp"], "llamacpp")
    for status, etype in llamacpp.ERROR_TYPES.items():
        _, body = d.request_error(RequestError(status, "m"))
        assert orjson.loads(body)["error"]["type"] == etype
    _, body = d.request_error(RequestError(400, "m", "context", {"n_prompt_tokens": 9, "n_ctx": 8}))
    e = orjson.loads(body)["error"]
    assert e["type"] == llamacpp.CONTEXT_ERROR_TYPE
    assert tuple(k for k in e if k in llamacpp.CONTEXT_ERROR_FIELDS) == llamacpp.CONTEXT_ERROR_FIELDS
