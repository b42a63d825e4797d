"""`Agent`: one engine agent process, composed from its parts.

Owns the process lifecycle: find out what the engine serves, open the versioned proxy,
register with the control plane (when there is one), then run side by side until SIGTERM /
SIGINT or a terminal failure:

- the reconciler (`engine_agent.reconciler`), which stages and commits versions;
- the heartbeat loop (applied version, sync state, staging, in-flight, last error), which
  registers again when the control plane answers 404 and sends at once on every change;
- the target long-poll, which hands the control plane's assignment to the reconciler;
- the engine monitor, which takes the engine out of routing while it does not answer.

On the way out it deregisters. `run()` returns the exit code: 0 after a signal,
`EXIT_UNRECOVERABLE` after a failed commit, `EXIT_STARTUP` if the engine never answered.
Must never implement staging, admission or forwarding itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import socket
import time
from collections.abc import Callable, Iterator
from email.utils import formatdate
from typing import Any

import uvicorn
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_never,
    wait_exponential,
)

from engine_agent.control_client import ControlClient
from engine_agent.engines.base import Engine, ModelInfo
from engine_agent.engines.sglang import SGLangEngine
from engine_agent.engines.vllm import VLLMEngine
from engine_agent.errors import (
    AgentError,
    ControlPlaneUnavailable,
    EngineIncompatible,
    EngineNotRegistered,
    EngineUnreachable,
    UnrecoverableEngineError,
)
from engine_agent.gate import AdmissionGate
from engine_agent.metrics import GC_OBSERVER
from engine_agent.peer_fetch import PeerFetch
from engine_agent.peer_server import PeerServer
from engine_agent.proxy import VersionedProxy
from engine_agent.reconciler import Reconciler
from engine_agent.settings import AgentSettings
from engine_agent.staging import Stager
from engine_agent.status import AgentStatus
from runtime import collector
from store.store import Store
from wire import EngineKind, EngineRegister

log = logging.getLogger(__name__)

EXIT_STARTUP = 1
EXIT_UNRECOVERABLE = 3
ENGINE_START_DEADLINE_S = 300.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (the agent owns SIGTERM/SIGINT) and without
    its tick: uvicorn wakes every 0.1 s to look for an exit and refresh the Date header,
    which in a process of a thousand agents (the fleet benchmark) is 10,000 wake-ups a
    second. Here the exit is an event (`stop`) and the Date header a timer once a second."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exit = asyncio.Event()
        self._date: asyncio.TimerHandle | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def stop(self) -> None:
        """Stop serving: the listening socket closes, requests in flight finish."""
        self.should_exit = True
        self._exit.set()

    async def main_loop(self) -> None:
        self._refresh_date()
        try:
            await self._exit.wait()
        finally:
            if self._date is not None:
                self._date.cancel()

    def _refresh_date(self) -> None:
        date = formatdate(time.time(), usegmt=True).encode()
        headers = self.config.encoded_headers
        self.server_state.default_headers = (
            [(b"date", date), *headers] if self.config.date_header else list(headers)
        )
        self._date = asyncio.get_running_loop().call_later(1.0, self._refresh_date)


class Agent:
    """The sidecar of one engine; build with settings, then `await run()`."""

    def __init__(
        self,
        settings: AgentSettings,
        engine: Engine | None = None,
        *,
        store: Store | None = None,
        control: ControlClient | None = None,
    ) -> None:
        """`engine`, `store` and `control` default to what `settings` name; passing them
        lets many agents in one process share a store client (the fleet benchmark)."""
        self.settings = settings
        self.engine = engine or make_engine(settings)
        # Peer-assisted fetch needs the control plane (plans, token checks); the fetched
        # files are then kept, verified, in the work dir to serve them to peers (a store
        # passed in serves peers only if it has a cache folder).
        peers = settings.peer_fetch and bool(settings.control_planes or control)
        self.store = store or Store(
            settings.store, cache_dir=settings.work_dir / "peer-files" if peers else None
        )
        self.status = AgentStatus()
        self.gate = AdmissionGate(
            None, wait_s=settings.admission_wait_s, on_reject=lambda _c: self.reconciler.wake()
        )
        self.control = control or (
            ControlClient(settings.control_planes, settings.token)
            if settings.control_planes
            else None
        )
        self.engine_id: str | None = None
        self.heartbeat_interval_s = 2.0
        self.lease_seconds = 10.0
        self._beat = asyncio.Event()
        self._stop = asyncio.Event()
        self._registered = asyncio.Event()
        self.reconciler = Reconciler(
            engine=self.engine,
            gate=self.gate,
            store=self.store,
            stager=Stager(settings.work_dir, settings.precision.value, settings.boot_model),
            status=self.status,
            run_id=settings.run,
            pause_mode=settings.pause_mode,
            exact_drain_s=settings.exact_drain_s,
            quiesce_drain_s=settings.quiesce_drain_s,
            poll_s=settings.pointer_poll_s,
            retry_initial_s=settings.retry_initial_s,
            retry_max_s=settings.retry_max_s,
            follow_control_plane=self.control is not None,
            on_change=self._changed,
        )
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((settings.host, settings.port))
        self.url = settings.advertise_url or f"http://{settings.host}:{self.sock.getsockname()[1]}"
        self.proxy = VersionedProxy(
            engine_url=settings.engine_url,
            gate=self.gate,
            status=self.status,
            precision=settings.precision,
            run_id=settings.run,
            server_info=self.server_info,
            on_engine_error=self._engine_down,
            dialect=self.engine.dialect,
            connections=settings.engine_connections,
        )
        self.peer_server: PeerServer | None = None
        if peers and self.store.cache is not None and self.control is not None:
            self.peer_server = PeerServer(
                cache=self.store.cache,
                run_id=settings.run,
                status=self.status,
                role_of=self.control.token_role,
                expecting=self._expecting,
                max_wait_s=settings.peer_wait_s,
                upload_slots=settings.peer_upload_slots,
                upload_bytes_per_s=settings.peer_upload_bytes_per_s,
                stall_s=settings.peer_stall_s,
                chunk_bytes=settings.peer_chunk_bytes,
            )
            self.proxy.extra_routes.append(self.peer_server.install)
            self.reconciler.on_commit = self._prune_peer_files
        if peers or settings.fetch_sources:
            self.reconciler.fetch = PeerFetch(
                control=self.control,
                engine_id=lambda: self.engine_id,
                registered=self._registered,
                own_url=self.url,
                token=settings.token,
                status=self.status,
                configured=settings.fetch_sources,
                peers=peers,
                wait_s=settings.peer_wait_s,
                stall_s=settings.peer_stall_s,
                min_bytes_per_s=settings.peer_min_bytes_per_s,
                first_plan_wait_s=settings.peer_first_plan_wait_s,
            )

    # ---- reporting -----------------------------------------------------------------------

    def server_info(self) -> dict[str, Any]:
        status = self.status
        passes = [p.as_dict() for p in status.passes]
        return {
            "agent_url": self.url,
            "engine_url": self.settings.engine_url,
            "engine_id": self.engine_id,
            "engine_kind": self.engine.kind,
            "run_id": self.settings.run,
            "precision": self.settings.precision.value,
            "pause_mode": self.settings.pause_mode.value,
            "applied_version": status.applied_version,
            "served_version": self.gate.served_version,
            "target_version": self.reconciler.assigned,
            "sync_state": status.sync_state.value,
            "caught_up": status.caught_up,
            "staging_target": status.staging_target,
            "staging_progress": round(status.staging_progress, 4),
            "last_error": status.last_error,
            "reconcile_failures": dict(status.failures),
            "control_plane": self.control.url if self.control is not None else None,
            "engine_reachable": status.engine_reachable,
            "in_flight": self.gate.in_flight,
            "admission_open": self.gate.is_open,
            "last_pass": passes[-1] if passes else None,
            "passes": passes,
            "uptime_s": round(time.time() - status.started_at, 3),
        }

    async def _changed(self) -> None:
        self._beat.set()

    def _engine_down(self, message: str) -> None:
        if self.status.engine_reachable:
            log.error("engine out of service: %s", message)
        self.status.engine_reachable = False
        self.status.last_error = f"EngineUnreachable: {message}"
        self._beat.set()

    # ---- peer-assisted fetch ---------------------------------------------------------------

    def _expecting(self, version: int) -> bool:
        """Whether this agent will soon hold `version`'s files (a peer may wait for them):
        it does not hold the version yet, and its running pass downloads it, or has not
        planned yet (the control plane names a peer only when it is heading there)."""
        if self.status.terminal:
            return False
        applied = self.status.applied_version
        if applied is not None and version <= applied:
            return False
        fetching = self.reconciler.fetching
        return fetching is None or version in fetching

    def _prune_peer_files(self, applied: int) -> None:
        if self.peer_server is not None:
            self.peer_server.prune(applied, self.settings.peer_keep_versions)

    # ---- startup -------------------------------------------------------------------------

    async def _boot(self) -> None:
        """Learn what the engine serves; label it with the boot version if one was given."""
        deadline = time.monotonic() + ENGINE_START_DEADLINE_S
        while True:
            try:
                # The check first: a wrong kind of engine answers the info route with 404.
                await self.engine.check()
                info = await self.engine.info()
                break
            except EngineUnreachable as exc:
                if time.monotonic() > deadline:
                    raise
                log.info("waiting for the engine: %s", exc)
                await asyncio.sleep(1.0)
        boot = await self._label_boot(info)
        self.status.applied_version = boot
        await self.gate.reopen(boot)
        if boot is not None and self.settings.boot_model is not None:
            tensors = await asyncio.to_thread(_canonical_boot_tensors, self.settings)
            if tensors is not None:
                self.reconciler.hold(boot, tensors)
        log.info(
            "engine %s serves v%s (%s) for run %s",
            self.settings.engine_url,
            boot,
            self.settings.precision.value,
            self.settings.run,
        )

    async def _label_boot(self, info: ModelInfo) -> int | None:
        """The version an engine fresh from its boot checkpoint serves; with a configured
        boot version, label the engine with it."""
        boot = self.settings.boot_version
        if boot is not None:
            if info.weight_version != str(boot):
                await self.engine.relabel(boot)
            return boot
        try:
            return int(info.weight_version)
        except ValueError:
            return None

    # ---- control plane -------------------------------------------------------------------

    async def _register(self) -> None:
        assert self.control is not None
        body = EngineRegister(
            url=self.url,
            run_id=self.settings.run,
            precision=self.settings.precision,
            engine_kind=EngineKind(self.engine.kind),
            accelerator=self.settings.accelerator,
            capacity=self.settings.capacity,
            labels=self.settings.labels,
            applied_version=self.status.applied_version,
            sync_state=self.status.sync_state,
        )
        reply = await self.control.register(body)
        self.engine_id = reply.engine_id
        self._registered.set()
        self.heartbeat_interval_s = reply.heartbeat_interval_s
        self.lease_seconds = reply.lease_seconds
        log.info("registered as engine %s at %s", reply.engine_id, self.control.url)
        self.reconciler.assign(reply.target_version)

    def _forget(self, engine_id: str | None) -> None:
        """The control plane answered 404 for `engine_id`: register again at once (unless
        the heartbeat loop has registered a new id meanwhile)."""
        if engine_id is not None and engine_id == self.engine_id:
            log.warning("control plane forgot engine %s; registering again", engine_id)
            self.engine_id = None
            # A fetch plan asked for meanwhile waits for the new id (`PeerFetch`).
            self._registered.clear()
            self._beat.set()

    def _control_plane_answers(self, answers: bool) -> None:
        """While no control plane answers, the reconciler follows the store pointer."""
        if answers != self.reconciler.control_plane_reachable:
            self.reconciler.control_plane_reachable = answers
            if not answers:
                log.warning("no control plane answers; following the store pointer meanwhile")
            self.reconciler.wake()

    async def _heartbeats(self) -> None:
        """Beat every `heartbeat_interval_s` (sooner when poked); while the control plane is
        unreachable, retry with exponential backoff from 0.5 s up to 10 s."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(ControlPlaneUnavailable),
            wait=self._heartbeat_backoff,
            sleep=self._until_beat,  # a poke (state change) cuts a backoff short
            before_sleep=self._heartbeat_failed,
            stop=stop_never,
        )
        while True:
            await retrying(self._beat_once)
            # A little sooner than asked, by a random amount: engines that registered or
            # changed state together (a control plane back after an outage, a version
            # landing everywhere) drift apart instead of beating in lockstep; never later,
            # so the lease math is untouched.
            await self._until_beat(self.heartbeat_interval_s * random.uniform(0.8, 1.0))

    def _heartbeat_backoff(self, state: RetryCallState) -> float:
        """Exponential from 0.5 s up to 10 s, and within a third of the lease, so a control
        plane that comes back (e.g. after a database outage) hears from this engine before
        its lease lapses."""
        return min(_HEARTBEAT_BACKOFF(state), self.lease_seconds / 3)

    def _heartbeat_failed(self, state: RetryCallState) -> None:
        _log_heartbeat_failure(state)
        self._control_plane_answers(False)

    async def _beat_once(self) -> None:
        """One heartbeat (registering first if needed); follows the target it answers."""
        assert self.control is not None
        while True:
            engine_id = self.engine_id
            try:
                if engine_id is None:
                    await self._register()
                    engine_id = self.engine_id
                reply = await self.control.heartbeat(
                    engine_id or "", self.status.heartbeat(self.gate.in_flight)
                )
            except EngineNotRegistered:
                self._forget(engine_id)
                continue
            self._control_plane_answers(True)
            if reply.target_version != self.reconciler.assigned:
                self.reconciler.assign(reply.target_version)
            return

    async def _until_beat(self, seconds: float) -> None:
        """Wait `seconds`, or less if something pokes the heartbeat."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._beat.wait()
        self._beat.clear()

    async def _targets(self) -> None:
        assert self.control is not None
        while True:
            engine_id = self.engine_id
            if engine_id is None:
                await asyncio.sleep(0.2)
                continue
            try:
                reply = await self.control.wait_target(
                    engine_id, self.reconciler.assigned, self.settings.long_poll_s
                )
            except EngineNotRegistered:
                # Not after the heartbeat's backoff: routing misses this engine until then.
                self._forget(engine_id)
                continue
            except ControlPlaneUnavailable as exc:
                log.info("target long-poll: %s", exc)
                await asyncio.sleep(1.0)
                continue
            if reply.changed:
                self.reconciler.assign(reply.target_version)

    # ---- engine --------------------------------------------------------------------------

    async def _monitor_engine(self) -> None:
        while True:
            await asyncio.sleep(self.settings.engine_probe_s)
            if not self.gate.is_open:
                continue  # a commit is talking to the engine; it reports its own failures
            applied = self.status.applied_version
            try:
                info = await self.engine.info()
            except AgentError as exc:
                self._engine_down(str(exc))
                continue
            if not self.gate.is_open or self.status.applied_version != applied:
                continue  # a commit ran meanwhile: the label read may predate it
            relabelled = applied is not None and info.weight_version != str(applied)
            if not self.status.engine_reachable or relabelled:
                # Back after a failure, or restarted between two probes (another label).
                await self._engine_back(info)

    async def _engine_back(self, info: ModelInfo) -> None:
        """The engine answers again. Labelled as before, it kept its weights; otherwise it
        restarted from its boot checkpoint: serve that, and let the reconciler commit the
        target again (its held tensors stay a valid base for any version)."""
        applied = self.status.applied_version
        log.info("engine answers again (label %s)", info.weight_version)
        if info.weight_version != str(applied):
            try:
                served = await self._label_boot(info)
            except AgentError as exc:
                self._engine_down(f"relabelling the restarted engine failed: {exc}")
                return
            log.warning(
                "engine restarted: it serves v%s (its boot checkpoint), not v%s; catching up",
                served,
                applied,
            )
            self.status.applied_version = served
            await self.gate.reopen(served)
        self.status.engine_reachable = True
        self.status.last_error = None
        self.reconciler.retry_now()
        self._beat.set()

    # ---- lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask `run()` to deregister and return, as SIGTERM does."""
        self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        # Warmed beside the engine's load, which takes far longer (`store/codecs/warm.py`).
        warming = asyncio.create_task(self._warm_codecs(), name="warm codecs")
        boot = asyncio.create_task(self._boot(), name="boot")
        stop = asyncio.create_task(self._stop.wait(), name="stop")
        await asyncio.wait({boot, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not boot.done():
            boot.cancel()
            log.info("stopped before the engine answered")
            return 0
        await warming
        try:
            boot.result()
        except EngineIncompatible as exc:
            stop.cancel()
            log.error("cannot serve this engine: %s", exc)
            return EXIT_STARTUP
        except AgentError as exc:
            stop.cancel()
            log.error("engine at %s never answered: %s", self.settings.engine_url, exc)
            return EXIT_STARTUP
        # Booted: what exists now (imports above all) is never garbage (`runtime.collector`).
        GC_OBSERVER.install()
        if self.settings.gc_settle:
            collector.settle(spaced=False, collect_first=True)
        try:
            return await self._serve(stop)
        finally:
            if self.settings.gc_settle:
                collector.unsettle()

    async def _warm_codecs(self) -> None:
        """Load the decoders' and this precision's converters' imports and kernels now
        rather than in the first catch-up; a failure is logged, and that catch-up pays
        (and reports) it instead."""
        if not self.settings.warm_codecs:
            return
        from engine_agent.precision.warm import warm_conversion
        from store.codecs.warm import warm_decoders

        precision = self.settings.precision.value
        self.status.codecs_warmed_s = await self._warm("the codecs", warm_decoders)
        self.status.conversion_warmed_s = await self._warm(
            f"conversion to {precision}", lambda: warm_conversion(precision)
        )

    async def _warm(self, what: str, warm: Callable[[], float]) -> float | None:
        """`warm()`'s seconds, run in a thread; None (and a warning) if it failed."""
        try:
            seconds = await asyncio.to_thread(warm)
        except Exception as exc:  # warming is an optimisation, never fatal
            log.warning("warming %s failed: %s: %s", what, type(exc).__name__, exc)
            return None
        log.info("warmed %s in %.2fs", what, seconds)
        return seconds

    async def _serve(self, stop: asyncio.Task[Any]) -> int:
        """Serve until stopped or a task fails; the exit code."""
        config = uvicorn.Config(
            self.proxy.app(),
            log_level="warning",
            access_log=False,
            lifespan="off",
            # Nothing here reads the client's address; checking X-Forwarded-For against the
            # trusted hosts parses IP addresses on every request (and every peer upload).
            proxy_headers=False,
        )
        server = _Server(config)
        tasks = {asyncio.create_task(server.serve(sockets=[self.sock]), name="proxy")}
        await asyncio.to_thread(self.reconciler.stager.remove_scratch)
        tasks.add(asyncio.create_task(self.reconciler.run(), name="reconciler"))
        tasks.add(asyncio.create_task(self._monitor_engine(), name="engine monitor"))
        if self.control is not None:
            tasks.add(asyncio.create_task(self._heartbeats(), name="heartbeats"))
            tasks.add(asyncio.create_task(self._targets(), name="targets"))
        log.info("engine agent for %s listening on %s", self.settings.engine_url, self.url)
        code = 0
        try:
            done, _ = await asyncio.wait({stop, *tasks}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is stop or task.cancelled():
                    continue
                failure = task.exception()
                if isinstance(failure, UnrecoverableEngineError):
                    log.error("terminal %s: %s", type(failure).__name__, failure)
                    code = EXIT_UNRECOVERABLE
                elif failure is not None:
                    log.error("%s failed", task.get_name(), exc_info=failure)
                    code = EXIT_UNRECOVERABLE
        finally:
            await self._shutdown(server, tasks | {stop})
        return code

    async def _shutdown(self, server: _Server, tasks: set[asyncio.Task[Any]]) -> None:
        log.info("shutting down")
        started = time.perf_counter()
        if self.control is not None and self.engine_id is not None:
            try:
                await self.control.deregister(self.engine_id)
                log.info("deregistered engine %s", self.engine_id)
            except ControlPlaneUnavailable as exc:
                log.warning("could not deregister (the lease will lapse): %s", exc)
        server.stop()
        for task in tasks:
            if task.get_name() != "proxy":
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.proxy.close()
        await self.engine.close()
        if self.control is not None:
            await self.control.close()
        if self.reconciler.fetch is not None:
            self.reconciler.fetch.close()
        log.info("stopped in %.2fs", time.perf_counter() - started)


_HEARTBEAT_BACKOFF = wait_exponential(multiplier=0.5, max=10.0)


def _log_heartbeat_failure(state: RetryCallState) -> None:
    failure = state.outcome.exception() if state.outcome is not None else None
    log.warning("heartbeat failed: %s", failure)


def make_engine(settings: AgentSettings) -> Engine:
    """The engine adapter for `settings.engine_kind`."""
    adapter = VLLMEngine if settings.engine_kind is EngineKind.VLLM else SGLangEngine
    return adapter(settings.engine_url, load_timeout_s=settings.engine_load_timeout_s)


def _canonical_boot_tensors(settings: AgentSettings) -> dict[str, Any] | None:
    """The boot folder's tensors as canonical `RawTensor`s when it is BF16 (else None)."""
    from engine_agent.precision.checkpoint import read_config, read_tensors
    from store.torch_bridge import state_dict_to_raw

    assert settings.boot_model is not None
    if "quantization_config" in read_config(settings.boot_model):
        return None
    return state_dict_to_raw(read_tensors(settings.boot_model))
