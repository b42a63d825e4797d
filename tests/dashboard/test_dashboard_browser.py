"""The dashboard in a real headless Chromium, against a running control plane and engines.

One fleet for the module: a control plane process, two CPU reference engines (BF16, FP8)
each behind its agent, following a folder store. The page is loaded with a viewer token in
its URL fragment; the tests read what it draws. A second control plane holds 1,000
registered engines for the large-fleet test. Screenshots go to the test's temp folder, and
also to `$TETHER_SCREENSHOTS` when set (how docs/img/ was made).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from demo.local_fleet import start_controlplane as start_demo_controlplane
from launcher.processes import ProcessGroup
from tests.controlplane.conftest import publish
from tests.dashboard.browser import browser_page, chromium_path, screenshot
from tests.engine_agent.conftest import (
    ControlPlaneProcess,
    VersionChain,
    launch_agent,
    start_controlplane,
    wait_agent,
    wait_applied,
)
from tests.fixtures.processes import ManagedProcess, stop_all
from tests.fixtures.reference_engine import (
    ReferenceEngineProcess,
    TinyCheckpoints,
    launch_reference_engine,
    wait_until_ready,
)

pytestmark = pytest.mark.slow

RUN = "dash-run"
PRECISIONS = ("bf16", "fp8")
#: How long the page may take to show a change the fleet made (it polls every second).
SHOW_MS = 90_000


@dataclass
class Fleet:
    cp: ControlPlaneProcess
    chain: VersionChain
    engines: dict[str, ReferenceEngineProcess]
    agents: dict[str, ManagedProcess]

    def publish(self) -> int:
        version = self.chain.publish("delta")
        reply = self.cp.call(
            "POST", f"/v1/runs/{RUN}/versions", "trainer", json={"version": version}
        )
        assert reply.status_code == 201, reply.text
        return version

    def engine_ids(self) -> dict[str, str]:
        """precision → engine id, from the control plane's own listing."""
        reply = self.cp.call("GET", "/v1/engines", params={"run_id": RUN})
        assert reply.status_code == 200, reply.text
        return {e["precision"]: e["engine_id"] for e in reply.json()["engines"]}

    def page_url(self) -> str:
        return f"{self.cp.url}/dashboard#token={self.cp.tokens['viewer']}"


