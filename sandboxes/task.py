"""A scoring task: repository at a base commit, required tests, how to run them.

Owns the task file format (JSON, validated by pydantic) and its rules: a task without
required tests is rejected, because it would reward any patch. It never touches a repository.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from sandboxes.errors import InvalidTask

SWEBENCH_RENAMES = {
    "instance_id": "id",
    "FAIL_TO_PASS": "fail_to_pass",
    "PASS_TO_PASS": "pass_to_pass",
    "patch": "gold_patch",
}
SWEBENCH_DESCRIPTIVE = frozenset(
    {
        "problem_statement",
        "hints_text",
        "created_at",
        "version",
        "environment_setup_commit",
        "difficulty",
    }
)


class Task(BaseModel):
    """One SWE-style task. Test ids are pytest node ids (`tests/test_x.py::test_y`).

    `repo` is a git folder or a git bundle (relative paths are resolved against the task
    file's folder). `test_command`, when given, replaces the default pytest command; in it
    `{python}` and `{report}` stand for the interpreter and the report file the scorer reads.
    `harness_guard` (on by default) gives 0 to patches whose added source lines reach into
    the test harness (`sandboxes.harness_guard`); turn it off only for tasks about pytest.
    `gold_patch` is the reference fix `tether sandbox check` scores; never shown to a policy.

    SWE-bench instances are accepted as published: `instance_id` for `id`, `FAIL_TO_PASS` /
    `PASS_TO_PASS` as lists or JSON-encoded strings, `patch` for `gold_patch`, and their
    descriptive fields (problem statement, hints, dates, version) ignored.
    """

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    repo: Path
    base_commit: str = Field(min_length=4)
    fail_to_pass: list[str] = Field(default_factory=list)
    pass_to_pass: list[str] = Field(default_factory=list)
    test_args: list[str] = Field(default_factory=list)
    test_command: list[str] | None = None
    parser: str = "junit"
    setup_command: list[str] | None = None
    test_patch: str = ""
    protected_paths: list[str] = Field(default_factory=list)
    harness_guard: bool = True
    gold_patch: str = ""
    python: str | None = None
    timeout_s: float = Field(default=300.0, gt=0)
    setup_timeout_s: float = Field(default=300.0, gt=0)
    memory_mib: int = Field(default=4096, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _accept_swebench_fields(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or "instance_id" not in raw:
            return raw
        raw = {k: v for k, v in raw.items() if k not in SWEBENCH_DESCRIPTIVE}
        for theirs, ours in SWEBENCH_RENAMES.items():
            if theirs in raw:
                if ours in raw:
                    raise ValueError(f"both {theirs!r} and {ours!r} are given; keep one")
                raw[ours] = raw.pop(theirs)
        return raw

    @field_validator("fail_to_pass", "pass_to_pass", mode="before")
    @classmethod
    def _decode_json_lists(cls, value: Any) -> Any:
        # SWE-bench publishes these lists as JSON text inside the JSON row.
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(
                    "must be a list of pytest node ids, or a JSON-encoded list of them"
                ) from None
        return value

    @model_validator(mode="after")
    def _has_required_tests(self) -> Task:
        if not self.fail_to_pass and not self.pass_to_pass:
            raise ValueError(
                "task has no required tests (fail_to_pass and pass_to_pass are both empty); "
                "it would reward every patch, so it cannot be scored"
            )
        return self

    @property
    def required(self) -> list[str]:
        return sorted(set(self.fail_to_pass) | set(self.pass_to_pass))


def load_task(path: Path) -> Task:
    """Read and validate a task file; `InvalidTask` says what is wrong with it."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InvalidTask(f"task file {path} does not exist") from None
    except json.JSONDecodeError as error:
        raise InvalidTask(f"task file {path} is not valid JSON: {error}") from None
    try:
        task = Task.model_validate(raw)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'task'}: {e['msg']}" for e in error.errors()
        )
        raise InvalidTask(f"task file {path} is invalid: {problems}") from None
    if not task.repo.is_absolute():
        task = task.model_copy(update={"repo": (Path(path).parent / task.repo).resolve()})
    return task
