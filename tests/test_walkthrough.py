"""The README's command-line walkthrough is right: `docs/walkthrough.sh` runs it end to end
on loopback, and the README's commands are the script's, at the server's real port."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.settings import ControlPlaneSettings
from launcher.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "walkthrough.sh"


def readme_walkthrough() -> str:
    """The first console block of the README's "The command line" section."""
    section = (ROOT / "README.md").read_text().split("## The command line", 1)[1]
    return section.split("```console\n", 1)[1].split("```", 1)[0]


def commands(text: str) -> set[str]:
    """`tether <noun> <verb>` of every command in a shell text."""
    return set(re.findall(r"\btether ([a-z-]+ [a-z-]+)", text))


def test_the_readme_walkthrough_matches_the_script_and_the_server_default_port() -> None:
    block = readme_walkthrough()
    assert commands(block) <= commands(SCRIPT.read_text()), "every README step is in the script"
    port = ControlPlaneSettings().port
    urls = re.findall(r"--control-plane (\S+)", block) + re.findall(r"(http://\S+/v1/\S+)", block)
    assert urls and all(f":{port}" in url for url in urls), (port, urls)
    agent = next(line for line in block.split("\ntether ") if line.startswith("agent run"))
    assert "--boot-model" in agent and "--token" in agent


@pytest.mark.slow
def test_the_walkthrough_script_runs_end_to_end(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "CP_PORT": str(free_port()),
        "ENGINE_PORT": str(free_port()),
        "AGENT_PORT": str(free_port()),
    }
    env.pop("TETHER_DB_URL", None)
    env.pop("TETHER_STORE", None)
    result = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "work")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert '"weight_version_start":0' in result.stdout
    assert result.stdout.rstrip().endswith("walkthrough: ok")
