"""A stand-in for an engine behind its agent: a tiny HTTP server for tests and benchmarks.

It serves SGLang's generate paths (`/generate`, `/v1/completions`, `/v1/chat/completions`)
the way the engine agent's versioned proxy does: the request's `weight_version` constraint
is checked against the served version at admission, a miss answers 409
`WeightVersionNotReady` (retryable), and answers carry `weight_version_start`/`_end`. A
version flip waits until in-flight requests finish, so start and end always agree here.
A test moves the served version with `POST /control/version {"version": n}`; a streamed
answer can be slowed (`chunks`, `chunk_delay_s` body fields) and `/stats` counts streams
whose client left early. With
`--controlplane` it registers itself and heartbeats like an agent.

Run: `python -m tests.standins.engine --port 8001 --version 3 [--controlplane URL ...]`.
It is raw ASGI on uvicorn so that, in the router benchmark, the engine costs little.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from typing import Any

log = logging.getLogger("standin")


class Standin:
    def __init__(self, version: int, precision: str, delay_s: float) -> None:
        self.version = version
        self.precision = precision
        self.delay_s = delay_s
        self.in_flight = 0
        self.served = 0
        self.streaming = 0
        self.streams_abandoned = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._flipping = asyncio.Event()
        self._flipping.set()  # set = no flip in progress
        self.version_changed = asyncio.Event()

    async def set_version(self, version: int) -> None:
        self._flipping.clear()
        try:
            await self._idle.wait()
            self.version = version
        finally:
            self._flipping.set()
        self.version_changed.set()

    def admits(self, spec: Any) -> bool:
        if not isinstance(spec, dict):
            return True
        exact, low = spec.get("exact_version"), spec.get("min_version")
        if exact is not None:
            return self.version == exact
        return low is None or self.version >= low

    async def generate(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        await self._flipping.wait()
        spec = body.get("weight_version")
        if not self.admits(spec):
            return 409, {
                "error": {
                    "type": "WeightVersionNotReady",
                    "retryable": True,
                    "message": f"engine serves v{self.version}",
                    "requested": spec,
                    "latest_version": None,
                    "fleet_versions": {},
                }
            }
        start = self.version
        self.in_flight += 1
        self._idle.clear()
        try:
            delay = body.get("delay_s", self.delay_s)
            if delay:
                await asyncio.sleep(float(delay))
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
        self.served += 1
        return 200, {
            "text": "ok",
            "meta_info": {"weight_version": str(start), "completion_tokens": 1},
            "weight_version_start": start,
            "weight_version_end": self.version,
        }


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send_json(send: Any, status: int, payload: Any, extra: list | None = None) -> None:
    data = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": data})


async def _until_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _stream(
    state: Standin, payload: dict[str, Any], body: dict[str, Any], receive: Any, send: Any
) -> None:
    """Server-sent events: `chunks` events (3 unless asked), `chunk_delay_s` apart, then
    [DONE]. A client that leaves mid-stream is noticed and counted, and the stream stops."""
    start = str(payload["weight_version_start"]).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream"),
                (b"x-tether-weight-version-start", start),
            ],
        }
    )
    delay = float(body.get("chunk_delay_s", 0.0))
    gone = asyncio.ensure_future(_until_disconnect(receive))
    state.streaming += 1
    try:
        for i in range(int(body.get("chunks", 3))):
            if delay:
                await asyncio.wait({gone}, timeout=delay)
            if gone.done():
                state.streams_abandoned += 1
                return
            chunk = dict(payload, text=f"t{i}")
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                    "more_body": True,
                }
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    finally:
        state.streaming -= 1
        gone.cancel()


def make_app(state: Standin) -> Any:
    generate_paths = {"/generate", "/v1/completions", "/v1/chat/completions"}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        raw = await _read_body(receive)
        if path in generate_paths and scope["method"] in ("POST", "PUT"):
            body = json.loads(raw or b"{}")
            status, payload = await state.generate(body)
            if status == 200 and body.get("stream"):
                await _stream(state, payload, body, receive, send)
                return
            await _send_json(send, status, payload)
        elif path == "/control/version" and scope["method"] == "POST":
            await state.set_version(int(json.loads(raw)["version"]))
            await _send_json(send, 200, {"version": state.version})
        elif path in ("/health", "/health_generate", "/readiness", "/liveness"):
            await _send_json(send, 200, {"status": "ok"})
        elif path in ("/get_model_info", "/model_info"):
            await _send_json(
                send, 200, {"model_path": "standin", "weight_version": str(state.version)}
            )
        elif path == "/v1/models":
            await _send_json(send, 200, {"object": "list", "data": [{"id": "standin"}]})
        elif path == "/get_server_info":
            await _send_json(send, 200, {"version": "standin"})
        elif path == "/stats":
            stats = {
                "version": state.version,
                "served": state.served,
                "streaming": state.streaming,
                "streams_abandoned": state.streams_abandoned,
            }
            await _send_json(send, 200, stats)
        else:
            await _send_json(send, 404, {"error": {"message": f"no route {path}"}})

    return app


async def _agent(state: Standin, args: argparse.Namespace) -> None:
    """Register with the control plane and heartbeat, like the engine agent would."""
    import httpx

    headers = {"Authorization": f"Bearer {args.token}"}
    async with httpx.AsyncClient(base_url=args.controlplane, headers=headers) as client:
        engine_id = None
        while True:
            try:
                engine_id = await _beat(client, state, args, engine_id)
            except httpx.HTTPError as exc:
                # The agent keeps trying: a slow or restarting control plane is not fatal.
                # Like the agent, register again only when told the engine is unknown (404).
                print(f"heartbeat failed: {exc!r}", flush=True)
            state.version_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(state.version_changed.wait(), args.heartbeat_s)


async def _beat(
    client: Any, state: Standin, args: argparse.Namespace, engine_id: str | None
) -> str | None:
    if engine_id is None:
        reply = await client.post(
            "/v1/engines",
            json={
                "url": f"http://127.0.0.1:{args.port}",
                "run_id": args.run_id,
                "precision": state.precision,
                "capacity": args.capacity,
                "applied_version": state.version,
                "sync_state": "ready",
            },
        )
        reply.raise_for_status()
        engine_id = reply.json()["engine_id"]
        print(f"REGISTERED {engine_id}", flush=True)
    beat = await client.post(
        f"/v1/engines/{engine_id}/heartbeat",
        json={
            "applied_version": state.version,
            "sync_state": "ready",
            "in_flight": state.in_flight,
        },
    )
    if beat.status_code == 404:
        return None
    beat.raise_for_status()
    return engine_id


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    state = Standin(args.version, args.precision, args.delay_s)
    config = uvicorn.Config(
        make_app(state),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        http="httptools",
        loop="uvloop",
    )
    server = uvicorn.Server(config)
    tasks = [asyncio.create_task(server.serve())]
    if args.controlplane:
        tasks.append(asyncio.create_task(_agent(state, args)))
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        task.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--version", type=int, default=0)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--controlplane", default=None, help="control plane URL to join")
    parser.add_argument("--token", default="")
    parser.add_argument("--run-id", default="run")
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
