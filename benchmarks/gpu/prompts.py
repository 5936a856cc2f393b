"""A fixed, reproducible prompt set (no dataset download): ~200 varied instructions."""

from __future__ import annotations

from pathlib import Path

_TOPICS = [
    "the water cycle", "binary search", "the French Revolution", "photosynthesis",
    "TCP congestion control", "black holes", "compound interest", "the immune system",
    "hash tables", "plate tectonics", "the Roman Empire", "neural networks",
    "climate feedback loops", "public-key cryptography", "the history of jazz",
    "supply and demand", "garbage collection", "volcanoes", "the printing press",
    "quantum entanglement", "sorting algorithms", "bread fermentation", "the Silk Road",
    "electric motors", "vaccines",
]
_TASKS = [
    "Explain {t} to a ten-year-old.",
    "Write a short poem about {t}.",
    "List five surprising facts about {t}.",
    "Write a Python function related to {t} and explain it line by line.",
    "Summarize the key ideas of {t} in one paragraph.",
    "Write a dialogue between a teacher and a student about {t}.",
    "What are common misconceptions about {t}? Answer in detail.",
    "Describe {t} step by step, numbering each step.",
]


def builtin_prompts(count: int = 200) -> list[str]:
    prompts = [task.format(t=topic) for task in _TASKS for topic in _TOPICS]
    return prompts[:count]


def load_prompts(path: Path | None, count: int) -> list[str]:
    """One prompt per line from ``path``, else the built-in set; at most ``count``."""
    if path is None:
        return builtin_prompts(count)
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return lines[:count]
