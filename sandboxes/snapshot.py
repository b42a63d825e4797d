"""The repository a patch is scored against: the base commit's tree as a fresh repository.

The sandbox never sees the task's repository itself: only a new single-commit repository
holding the base commit's files (no other commits, refs, remotes, tags or reflog), so a
patch cannot read a future commit's solution out of git history. Runs on the host before
any untrusted code, on the task author's (trusted) repository.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from sandboxes.errors import InvalidTask

SNAPSHOT_IDENTITY = {
    "GIT_AUTHOR_NAME": "tether",
    "GIT_AUTHOR_EMAIL": "tether@localhost",
    "GIT_COMMITTER_NAME": "tether",
    "GIT_COMMITTER_EMAIL": "tether@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}


def _git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **SNAPSHOT_IDENTITY, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(
        ["git", "-c", "commit.gpgsign=false", "-c", "core.hooksPath=/dev/null", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def build_snapshot(repo: Path, base_commit: str, dest: Path) -> str:
    """Write `base_commit`'s tree into empty `dest` as a one-commit repo; return its commit."""
    if not repo.exists():
        raise InvalidTask(f"task repository {repo} does not exist")
    with tempfile.TemporaryDirectory(prefix="tether-clone-") as scratch:
        clone = Path(scratch) / "clone"
        done = _git("clone", "-q", "--no-checkout", "--no-hardlinks", str(repo), str(clone))
        if done.returncode != 0:
            raise InvalidTask(f"cannot clone task repository {repo}: {done.stderr.strip()}")
        found = _git("rev-parse", "--verify", "--quiet", f"{base_commit}^{{commit}}", cwd=clone)
        if found.returncode != 0:
            raise InvalidTask(
                f"base commit {base_commit} is not in {repo}; fix the task's base_commit"
            )
        dest.mkdir(parents=True, exist_ok=True)
        done = _git(
            f"--git-dir={clone / '.git'}",
            f"--work-tree={dest}",
            "checkout",
            "-f",
            found.stdout.strip(),
            "--",
            ".",
        )
        if done.returncode != 0:
            raise InvalidTask(f"cannot check out {base_commit}: {done.stderr.strip()}")
    for step in (
        ["init", "-q"],
        ["add", "-A", "-f"],
        ["commit", "-q", "--no-verify", "-m", "base"],
    ):
        done = _git(*step, cwd=dest)
        if done.returncode != 0:
            raise InvalidTask(f"cannot build the snapshot repository: {done.stderr.strip()}")
    return _git("rev-parse", "HEAD", cwd=dest).stdout.strip()
