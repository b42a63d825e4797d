"""`run_demo`: the whole demo, from an empty work dir to the closing JSON line.

Owns the sequence: models → control plane → Publisher.claim (boot version v0) → engines
and agents → training steps → convergence check → summary. Each step samples rollouts
through the router with a bounded lag (`max_lag`), checks every answer's stamped versions
against its constraint, trains one GRPO/MIS step, publishes the next version and reads the
fleet's state. Every child process is stopped on the way out, whatever happens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from rich.console import Console

from demo.local_fleet import (
    EngineWithAgent,
    LocalControlPlane,
    prepare_models,
    start_controlplane,
    start_engines,
)
from demo.report import DemoTotals, StepRecord, print_header, print_step, print_summary
from demo.settings import PRECISIONS, DemoSettings
from demo.task import Problem, reward, sample_problems
from launcher.processes import ProcessGroup

log = logging.getLogger(__name__)

CONVERGE_DEADLINE_S = 60.0
# How long the training loop has to unwind after Ctrl-C before the processes are stopped.
UNWIND_GRACE_S = 10.0
T = TypeVar("T")


class PauseCounter:
    """Counts engine commits (pauses) from the agents' recent pass timings, once each."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int, float]] = set()

    def new_pauses(self, fleet: Sequence[EngineWithAgent]) -> tuple[int, float]:
        count, seconds = 0, 0.0
        for member in fleet:
            info = member.server_info() or {}
            for p in info.get("passes") or []:
                key = (member.agent.name, int(p.get("target", -1)), p.get("finished_at") or 0.0)
                if p.get("finished_at") is None or key in self.seen:
                    continue
                self.seen.add(key)
                if float(p.get("pause_s") or 0.0) > 0:
                    count += 1
                    seconds += float(p["pause_s"])
        return count, seconds


def fleet_versions(cp: LocalControlPlane, run_id: str) -> dict[str, int | None]:
    """Applied version per engine, keyed `precision@engine_id`."""
    return {
        f"{e['precision']}@{e['engine_id'][:8]}": e["applied_version"] for e in cp.engines(run_id)
    }


def wait_converged(
    cp: LocalControlPlane, run_id: str, version: int, engines: int
) -> dict[str, Any]:
    """Until every engine serves `version` (or the deadline); the last view of the fleet."""
    end = time.monotonic() + CONVERGE_DEADLINE_S
    while True:
        view = fleet_versions(cp, run_id)
        done = len(view) >= engines and all(v == version for v in view.values())
        if done or time.monotonic() > end:
            return {"engines_converged": done, "final_versions": view}
        time.sleep(0.2)  # polling interval while agents apply the last version


@dataclass
class Batch:
    """One step's rollouts: each problem with its group, and what it took to get them."""

    groups: list[tuple[Problem, list[Any]]] = field(default_factory=list)
    failed: int = 0
    violations: int = 0
    retries_409: int = 0
    retries: int = 0


async def sample_batch(
    client: Any, learner: Any, rng: random.Random, settings: DemoSettings, step: int
) -> Batch:
    """Rollouts for one step through the router, `max_lag` behind the latest at most.

    A group with a failed member is dropped (GRPO needs whole groups). Every answer's
    stamped versions are checked against the constraint it was sent with."""
    from trainer_client.rollout_client import ConstraintViolated, RolloutError

    problems = sample_problems(rng, settings.prompts_per_step)
    limit = asyncio.Semaphore(settings.concurrency)

    async def one(problem: Problem, index: int) -> Any:
        async with limit:
            return await client.generate(
                learner.encode(problem.prompt),
                {
                    "max_new_tokens": 1,
                    "temperature": settings.temperature,
                    "sampling_seed": (settings.seed * 1_000_003 + step * 10_007 + index) % 2**31,
                },
                max_lag=settings.max_lag,
                deadline_s=settings.rollout_deadline_s,
            )

    g = settings.group_size
    jobs = [one(p, i * g + k) for i, p in enumerate(problems) for k in range(g)]
    answers = await asyncio.gather(*jobs, return_exceptions=True)
    batch = Batch()
    for i, problem in enumerate(problems):
        members = answers[i * g : (i + 1) * g]
        good = [a for a in members if not isinstance(a, BaseException)]
        bad = [a for a in members if isinstance(a, BaseException)]
        for error in bad:
            if not isinstance(error, RolloutError):
                raise error
            log.warning("rollout failed: %s", error)
        batch.failed += len(bad)
        batch.violations += sum(isinstance(a, ConstraintViolated) for a in bad)
        batch.violations += sum(not a.satisfies_constraint for a in good)
        batch.retries_409 += sum(a.not_ready_retries for a in good)
        batch.retries += sum(a.retries for a in good)
        if not bad:
            batch.groups.append((problem, members))
    return batch


