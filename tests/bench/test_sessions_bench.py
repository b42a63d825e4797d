"""The sessions benchmark runs end to end at a tiny scale on one real vLLM engine.

One run covers the figures the issue asks of the last JSON line: every policy's turns reach
vLLM's prefix cache, whose counters the benchmark reads; a conversation's history is found
there turn after turn; and no turn's token ids are re-tokenized or differ from what the
engine returned. (One engine keeps the test within its CI budget: the policies' hit rates
are compared at full scale, two or three engines, in docs/benchmarks.md.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_sessions_bench_keeps_histories_cached_and_token_ids_exact(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.sessions", "--sessions", "6", "--turns", "3",
         "--engines", "1", "--concurrency", "3", "--system-tokens", "96", "--task-tokens", "96",
         "--turn-tokens", "32", "--max-tokens", "4", "--work-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["failures"] == 0, figures
    assert figures["sessions"] == 6
    assert figures["tito_mismatches"] == 0
    policies = figures["policies"]
    assert set(policies) == {"sticky", "affinity", "random"}
    for name, row in policies.items():
        assert row["turns"] == 18, name
        assert row["prefix_cache_queries"] > 0, name
    # After a conversation's first turn, every turn finds its history cached.
    for name, row in policies.items():
        assert row["prefix_cache_hit_rate"] > 0.5, name
        assert row["retokenization_drift"] > 0, name  # the drift the records avoid is real
