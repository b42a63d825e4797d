"""The sessions benchmark runs end to end at a tiny scale on two real vLLM engines.

One run covers the figures the issue asks of the last JSON line: sticky placement keeps a
conversation's history in one engine's prefix cache (more hits than random routing), and no
turn's token ids are re-tokenized or differ from what the engine returned.
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
         "--concurrency", "3", "--system-tokens", "96", "--task-tokens", "96",
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
    # Sticky and affinity both keep a conversation on one engine: after its first turn,
    # every turn finds the history cached.
    assert figures["prefix_cache_hit_rate"] > 0.5
    assert policies["affinity"]["prefix_cache_hit_rate"] > 0.5
