"""Where an agent session's turn runs: the engine it is placed on, for as long as it can.

Owns the rule (Miles' session placement): a new session goes to the least-loaded eligible
engine, load being the sessions placed on an engine per unit of capacity, then its
requests in flight per unit of capacity; a placed session stays on its engine (whose
prefix cache holds the conversation) while that engine is leased, serving, on the run, of
an allowed precision and on a version the turn accepts, and is not excluded because it
just failed or refused. Only then does it move, by the same least-loaded rule.
Pure: no I/O and no clock of its own.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping

from controlplane.router import eligible
from controlplane.snapshot import EngineView, FleetSnapshot
from store.types import VersionConstraint
from wire import Precision

_RANDOM = random.Random()


def place(
    snap: FleetSnapshot,
    run_id: str,
    constraint: VersionConstraint,
    *,
    current: str | None,
    precisions: Collection[Precision] | None,
    placed: Mapping[str, int],
    local_in_flight: Mapping[str, int],
    exclude: Collection[str] = (),
    now: float,
    rng: random.Random | None = None,
) -> EngineView | None:
    """The engine for a session's next turn, or None when no engine is eligible.

    `placed` counts the live sessions on each engine; `current` is the session's engine.
    """
    engines = eligible(snap, run_id, constraint, precisions=precisions, exclude=exclude, now=now)
    if not engines:
        return None
    for engine in engines:
        if engine.engine_id == current:
            return engine
    draw = rng or _RANDOM

    def load(engine: EngineView) -> tuple[float, float, float]:
        sessions = placed.get(engine.engine_id, 0) / engine.capacity
        busy = (engine.in_flight + local_in_flight.get(engine.engine_id, 0)) / engine.capacity
        # Ties (an idle fleet) are broken at random, not by id, so no engine is favoured.
        return sessions, busy, draw.random()

    return min(engines, key=load)
