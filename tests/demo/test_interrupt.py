"""`run_interruptibly`: Ctrl-C ends the demo's loop whatever the loop is doing."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest

from demo.run import run_interruptibly


def test_the_loop_returns_what_its_coroutine_returns_and_leaves_the_handlers_as_found() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert run_interruptibly(answer()) == 42
    assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_a_loop_that_swallows_its_cancellation_and_waits_on_a_stuck_thread(
    sig: signal.Signals,
) -> None:
    release = threading.Event()
    swallowed: list[int] = []
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    async def stubborn() -> None:
        loop = asyncio.get_running_loop()
        stuck = loop.run_in_executor(None, release.wait)  # a worker that never returns
        loop.call_soon(signal.raise_signal, sig)
        while True:  # every cancellation is lost, as when an inner await completes anyway
            try:
                await asyncio.shield(stuck)
            except asyncio.CancelledError:
                swallowed.append(1)

    try:
        with pytest.raises(KeyboardInterrupt):
            run_interruptibly(stubborn(), grace_s=0.2)
    finally:
        release.set()
    # The signal cancelled the coroutine, which swallowed it and the cleanup's too; the
    # loop stopped anyway, without waiting for the worker thread.
    assert len(swallowed) == 2
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_cancellation_that_unwinds_raises_keyboard_interrupt_once_it_has() -> None:
    unwound = threading.Event()

    async def polite() -> None:
        asyncio.get_running_loop().call_soon(signal.raise_signal, signal.SIGINT)
        try:
            await asyncio.sleep(3600)
        finally:
            unwound.set()

    with pytest.raises(KeyboardInterrupt):
        run_interruptibly(polite(), grace_s=30)
    assert unwound.is_set()
