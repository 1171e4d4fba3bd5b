"""Admission policies: where recurrent states are snapshotted and kept.

- :class:`EndsAdmission` (default) — the end of the prompt, the last page boundary strictly
  before the prompt end, and the end of the output (each floored to a page). A resent prompt
  (matched as ``tokens[:-1]``) then reuses all but its last page, and the next turn of a
  conversation resumes from the end of the previous output.
- :class:`EveryPageAdmission` — every page boundary (the most reuse, the most state memory).
- :class:`BlockGridAdmission` — every ``num_pages`` pages, plus the ends unless disabled.

Example, page 64, a 200-token prompt answered with 100 tokens: ``EndsAdmission`` gives
``{192, 256}`` (192 = prompt end floored = last boundary before 200; 256 = 300 floored).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from asynccache.errors import ConfigError
from asynccache.policy.base import AdmissionPolicy

if TYPE_CHECKING:
    from asynccache.tree.results import MatchResult

__all__ = ["BlockGridAdmission", "EndsAdmission", "EveryPageAdmission", "end_positions"]


def _check(prompt_len: int, page_size: int, total_len: int | None) -> None:
    if page_size <= 0:
        raise ConfigError(f"page_size must be positive, got {page_size}")
    if prompt_len < 0:
        raise ConfigError(f"prompt_len must be >= 0, got {prompt_len}")
    if total_len is not None and total_len < prompt_len:
        raise ConfigError(f"total_len={total_len} is shorter than prompt_len={prompt_len}")


def _after_match(positions: set[int], match: MatchResult | None) -> set[int]:
    # Positions the match already covers are not computed again, so they cannot be snapshotted.
    if match is None:
        return positions
    return {p for p in positions if p > match.num_tokens}


def end_positions(prompt_len: int, *, page_size: int, total_len: int | None = None) -> set[int]:
    """Prompt end floored, the last boundary strictly before the prompt end, output end floored."""
    _check(prompt_len, page_size, total_len)
    out = {prompt_len // page_size * page_size, (prompt_len - 1) // page_size * page_size}
    if total_len is not None:
        out.add(total_len // page_size * page_size)
    return {p for p in out if p > 0}


class EndsAdmission(AdmissionPolicy):
    """States at the ends of the prompt and of the output (see the module docstring)."""

    name: ClassVar[str] = "ends"

    def state_positions(
        self,
        prompt_len: int,
        *,
        page_size: int,
        total_len: int | None = None,
        match: MatchResult | None = None,
    ) -> set[int]:
        return _after_match(end_positions(prompt_len, page_size=page_size, total_len=total_len), match)


class EveryPageAdmission(AdmissionPolicy):
    """A state at every page boundary up to the end of the request."""

    name: ClassVar[str] = "every_page"

    def state_positions(
        self,
        prompt_len: int,
        *,
        page_size: int,
        total_len: int | None = None,
        match: MatchResult | None = None,
    ) -> set[int]:
        _check(prompt_len, page_size, total_len)
        end = prompt_len if total_len is None else total_len
        return _after_match(set(range(page_size, end // page_size * page_size + 1, page_size)), match)


class BlockGridAdmission(AdmissionPolicy):
    """A state every ``num_pages`` pages (a fixed grid), plus the ends when ``include_ends``."""

    name: ClassVar[str] = "block_grid"

    def __init__(self, num_pages: int, *, include_ends: bool = True) -> None:
        if num_pages < 1:
            raise ConfigError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.include_ends = include_ends

    def state_positions(
        self,
        prompt_len: int,
        *,
        page_size: int,
        total_len: int | None = None,
        match: MatchResult | None = None,
    ) -> set[int]:
        _check(prompt_len, page_size, total_len)
        end = prompt_len if total_len is None else total_len
        step = self.num_pages * page_size
        out = set(range(step, end // step * step + 1, step))
        if self.include_ends:
            out |= end_positions(prompt_len, page_size=page_size, total_len=total_len)
        return _after_match(out, match)

    def __repr__(self) -> str:
        return f"BlockGridAdmission({self.num_pages}, include_ends={self.include_ends})"