def run_interruptibly(main: Coroutine[Any, Any, T], grace_s: float = UNWIND_GRACE_S) -> T:
    """Run `main` on a fresh event loop; Ctrl-C (or SIGTERM) ends it within `grace_s`.

    The signal cancels `main` from inside the loop, so it never lands in the middle of a
    lock, a protocol callback or a worker's hand-off, and raises `KeyboardInterrupt` once
    `main` has unwound. Two things kept `asyncio.run` from ending promptly: a cancellation
    that reaches an inner await which completes anyway is lost (a fresh clone's test saw
    the demo train on for a minute after SIGINT), and on its way out it waits without a
    limit for every task and every worker thread (a CI run once saw the demo print nothing
    for a minute after SIGINT, with no trace of where it waited). Here the loop stops
    `grace_s` after the signal whatever `main` does, tasks still running get `grace_s`
    once more, and worker threads are waited for `grace_s` at most: the caller stops the
    processes they talk to next.
    """
    loop = asyncio.new_event_loop()
    workers = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="demo-worker")
    loop.set_default_executor(workers)
    task = loop.create_task(main)
    backstop: list[asyncio.TimerHandle] = []

    def interrupt() -> None:
        if not backstop:
            task.cancel()
            backstop.append(loop.call_later(grace_s, loop.stop))  # if the cancel is lost

    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}
    installed = []
    for sig in signals:
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            loop.add_signal_handler(sig, interrupt)  # main thread only
            installed.append(sig)
    try:
        return loop.run_until_complete(task)
    except (asyncio.CancelledError, RuntimeError):
        if backstop:  # cancelled, or stopped with `main` still running
            raise KeyboardInterrupt from None
        raise
    finally:
        for handle in backstop:
            handle.cancel()
        for sig in installed:
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous[sig])
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in left:
            t.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left, timeout=grace_s))
        with contextlib.suppress(RuntimeError, TimeoutError):
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), grace_s))
        # A worker still publishing must finish before the caller closes the publisher
        # (both would deliver its notifications), but a stuck one is not waited for.
        joiner = threading.Thread(target=workers.shutdown, daemon=True)
        joiner.start()
        joiner.join(grace_s)
        loop.close()


async def train(
    settings: DemoSettings,
    cp: LocalControlPlane,
    fleet: list[EngineWithAgent],
    publisher: Any,
    learner: Any,
    run_id: str,
    console: Console,
    totals: DemoTotals,
) -> None:
    """The asynchronous loop: the next step's rollouts are sampled while this step trains
    and publishes, so the trainer learns from tokens at most `max_lag` versions old."""
    from demo.trainer import Sample
    from trainer_client.rollout_client import RolloutClient
    from trainer_client.staleness import group_staleness

    precisions = sorted({m.precision for m in fleet}, key=["bf16", "fp8", "nvfp4"].index)
    print_header(console, precisions)
    rng = random.Random(settings.seed)
    pauses = PauseCounter()
    pauses.new_pauses(fleet)  # the boot catch-up is not a training-time pause
    async with RolloutClient(
        cp.url, cp.tokens["trainer"], run_id=run_id, deadline_s=settings.rollout_deadline_s
    ) as client:
        pending = asyncio.create_task(sample_batch(client, learner, rng, settings, 1))
        try:
            for step in range(1, settings.steps + 1):
                started = time.perf_counter()
                batch = await pending
                if step < settings.steps:
                    pending = asyncio.create_task(
                        sample_batch(client, learner, rng, settings, step + 1)
                    )
                trainer_version = publisher.version
                samples, served, staleness = [], defaultdict(list), []
                for problem, members in batch.groups:
                    staleness.append(
                        group_staleness(trainer_version, [m.oldest_version for m in members])
                    )
                    for m in members:
                        served[m.precision or "?"].extend(sorted(set(m.versions)))
                        samples.append(
                            Sample(
                                prompt_ids=learner.encode(problem.prompt),
                                output_ids=m.output_ids,
                                sampler_logprobs=m.logprobs,
                                reward=reward(problem, m.text),
                                precision=m.precision or "?",
                            )
                        )
                metrics = (
                    await asyncio.to_thread(learner.step, samples, settings.group_size)
                    if samples
                    else None
                )
                if metrics is not None:
                    await client.report_gap(
                        step,
                        {p: g for p, g in metrics.gap_by_precision.items() if p in PRECISIONS},
                        trainer_version=trainer_version,
                        staleness_mean=sum(staleness) / max(1, len(staleness)),
                        staleness_max=max(staleness, default=0),
                    )
                report = await asyncio.to_thread(publisher.publish, learner.state_dict())
                count, pause_s = await asyncio.to_thread(pauses.new_pauses, fleet)
                record = StepRecord(
                    step=step,
                    version=report.version,
                    kind=report.kind.value,
                    reward=sum(s.reward for s in samples) / max(1, len(samples)),
                    rollouts=len(samples),
                    failed=batch.failed,
                    served=dict(served),
                    staleness_mean=sum(staleness) / max(1, len(staleness)),
                    staleness_max=max(staleness, default=0),
                    retries_409=batch.retries_409,
                    retries=batch.retries,
                    publish_bytes=report.bytes,
                    publish_ratio=report.ratio_to_full,
                    pauses=count,
                    pause_s=pause_s,
                    k3=metrics.k3_by_precision if metrics else {},
                    violations=batch.violations,
                    seconds=time.perf_counter() - started,
                )
                totals.add(record)
                print_step(console, record, precisions)
        finally:
            if not pending.done():
                pending.cancel()
        totals.client_retries_409 = client.stats.retries_409
        totals.client_retries = client.stats.retries
        totals.gap_reports = client.stats.gap_reports


