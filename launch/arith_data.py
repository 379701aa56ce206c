"""The arithmetic the bundled trained models know: two-operand addition and subtraction of
integers 0-99 (``37+45=82``; subtraction only where the result is ≥ 0), and the same as chat
turns (``What is 37+45?`` → ``82``). One fixed tenth of the problems of each operation
is held out from training, for the accuracy benchmark. Shared by the trainer
(``launch/train_tiny_models.py``) and ``benchmark/offline/eval_accuracy.py``."""

from __future__ import annotations

import random
from dataclasses import dataclass

SPLIT_SEED = 1234
HELD_OUT_FRACTION = 0.1


@dataclass(frozen=True)
class Problem:
    a: int
    op: str  # "+" or "-"
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def question(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def equation(self) -> str:
        return f"{self.question}{self.answer}"

    @property
    def chat_question(self) -> str:
        return f"What is {self.a}{self.op}{self.b}?"


def all_problems() -> list[Problem]:
    add = [Problem(a, "+", b) for a in range(100) for b in range(100)]
    sub = [Problem(a, "-", b) for a in range(100) for b in range(a + 1)]
    return add + sub


def split_problems() -> tuple[list[Problem], list[Problem]]:
    """(train, held out): a fixed tenth of each operation's problems is held out."""
    rng = random.Random(SPLIT_SEED)
    train, held = [], []
    for op in "+-":
        problems = [p for p in all_problems() if p.op == op]
        chosen = set(rng.sample(range(len(problems)), round(len(problems) * HELD_OUT_FRACTION)))
        for i, p in enumerate(problems):
            (held if i in chosen else train).append(p)
    return train, held


def few_shot_prompt(problem: Problem, shots: list[Problem]) -> str:
    """``shots`` solved, one per line, then the problem's question."""
    return "".join(f"{s.equation}\n" for s in shots) + problem.question


def parse_answer(text: str) -> int | None:
    """The integer a completion starts with (after optional spaces), or None."""
    text = text.lstrip()
    digits = ""
    for ch in text:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def chat_answer(text: str) -> int | None:
    """The answer in a chat reply: the number after the last '=', else the last number."""
    tail = text.rsplit("=", 1)[-1] if "=" in text else text
    numbers = "".join(ch if ch.isdigit() else " " for ch in tail).split()
    return int(numbers[-1]) if numbers else None
