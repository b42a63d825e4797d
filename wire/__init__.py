"""The wire contract between the control plane, the engine agent and the trainer's clients.

Every request and response body as a pydantic model, and the header names, one module per
concept (`engines`, `runs`, `fleet`, `tokens`, `routing`, `sessions`, `errors`, `headers`,
`health`). Both sides import this package; it imports pydantic and the store vocabulary
only, never FastAPI, SQLAlchemy or another Tether package, so clients stay light and never
depend on the server.
Tether's own bodies reject unknown fields.
"""

from __future__ import annotations

from wire.body import (
    MAX_INT,
    TetherModel,
    Version,
)
from wire.engines import (
    SERVING_STATES,
    EngineInfo,
    EngineKind,
    EngineList,
    EngineRegister,
    EngineRegistered,
    FetchReport,
    Heartbeat,
    HeartbeatReply,
    Precision,
    SyncState,
    TargetReply,
)
from wire.errors import (
    ErrorBody,
    ErrorDetail,
    PrecisionNotServedDetail,
    WeightVersionNotReadyDetail,
    WeightVersionUnavailableDetail,
)
from wire.fleet import (
    GapAccepted,
    GapReport,
    PrecisionGap,
    SpreadFigures,
    VersionConvergence,
    VersionLagFigures,
)
from wire.headers import (
    ENGINE_ID_HEADER,
    RUN_HEADER,
    SESSION_HEADER,
    SESSION_ID_MAX,
    SESSION_ID_PATTERN,
    VERSION_END_HEADER,
    VERSION_START_HEADER,
)
from wire.health import (
    Health,
)
from wire.routing import (
    RouteAnswer,
    RouteCandidate,
    RouteSet,
    RoutingFields,
    WeightVersionSpec,
)
from wire.runs import (
    PolicyKind,
    RunCreate,
    RunInfo,
    RunList,
    TargetPolicy,
    VersionInfo,
    VersionList,
    VersionNotify,
)
from wire.sessions import (
    DEFAULT_SESSION_TTL_S,
    SessionCreate,
    SessionInfo,
    SessionState,
    SessionVersion,
    Trajectory,
    TurnInfo,
    TurnRecord,
)
from wire.tokens import (
    Role,
    TokenCreate,
    TokenCreated,
)

__all__ = [
    "DEFAULT_SESSION_TTL_S",
    "ENGINE_ID_HEADER",
    "MAX_INT",
    "RUN_HEADER",
    "SERVING_STATES",
    "SESSION_HEADER",
    "SESSION_ID_MAX",
    "SESSION_ID_PATTERN",
    "VERSION_END_HEADER",
    "VERSION_START_HEADER",
    "EngineInfo",
    "EngineKind",
    "EngineList",
    "EngineRegister",
    "EngineRegistered",
    "ErrorBody",
    "ErrorDetail",
    "FetchReport",
    "GapAccepted",
    "GapReport",
    "Health",
    "Heartbeat",
    "HeartbeatReply",
    "PolicyKind",
    "Precision",
    "PrecisionGap",
    "PrecisionNotServedDetail",
    "Role",
    "RouteAnswer",
    "RouteCandidate",
    "RouteSet",
    "RoutingFields",
    "RunCreate",
    "RunInfo",
    "RunList",
    "SessionCreate",
    "SessionInfo",
    "SessionState",
    "SessionVersion",
    "SpreadFigures",
    "SyncState",
    "TargetPolicy",
    "TargetReply",
    "TetherModel",
    "TokenCreate",
    "TokenCreated",
    "Trajectory",
    "TurnInfo",
    "TurnRecord",
    "Version",
    "VersionConvergence",
    "VersionInfo",
    "VersionLagFigures",
    "VersionList",
    "VersionNotify",
    "WeightVersionNotReadyDetail",
    "WeightVersionSpec",
    "WeightVersionUnavailableDetail",
]
