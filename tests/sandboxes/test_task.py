"""Task files: the documented example is a valid task, and SWE-bench rows load as published."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sandboxes.errors import InvalidTask
from sandboxes.task import load_task

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sandboxes.md"


def test_the_task_example_in_the_docs_is_valid_json_and_a_valid_task(tmp_path: Path):
    block = re.search(r"## Task file\n\n```json\n(.*?)```", DOCS.read_text(), re.S)
    assert block, "docs/sandboxes.md has no JSON task example under '## Task file'"
    (tmp_path / "task.json").write_text(block.group(1))
    task = load_task(tmp_path / "task.json")
    assert task.id == "calc-1" and task.repo == tmp_path / "calc"
    assert task.fail_to_pass == ["tests/test_ops.py::test_add"]


SWEBENCH_ROW = {
    "repo": "calc",
    "instance_id": "calc__calc-1",
    "base_commit": "3f2c9a0d",
    "patch": "diff --git a/calc/ops.py b/calc/ops.py\n",
    "test_patch": "diff --git a/tests/test_ops.py b/tests/test_ops.py\n",
    "problem_statement": "add() subtracts",
    "hints_text": "",
    "created_at": "2023-01-01T00:00:00Z",
    "version": "1.0",
    "FAIL_TO_PASS": '["tests/test_ops.py::test_add"]',
    "PASS_TO_PASS": '["tests/test_ops.py::test_sub", "tests/test_ops.py::test_neg"]',
    "environment_setup_commit": "3f2c9a0d",
}


def test_a_swebench_row_loads_as_published(tmp_path: Path):
    (tmp_path / "row.json").write_text(json.dumps(SWEBENCH_ROW))
    task = load_task(tmp_path / "row.json")
    assert task.id == "calc__calc-1"
    assert task.fail_to_pass == ["tests/test_ops.py::test_add"]
    assert task.pass_to_pass == ["tests/test_ops.py::test_sub", "tests/test_ops.py::test_neg"]
    assert task.gold_patch == SWEBENCH_ROW["patch"]


def test_a_test_list_that_is_not_json_is_refused_naming_the_field(tmp_path: Path):
    (tmp_path / "row.json").write_text(json.dumps({**SWEBENCH_ROW, "FAIL_TO_PASS": "[oops"}))
    with pytest.raises(InvalidTask, match=r"fail_to_pass.*JSON-encoded list"):
        load_task(tmp_path / "row.json")
