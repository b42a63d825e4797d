"""The HTTP surface of agent sessions (`docs/sessions.md`).

Owns the routes and their roles: `POST /v1/sessions` (create), `POST
/v1/sessions/{id}/chat/completions` (one turn; OpenAI's SDK reaches it with
`base_url = <control plane>/v1/sessions/{id}`), `GET /v1/sessions/{id}` (status),
`GET /v1/sessions/{id}/trajectory` and `DELETE /v1/sessions/{id}` (end). Every route
needs a client or trainer token (or an admin's); a session is visible only to the token
that created it (and admins). Business rules live in `chat_sessions.py`; never logs a
token.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from controlplane.auth import CALLERS
from controlplane.chat_sessions import ChatSessions
from controlplane.services import Services
from wire import Role, SessionCreate, SessionInfo, Trajectory

RoleDependency = Callable[[frozenset[Role]], Callable[..., Coroutine[Any, Any, Role]]]

CHAT_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "description": "An OpenAI chat-completions body: `messages` repeats the "
                    "session's recorded turns exactly and adds new messages; `tools`, "
                    "`max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `logprobs` are "
                    "read. `stream` and `n` > 1 are refused.",
                    "properties": {"messages": {"type": "array", "items": {"type": "object"}}},
                    "required": ["messages"],
                    "additionalProperties": True,
                }
            }
        },
    }
}


def install(app: FastAPI, cp: Services, role: RoleDependency) -> ChatSessions:
    """Add the session routes to `app`; the returned service holds the sessions."""
    chat = ChatSessions(cp)

    async def caller(request: Request, found: Role = Depends(role(CALLERS))) -> str | None:
        """The creating credential a session is bound to (None: an admin, who sees all)."""
        return cp.tokens.owner_key(request.headers.get("authorization"), found)

    @app.post("/v1/sessions", response_model=SessionInfo, status_code=201, tags=["sessions"])
    async def create_session(
        body: SessionCreate, owner: str | None = Depends(caller)
    ) -> SessionInfo:
        """Open a session on the least-loaded eligible engine of the run."""
        return await chat.create(body, owner)

    @app.post(
        "/v1/sessions/{session_id}/chat/completions",
        tags=["sessions"],
        openapi_extra=CHAT_BODY,
    )
    async def session_turn(
        session_id: str, request: Request, owner: str | None = Depends(caller)
    ) -> Response:
        """One turn: an OpenAI chat.completion plus a `tether` object (turn, engine,
        precision, weight versions, token counts)."""
        try:
            raw = await request.body()
        except ClientDisconnect:
            return Response(status_code=499)
        return JSONResponse(await chat.turn(session_id, raw, owner))

    @app.get("/v1/sessions/{session_id}", response_model=SessionInfo, tags=["sessions"])
    async def session_status(session_id: str, owner: str | None = Depends(caller)) -> SessionInfo:
        return await chat.status(session_id, owner)

    @app.get("/v1/sessions/{session_id}/trajectory", response_model=Trajectory, tags=["sessions"])
    async def session_trajectory(
        session_id: str, owner: str | None = Depends(caller)
    ) -> Trajectory:
        """Every turn's exact ids, and the episode as ids + loss mask + sampler logprobs."""
        return await chat.trajectory(session_id, owner)

    @app.delete("/v1/sessions/{session_id}", response_model=SessionInfo, tags=["sessions"])
    async def end_session(session_id: str, owner: str | None = Depends(caller)) -> SessionInfo:
        """End the session; its trajectory stays readable until it expires."""
        return await chat.end(session_id, owner)

    return chat