def run_demo(settings: DemoSettings, console: Console) -> dict[str, Any]:
    """Run the demo; return the summary (also printed as the last line by the CLI)."""
    from store.anchor import AnchorPolicy
    from trainer_client.publisher import Publisher

    started = time.perf_counter()
    workdir = settings.workdir.resolve()
    run_id = settings.run_id or "demo-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    run_dir = workdir / "runs" / run_id
    store_url = settings.store or str(workdir / "store")
    db_url = settings.db or f"sqlite:///{workdir / 'controlplane.db'}"
    precisions = {settings.precision_of(i) for i in range(settings.engines)}
    kinds = sorted(
        {f"{settings.precision_of(i)}:{settings.kind_of(i)}" for i in range(settings.engines)}
    )
    totals = DemoTotals()
    with ProcessGroup(run_dir / "logs") as group:
        console.print(f"[bold]Tether demo[/bold] run {run_id}, work dir {workdir}")
        console.print("writing the tiny model and its FP8/NVFP4 conversions ...")
        models = prepare_models(workdir / "models", precisions, settings.seed)
        console.print(f"starting the control plane ({db_url.split(':', 1)[0]}) ...")
        cp = start_controlplane(group, db_url, store_url)
        # The fragment never reaches the server or its logs; the page keeps the token.
        console.print(
            f"[bold]dashboard:[/bold] {cp.url}/dashboard#token={cp.tokens['viewer']} "
            f"(or: tether fleet watch --control-plane {cp.url})"
        )
        publisher = Publisher(
            store_url,
            run_id,
            cp.url,
            cp.tokens["trainer"],
            anchor_policy=AnchorPolicy(every=settings.anchor_every),
            codec=settings.codec,
            progress=False,
        )
        boot = publisher.claim(0, models["bf16"])
        totals.boot_bytes = boot.bytes if boot else 0
        console.print(
            f"published boot version v0 to {publisher.store.url}; starting "
            f"{settings.engines} engine(s) with agents ({', '.join(kinds)}) ..."
        )
        fleet = start_engines(group, settings, models, cp, run_id, store_url, run_dir)
        from demo.trainer import Learner

        learner = Learner(
            models["bf16"],
            learning_rate=settings.learning_rate,
            temperature=settings.temperature,
            seed=settings.seed,
            trainable=settings.trainable,
        )
        console.print(
            f"training {settings.steps} steps: {settings.prompts_per_step} prompts x "
            f"{settings.group_size} samples, max_lag {settings.max_lag}, MIS-corrected GRPO"
        )
        try:
            run_interruptibly(
                train(settings, cp, fleet, publisher, learner, run_id, console, totals)
            )
            converged = wait_converged(cp, run_id, publisher.version or 0, settings.engines)
        finally:
            publisher.close()
    summary = totals.summary(
        time.perf_counter() - started, run_id=run_id, workdir=str(workdir), **converged
    )
    print_summary(console, totals, summary)
    return summary
