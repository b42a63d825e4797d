"""Why a request for a run found no engine, as one typed answer a client can act on.

Owns the choice between the router's refusals:
- `WeightVersionNotReady` (409, retryable, Retry-After from staging progress): the version
  is coming — it is the latest or newer (within reach), an engine is staging it, or the
  run's `keep_pinned` policy will bring an engine back to it;
- `WeightVersionUnavailable` (409, not retryable): an exact version older than latest that
  no engine serves and none will (the policy does not keep it, or the store deleted it);
  the body names `nearest_servable_version`;
- `PrecisionNotServed` (409, not retryable): the run has engines, none of the requested
  precision(s);
- `VersionTooFarAhead` (422): the version asked for is more than `max_ahead` versions above
  the run's latest, which is a mistake (wrong run, wrong counter) rather than a wait.
Pure: reads a fleet snapshot, never the database, the store or the network.
"""

from __future__ import annotations

from collections.abc import Collection

from controlplane.errors import (
    ApiError,
    PrecisionNotServed,
    VersionTooFarAhead,
    WeightVersionNotReady,
    WeightVersionUnavailable,
)
from controlplane.router import retry_after_s
from controlplane.snapshot import FleetSnapshot, RunView
from store.types import VersionConstraint
from wire import PolicyKind, Precision


def too_far_ahead(
    snap: FleetSnapshot, run_id: str, constraint: VersionConstraint, max_ahead: int, prefix: str
) -> VersionTooFarAhead | None:
    """The 422 for a version more than `max_ahead` above the run's latest (or its boot
    version before the first publish); None when the request is within reach."""
    run = snap.runs.get(run_id)
    if run is None:
        return None
    base = run.latest_version if run.latest_version is not None else run.boot_version
    name = "exact_version" if constraint.exact_version is not None else "min_version"
    wanted = (
        constraint.exact_version
        if constraint.exact_version is not None
        else (constraint.min_version)
    )
    if wanted is None or wanted - base <= max_ahead:
        return None
    field = f"{prefix}.{name}"
    return VersionTooFarAhead(
        f"{field}: v{wanted} is {wanted - base} versions above run {run_id!r}'s latest "
        f"(v{base}); more than {max_ahead} ahead cannot be a wait for the next publish: check "
        "the run id and the version counter (the limit is TETHER_MAX_VERSIONS_AHEAD)",
        field=field,
        latest_version=run.latest_version,
        max_versions_ahead=max_ahead,
    )


def _requested(constraint: VersionConstraint) -> dict[str, int | None]:
    return {"min_version": constraint.min_version, "exact_version": constraint.exact_version}


def _will_come_back(snap: FleetSnapshot, run: RunView, version: int) -> bool:
    """Whether an exact `version` older than latest may still be served here."""
    for engine in snap.run_engines(run.run_id):
        if version in (engine.applied_version, engine.staging_target):
            return True
    held = snap.available.get(run.run_id)
    if held is not None and version not in held:
        return False
    policy = run.policy
    latest = run.latest_version
    assert latest is not None
    return policy.kind is PolicyKind.KEEP_PINNED and latest - version <= policy.max_lag


def nearest_servable(
    snap: FleetSnapshot, run: RunView, version: int, precisions: Collection[Precision] | None
) -> int | None:
    """The served version closest to `version` (the newer on a tie), else the latest."""
    served = {
        e.applied_version
        for e in snap.run_engines(run.run_id)
        if e.serving and (precisions is None or e.precision in precisions)
    }
    if not served:
        return run.latest_version
    return min(served, key=lambda v: (abs(v - version), -v))  # type: ignore[operator]


def refusal(
    snap: FleetSnapshot,
    run_id: str,
    constraint: VersionConstraint,
    precisions: Collection[Precision] | None,
    now: float,
    default_retry_s: float,
    reason: str,
) -> ApiError:
    """The typed answer for a request no engine took (`reason` is for the message)."""
    run = snap.runs.get(run_id)
    engines = snap.run_engines(run_id)
    latest = run.latest_version if run else None
    if precisions is not None and engines:
        present = {e.precision for e in engines}
        if not present & set(precisions):
            wanted = sorted(p.value for p in precisions)
            return PrecisionNotServed(
                f"run {run_id!r} has no engine of precision {', '.join(wanted)} (it has "
                f"{', '.join(sorted(p.value for p in present))}): widen 'precision' or register "
                "an engine of that precision",
                field="precision",
                requested_precisions=wanted,
                fleet_precisions=sorted(p.value for p in present),
            )
    exact = constraint.exact_version
    if (
        run is not None
        and latest is not None
        and exact is not None
        and exact < latest
        and not _will_come_back(snap, run, exact)
    ):
        nearest = nearest_servable(snap, run, exact, precisions)
        return WeightVersionUnavailable(
            f"run {run_id!r} will not serve v{exact} again (latest is v{latest}; the policy "
            f"does not keep v{exact} or the store deleted it): ask for v{nearest} or a "
            "min_version instead",
            requested=_requested(constraint),
            latest_version=latest,
            nearest_servable_version=nearest,
        )
    return WeightVersionNotReady(
        f"no engine of run {run_id!r} serves {constraint.describe()} right now ({reason}); "
        "retry after Retry-After seconds",
        retry_after_s(snap, run_id, constraint, now, default_retry_s),
        requested=_requested(constraint),
        latest_version=latest,
        fleet_versions={e.engine_id: e.applied_version for e in engines},
    )
