"""Spec-Bench prompts: loading, the six task families, and a deterministic selection.

The file has 13 categories: the eight MT-bench ones (10 prompts each) form one family, the other
five (80 each) are families of their own. Only the first turn of each question is used, as in
Spec-Bench's batch-1 evaluation and vLLM's `spec_bench` dataset.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                       "stem", "humanities")
#: The six families, in Spec-Bench's order.
FAMILIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def family_of(category: str) -> str:
    """Spec-Bench task family of a category ("writing" -> "mt_bench", "qa" -> "qa")."""
    if category in MT_BENCH_CATEGORIES:
        return "mt_bench"
    if category in FAMILIES:
        return category
    raise ValueError(f"unknown Spec-Bench category {category!r}: expected one of "
                     f"{', '.join(MT_BENCH_CATEGORIES + FAMILIES[1:])}")


@dataclass
class Prompt:
    index: int  # position in the run's prompt list (the key of every per-prompt figure)
    question_id: int
    category: str
    family: str
    text: str  # first turn
    prompt_token_ids: list[int] = field(default_factory=list)  # after the chat template, if any

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_questions(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:
        if not row.get("turns"):
            raise ValueError(f"{path}: question {row.get('question_id')} has no 'turns'")
    return rows


def repeated_rounds(prompts: list[Prompt], rounds: int) -> list[Prompt]:
    """The prompts ``rounds`` times in a row; round r's copy of prompt i has index
    ``i + r * len(prompts)`` (same family, question and text)."""
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    return [dataclasses.replace(p, index=p.index + r * len(prompts),
                                prompt_token_ids=list(p.prompt_token_ids))
            for r in range(rounds) for p in prompts]


def select_prompts(rows: Iterable[dict[str, Any]], per_family: int | None,
                   families: Iterable[str] = FAMILIES,
                   keep: Callable[[dict[str, Any]], bool] = lambda row: True) -> list[Prompt]:
    """The first `per_family` questions of each family (all when None or 0), in file order.

    Within a family, categories take turns (MT-bench: writing, roleplay, ..., then the second of
    each), so a small selection still spans the family. Rows that `keep` refuses (too long for
    the model) are skipped and the next one is taken. Families come out in `families` order.
    """
    by_family: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        by_family[family_of(row["category"])][row["category"]].append(row)
    selected: list[Prompt] = []
    for family in families:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}: expected one of {', '.join(FAMILIES)}")
        taken = 0
        for row in _round_robin(list(by_family[family].values())):
            if per_family and taken >= per_family:
                break
            if not keep(row):
                continue
            selected.append(Prompt(index=len(selected), question_id=int(row["question_id"]),
                                   category=row["category"], family=family,
                                   text=row["turns"][0]))
            taken += 1
    return selected


def first_across_families(prompts: list[Prompt], count: int) -> list[Prompt]:
    """The first ``count`` of ``prompts`` taken in turn from each family (each family's in their
    order), renumbered."""
    by_family: dict[str, list[Prompt]] = defaultdict(list)
    for p in prompts:
        by_family[p.family].append(p)
    taken = list(_round_robin(list(by_family.values())))[:count]
    order = {id(p): i for i, p in enumerate(prompts)}
    taken.sort(key=lambda p: order[id(p)])
    for i, p in enumerate(taken):
        p.index = i
    return taken


def _round_robin(groups: list[list[Any]]) -> Iterable[Any]:
    for i in range(max((len(g) for g in groups), default=0)):
        for group in groups:
            if i < len(group):
                yield group[i]


def write_subset(prompts: list[Prompt], path: str) -> None:
    """Write the selection in Spec-Bench's own format, for `vllm bench serve --dataset-path`."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"question_id": p.question_id, "category": p.category,
                                "turns": [p.text]}) + "\n" for p in prompts)


def write_raw_prompts(prompts: list[Prompt], path: str) -> None:
    """Write the selection as vLLM's `custom` dataset ({"prompt": ...} per line)."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": p.text}) + "\n" for p in prompts)
