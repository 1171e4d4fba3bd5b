"""Multi-turn conversation workload and its ideal hit rate.

Client ``c`` starts with a random prompt of ``request_len`` tokens; the prompt of round ``r`` is
the previous prompt + the previous answer + a new random question of ``request_len`` tokens.

The *ideal* cached length of a request is the longest prefix of its prompt that the model has
already processed in an earlier request (prompts and answers, except each answer's last token,
which is sampled but never fed back through the model), capped at ``prompt_len - 1`` since one
token must be computed. The ideal hit rate is Σ ideal / Σ prompt tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Conversation", "ProcessedPrefixes", "make_conversations"]


@dataclass(slots=True)
class Conversation:
    client_id: int
    questions: list[list[int]]  # one per round; round 0's question is the first prompt

    def prompt(self, round_idx: int, history: Sequence[int]) -> list[int]:
        return [*history, *self.questions[round_idx]]


def make_conversations(
    *, num_clients: int, num_rounds: int, request_len: int, vocab_size: int, seed: int
) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    # Token 0 is never drawn (ids start at 1); clients may share tokens by chance, as real ones do.
    return [
        Conversation(
            client_id=c,
            questions=[rng.integers(1, vocab_size, size=request_len).tolist() for _ in range(num_rounds)],
        )
        for c in range(num_clients)
    ]


class ProcessedPrefixes:
    """Token sequences the model has processed, for the ideal-hit computation (a simple trie)."""

    def __init__(self) -> None:
        self._root: dict[int, dict] = {}

    def add(self, tokens: Sequence[int]) -> None:
        node = self._root
        for t in tokens:
            node = node.setdefault(int(t), {})

    def longest_prefix(self, tokens: Sequence[int]) -> int:
        node, n = self._root, 0
        for t in tokens:
            nxt = node.get(int(t))
            if nxt is None:
                break
            node, n = nxt, n + 1
        return n

    def ideal_cached(self, prompt: Sequence[int]) -> int:
        return min(self.longest_prefix(prompt), len(prompt) - 1)
