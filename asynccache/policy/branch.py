"""Branch-point admission (Marconi-style): the ends, plus where a new prompt leaves the tree.

Marconi (MLSys 2025) keeps recurrent states only where a later request can resume: at sequence
ends and at *branch points* — the depth where a new prompt diverges from a cached sequence,
which becomes an interior node of the radix tree. The state there is computed by the request
that creates the branch (its prefill passes through that position), so a shared prefix is served
from its *third* occurrence on::

    1st  A = S+x   cached with a state at the end of A only
    2nd  B = S+y   matches KV up to |S| but no state there → miss; snapshots a state at |S|
    3rd  C = S+z   resumes from the state at |S|

:class:`BranchAdmission` asks for the positions of
:class:`~asynccache.policy.EndsAdmission` (prompt end, last page before it, output end) and for
the branch point ``match.num_matched_tokens`` (the tokens whose KV the tree holds on any tier,
page-aligned) when it lies past the usable prefix and inside the prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from asynccache.policy.admission import EndsAdmission, end_positions

if TYPE_CHECKING:
    from asynccache.tree.results import MatchResult

__all__ = ["BranchAdmission", "branch_position"]


def branch_position(match: MatchResult | None, *, prompt_len: int, page_size: int) -> int | None:
    """The page-aligned depth where the prompt leaves the tree's KV, if a state there is new
    and useful: past the usable prefix (``match.num_tokens``), short of the prompt's last full
    page (a prompt that is all cached ends there anyway). ``None`` otherwise."""
    if match is None:
        return None
    branch = match.num_matched_tokens // page_size * page_size
    if branch <= match.num_tokens or branch <= 0:
        return None
    if branch >= prompt_len // page_size * page_size:
        return None
    return branch


class BranchAdmission(EndsAdmission):
    """States at the ends and at branch points (see the module docstring)."""

    name: ClassVar[str] = "branch"

    def state_positions(
        self,
        prompt_len: int,
        *,
        page_size: int,
        total_len: int | None = None,
        match: MatchResult | None = None,
    ) -> set[int]:
        positions = end_positions(prompt_len, page_size=page_size, total_len=total_len)
        branch = branch_position(match, prompt_len=prompt_len, page_size=page_size)
        if branch is not None:
            positions.add(branch)
        if match is not None:
            positions = {p for p in positions if p > match.num_tokens}
        return positions
