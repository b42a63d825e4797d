"""The demo's verifiable task: add two digits. Prompt `3+5=`, answer `8`.

Owns the prompts and the reward. The tiny model's vocabulary holds every number 0-99 as
one token, so an answer is one generated token. The reward is shaped so that a randomly
initialised model gets a learning signal at once: 1 for the right sum, partial credit that
falls off linearly with the distance for any other number, nothing for a non-number. Pure
functions of a seeded RNG; never touches a model or the network.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

#: Numbers within this distance of the answer earn partial credit.
CREDIT_RADIUS = 8
#: A number, even a far one, earns this much (the model first learns to answer a number).
NUMBER_CREDIT = 0.1


@dataclass(frozen=True)
class Problem:
    """One prompt: `a+b=` with its answer."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> int:
        return self.a + self.b


def sample_problems(rng: random.Random, count: int) -> list[Problem]:
    """`count` problems with digits 0-9 drawn from `rng`."""
    return [Problem(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(count)]


def parse_answer(text: str) -> int | None:
    """The integer the model answered, or None if the text is not a number."""
    stripped = text.strip()
    return int(stripped) if stripped.isdigit() else None


def reward(problem: Problem, text: str) -> float:
    """1.0 for the right sum; NUMBER_CREDIT plus a share that shrinks linearly to zero at
    CREDIT_RADIUS for any other number; 0.0 for anything else."""
    value = parse_answer(text)
    if value is None:
        return 0.0
    if value == problem.answer:
        return 1.0
    closeness = max(0.0, 1.0 - abs(value - problem.answer) / CREDIT_RADIUS)
    return NUMBER_CREDIT + (0.5 - NUMBER_CREDIT) * closeness