@pytest.fixture(scope="module")
def fleet(tiny: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    chromium_path()  # skip before starting processes when there is no browser
    root = tmp_path_factory.mktemp("dashboard")
    boots = {"bf16": tiny.bf16, "fp8": tiny.fp8}
    engines = {p: launch_reference_engine(boots[p], root / f"engine-{p}.log") for p in PRECISIONS}
    cp = start_controlplane(root)
    chain = VersionChain(root / "store", RUN, tiny.bf16)
    reply = cp.call("POST", "/v1/runs", "trainer", json={"run_id": RUN})
    assert reply.status_code == 201, reply.text
    cp.call("POST", f"/v1/runs/{RUN}/versions", "trainer", json={"version": 0})
    agents: dict[str, ManagedProcess] = {}
    try:
        for precision, engine in engines.items():
            agents[precision] = launch_agent(
                f"agent-{precision}", engine.url or "", precision, root,
                store_root=chain.store_root, run_id=RUN, boot_model=boots[precision],
                control_plane=cp, extra=("--label", "engine=reference", "--accelerator", "cpu"),
            )  # fmt: skip
        for engine in engines.values():
            wait_until_ready(engine)
        for agent in agents.values():
            wait_agent(agent)
            wait_applied(agent, 0)
        yield Fleet(cp, chain, engines, agents)
    finally:
        stop_all([*agents.values(), *engines.values(), cp.process])


def column(page: Any, table: str, n: int) -> list[str]:
    """The text of the n-th cell (1-based) of every body row of `table`, read in one go."""
    return page.eval_on_selector_all(
        f"{table} tbody tr", "(rows, n) => rows.map(r => r.cells[n - 1]?.textContent ?? '')", n
    )


def row(page: Any, engine_id: str) -> Any:
    return page.locator(f'#engines tr[data-engine-id="{engine_id}"]')


def test_the_page_lists_the_fleet_and_a_publish_moves_each_row(
    fleet: Fleet, tmp_path: Path
) -> None:
    ids = fleet.engine_ids()
    start = fleet.chain.latest
    with browser_page() as page:
        page.goto(fleet.page_url())
        page.wait_for_selector("#engines tbody tr[data-engine-id]", timeout=SHOW_MS)
        assert "token=" not in page.url  # the page drops the token from the address bar
        for precision, engine_id in ids.items():
            cells = row(page, engine_id).locator("td")
            page.wait_for_function(
                "([id, v]) => document.querySelector(`#engines tr[data-engine-id='${id}'] "
                "td.served`)?.textContent === v",
                arg=[engine_id, f"v{start}"],
                timeout=SHOW_MS,
            )
            texts = cells.all_inner_texts()
            assert texts[0] == engine_id[:12]
            assert texts[1] == precision
            assert texts[2] == "cpu" and texts[3] == "sglang"  # the agent's engine kind
            assert texts[5] == f"v{start}"  # target
            assert texts[6] == "ready"
        assert page.locator("#shown").inner_text() == f"({len(ids)} of {len(ids)})"
        assert column(page, "#precisions", 1) == list(PRECISIONS)

        version = fleet.publish()
        for engine_id in ids.values():
            page.wait_for_function(
                "([id, v]) => document.querySelector(`#engines tr[data-engine-id='${id}'] "
                "td.served`)?.textContent === v",
                arg=[engine_id, f"v{version}"],
                timeout=SHOW_MS,
            )
        page.wait_for_function(
            "v => document.querySelector(`#timeline tr[data-version='${v}'] td:last-child`)"
            "?.textContent !== '—'",
            arg=version,
            timeout=SHOW_MS,
        )
        converged = page.locator(f'#timeline tr[data-version="{version}"] td').all_inner_texts()
        assert converged[2].endswith("100%")
        assert all(re.fullmatch(r"≤?[\d.]+ (ms|s|min)", t) for t in converged[3:]), converged
        screenshot(page, tmp_path, "dashboard.png")


def test_the_trainer_gap_reported_through_the_rollout_client_appears_on_the_page(
    fleet: Fleet,
) -> None:
    import asyncio

    from trainer_client.rollout_client import RolloutClient

    async def report() -> None:
        async with RolloutClient(fleet.cp.url, fleet.cp.tokens["trainer"], run_id=RUN) as client:
            for step, k3 in enumerate((0.010, 0.012, 0.020), start=1):
                gaps = {"bf16": {"k3_kl": k3 / 4, "tokens": 48}, "fp8": {"k3_kl": k3}}
                ok = await client.report_gap(
                    step, gaps, trainer_version=step, staleness_mean=0.5, staleness_max=1
                )
                assert ok

    asyncio.run(report())
    with browser_page() as page:
        page.goto(fleet.page_url())
        page.wait_for_selector('#gap-table tr[data-precision="fp8"]', timeout=SHOW_MS)
        fp8 = page.locator('#gap-table tr[data-precision="fp8"] td').all_inner_texts()
        assert fp8[:2] == ["fp8", "0.0200"]
        assert page.locator("#card-staleness-max b").inner_text() == "1"
        assert page.locator("#gap svg.spark polyline").count() == 2


def test_409s_show_up_as_a_rate_with_their_reason(fleet: Fleet) -> None:
    # A version not published yet but within TETHER_MAX_VERSIONS_AHEAD (1000) of latest:
    # nobody serves it, so the router answers a retryable 409 at once.
    body = {"text": "1+1=", "run_id": RUN, "weight_version": {"exact_version": 500}}
    for _ in range(3):
        reply = fleet.cp.call("POST", "/v1/generate", "client", json=body)
        assert reply.status_code == 409, reply.text
    with browser_page() as page:
        page.goto(fleet.page_url())
        page.wait_for_function(
            "() => (document.querySelector('#card-409 small')?.textContent || '').includes('/s')",
            timeout=SHOW_MS,
        )
        assert page.locator("#card-409 b").inner_text() != "0.000/s"


def test_a_wrong_token_shows_the_login_form_with_the_reason(fleet: Fleet) -> None:
    with browser_page() as page:
        page.goto(f"{fleet.cp.url}/dashboard#token=tth_wrong")
        page.wait_for_selector("#login:not([hidden])", timeout=SHOW_MS)
        assert "unknown bearer token" in page.locator("#login-error").inner_text()
        page.fill("#token", fleet.cp.tokens["viewer"])
        page.click("#login button")
        page.wait_for_selector("#engines tbody tr[data-engine-id]", timeout=SHOW_MS)


# ---------------------------------------------------------------- 1,000 engines


@pytest.fixture(scope="module")
def crowd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A control plane with 1,000 registered engines (long leases, no heartbeats needed)
    across three precisions and four versions; yields the page URL."""
    chromium_path()
    root = tmp_path_factory.mktemp("crowd")
    with ProcessGroup(root / "logs") as group:
        cp = start_demo_controlplane(
            group, f"sqlite:///{root / 'cp.db'}", str(root / "store"),
            {"TETHER_LEASE_SECONDS": "3600", "TETHER_SNAPSHOT_REFRESH_S": "1"},
        )  # fmt: skip
        with httpx.Client(base_url=cp.url, timeout=30.0) as http:
            trainer = {"Authorization": f"Bearer {cp.tokens['trainer']}"}
            engine = {"Authorization": f"Bearer {cp.tokens['engine']}"}
            assert http.post("/v1/runs", json={"run_id": "crowd"}, headers=trainer).is_success
            for version in range(4):
                publish(root / "store", "crowd", version)
                reply = http.post(
                    "/v1/runs/crowd/versions", json={"version": version}, headers=trainer
                )
                assert reply.status_code == 201, reply.text
            for i in range(1000):
                body = {
                    "url": f"http://10.0.{i // 250}.{i % 250}:8000",
                    "run_id": "crowd",
                    "precision": ("bf16", "fp8", "nvfp4")[i % 3],
                    "accelerator": ("h100", "b200")[i % 2],
                    "applied_version": i % 4,
                    "sync_state": "ready",
                    "engine_kind": ("sglang", "vllm")[i % 5 == 0],
                    "labels": {"zone": f"z{i % 4}"},
                }
                reply = http.post("/v1/engines", json=body, headers=engine)
                assert reply.status_code == 201, reply.text
        yield f"{cp.url}/dashboard#token={cp.tokens['viewer']}"


def test_a_fleet_of_1000_engines_renders_sorts_and_filters(crowd: str, tmp_path: Path) -> None:
    with browser_page() as page:
        page.goto(crowd)
        page.wait_for_function(
            "() => document.querySelector('#shown')?.textContent === '(1000 of 1000)'",
            timeout=SHOW_MS,
        )
        assert page.locator("#engines tbody tr").count() == 1000
        counts = dict(
            zip(column(page, "#precisions", 1), column(page, "#precisions", 2), strict=True)
        )
        assert counts == {"bf16": "334", "fp8": "333", "nvfp4": "333"}
        page.check("#f-behind")  # engines not yet on their target, v3
        assert page.locator("#shown").inner_text() == "(750 of 1000)"
        page.uncheck("#f-behind")
        screenshot(page, tmp_path, "dashboard-1000.png")

        page.select_option("#f-precision", "fp8")
        assert page.locator("#shown").inner_text() == "(333 of 1000)"
        # A label: hex engine ids and dotted URLs cannot contain it, so only labels match.
        page.fill("#filter", "zone=z1")
        assert page.locator("#shown").inner_text() == "(84 of 1000)"  # i % 12 == 1
        assert set(column(page, "#engines", 3)) == {"b200"}  # odd i
        assert set(column(page, "#engines", 4)) == {"sglang", "vllm"}
        page.fill("#filter", "")
        page.select_option("#f-precision", "")
        page.click('#engines th[data-key="applied_version"]')  # ascending
        page.click('#engines th[data-key="applied_version"]')  # descending
        served = page.locator("#engines tbody td.served").all_inner_texts()
        assert served[0] == "v3" and served[-1] == "v0"
        assert served == sorted(served, reverse=True)
