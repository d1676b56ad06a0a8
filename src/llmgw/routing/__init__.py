"""Routing and admission kernels: the compiled ``_fast.score``/``_fast.admit`` or their twins.

See :mod:`llmgw._fast.score_py` and :mod:`llmgw._fast.admit_py` for the
specification, and ``docs/routing.md`` for the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._accel import select

if TYPE_CHECKING:
    from .._fast.admit_py import AdmissionQueue
    from .._fast.score_py import (
        REASONS,
        STRATEGIES,
        Breaker,
        EndpointState,
        Picker,
        RetryBudget,
        pool_saturation,
        retry_after,
    )
else:
    _score = select("score")
    _admit = select("admit")
    STRATEGIES = _score.STRATEGIES
    REASONS = _score.REASONS
    Breaker = _score.Breaker
    EndpointState = _score.EndpointState
    Picker = _score.Picker
    RetryBudget = _score.RetryBudget
    pool_saturation = _score.pool_saturation
    retry_after = _score.retry_after
    AdmissionQueue = _admit.AdmissionQueue

__all__ = [
    "REASONS",
    "STRATEGIES",
    "AdmissionQueue",
    "Breaker",
    "EndpointState",
    "Picker",
    "RetryBudget",
    "pool_saturation",
    "retry_after",
]
