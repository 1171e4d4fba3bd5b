"""Adaptive admission: checkpoint density per tier, set from observed reuse and tier bytes.

A state costs the same bytes on every tier, but bytes are scarce on the GPU, dearer on the host
and cheap on a local disk. :class:`AdaptiveAdmission` keeps the sparse, proven positions of
:class:`~asynccache.policy.branch.BranchAdmission` (prompt ends, branch points) everywhere and
adds, per tier, a grid of a state every ``g`` pages — the densest grid (``g`` in
``grid_choices``) the tier can hold for as long as prefixes are observed to come back:

- the tree's tiers (device + host budgets together): :meth:`state_positions`;
- storage only (:meth:`storage_positions`): snapshots written straight to storage.

Dense checkpoints serve a shared prefix on its *second* occurrence (a branch point nobody has
snapshotted yet) and let eviction keep the front of a long sequence; they pay off only where
they survive until that second occurrence. Two running measurements decide:

- *inflow*: full pages inserted per second (exponentially weighted over ``rate_window_s``);
- *reuse horizon*: the ``reuse_quantile`` of observed reuse ages — for every prompt, the time
  since the deepest earlier prompt end it extends was last seen. These are seen for every
  prompt, cached or not (a ledger of prompt-end page hashes, not the cache's own hits), so the
  estimate does not shrink with the cache.

With ``kv`` bytes per page and ``s`` bytes per state, a grid ``g`` fills a tier at
``inflow · (kv + s / g)`` bytes per second and so retains ``capacity / that`` seconds of
traffic; the densest ``g`` retaining ``horizon_margin ×`` the reuse horizon wins, ``None`` (no
grid) when none does; the choice is revisited every ``regrid_interval_s`` of trace time. Until
``min_observations`` reuses are seen the horizon is ``initial_horizon_s`` and the tree's tiers
get no grid.

The tree's tiers also take a grid only once prompts have been observed for at least as long as
that grid retains them. Reuse ages seen after ``T`` seconds are all shorter than ``T``, so early
on the horizon is the quantile of a censored sample and comes out short (on the Mooncake
conversation trace: 75 s after 250 s, 160 s after 500 s, 460 s at the end). Without the rule a
512 GiB host took grids of 1–32 pages in the trace's first 1,000 s and reached 0.888 of the
bound; with it, 0.907 (0.910 with no grid at all), and a 2 TiB host 0.965 instead of 0.959.
Storage is exempt: its snapshots only fill free space.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from asynccache.errors import ConfigError
from asynccache.policy.branch import BranchAdmission
from asynccache.policy.window import SortedWindow
from asynccache.spec import HybridSpec

if TYPE_CHECKING:
    from asynccache.tree.results import InsertResult, MatchResult

__all__ = ["AdaptiveAdmission"]


class AdaptiveAdmission(BranchAdmission):
    """Branch points everywhere plus a learnt grid per tier (module docstring)."""

    name: ClassVar[str] = "adaptive"

    def __init__(
        self,
        *,
        spec: HybridSpec,
        budget: Mapping[str, int],
        grid_choices: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
        reuse_quantile: float = 0.95,
        horizon_margin: float = 3.0,
        rate_window_s: float = 300.0,
        initial_horizon_s: float = 600.0,
        min_observations: int = 50,
        ledger_size: int = 100_000,
        regrid_interval_s: float = 60.0,
    ) -> None:
        if not grid_choices or any(g < 1 for g in grid_choices):
            raise ConfigError("grid_choices must be positive page counts")
        if not 0 < reuse_quantile < 1 or horizon_margin <= 0 or rate_window_s <= 0 or initial_horizon_s <= 0:
            raise ConfigError("reuse_quantile in (0, 1); horizon_margin, rate_window_s, initial_horizon_s > 0")
        self.kv_bytes = spec.kv_page_bytes
        self.state_bytes = spec.state_bytes
        self.tree_bytes = int(budget.get("device", 0)) + int(budget.get("host", 0))
        self.storage_bytes = int(budget.get("storage", 0))
        self.grid_choices = tuple(sorted(grid_choices))
        self.reuse_quantile = reuse_quantile
        self.horizon_margin = horizon_margin
        self.rate_window_s = rate_window_s
        self.initial_horizon_s = initial_horizon_s
        self.min_observations = min_observations
        self.ledger_size = ledger_size
        self.regrid_interval_s = regrid_interval_s
        self._regrid_at: dict[str, float] = {}
        self._inserts: deque[tuple[float, int]] = deque()  # (time, new pages) within the window
        self._last_insert: float | None = None
        self._first_seen: float | None = None  # time of the first prompt observed
        self._horizon_s = initial_horizon_s
        self._prompt_ends: OrderedDict[bytes, float] = OrderedDict()  # end-page hash → last seen
        self._reuse_ages = SortedWindow(4096)
        self.tree_grid: int | None = None
        self.storage_grid: int | None = None
        self.grid_history: list[tuple[float, str, int | None]] = []

    # ---- learning ------------------------------------------------------------------------
    def observe_match(self, match: MatchResult, *, prompt_len: int, now: float) -> None:
        """Record the reuse age of this prompt (uncensored: cached or not) and its end."""
        hashes = match.page_hashes
        raw = getattr(hashes, "raw", None)
        if raw is None or not len(hashes):
            return
        if self._first_seen is None:
            self._first_seen = now
        page = match.last_node.page_size
        for i in range(min(len(hashes), (prompt_len - 1) // page) - 1, -1, -1):
            seen = self._prompt_ends.get(raw(i))
            if seen is not None:
                self._reuse_ages.append(now - seen)
                n = len(self._reuse_ages)
                if n >= self.min_observations and (n == self.min_observations or n % 64 == 0):
                    self._horizon_s = self._reuse_ages.quantile(self.reuse_quantile)
                break
        end = prompt_len // page
        key = raw(end - 1) if 0 < end <= len(hashes) else raw(len(hashes) - 1)
        self._prompt_ends[key] = now
        self._prompt_ends.move_to_end(key)
        while len(self._prompt_ends) > self.ledger_size:
            self._prompt_ends.popitem(last=False)

    def observe_insert(self, result: InsertResult, *, now: float) -> None:
        """Record the pages this insert added (for the inflow over the last ``rate_window_s``)."""
        self._inserts.append((now, result.num_new_pages))
        while self._inserts and self._inserts[0][0] < now - self.rate_window_s:
            self._inserts.popleft()
        self._last_insert = now

    @property
    def pages_per_s(self) -> float:
        """New full pages per second over the last ``rate_window_s`` (0 before two inserts)."""
        if len(self._inserts) < 2:
            return 0.0
        span = max(self._inserts[-1][0] - self._inserts[0][0], 1.0)
        return sum(n for _, n in self._inserts) / span

    def reuse_horizon_s(self) -> float:
        """The ``reuse_quantile`` of observed reuse ages (``initial_horizon_s`` until
        ``min_observations`` are seen; refreshed every 64 observations)."""
        return self._horizon_s

    def retention_s(self, capacity_bytes: int, grid: int | None) -> float:
        """Seconds of current traffic ``capacity_bytes`` hold with a state every ``grid`` pages."""
        per_page = self.kv_bytes + (self.state_bytes / grid if grid else 0.0)
        inflow = self.pages_per_s * per_page
        return float("inf") if inflow <= 0 else capacity_bytes / inflow

    def observed_s(self, now: float) -> float:
        """Seconds of traffic observed by ``now`` (since the first prompt; 0 before it)."""
        return 0.0 if self._first_seen is None else max(now - self._first_seen, 0.0)

    def choose_grid(self, capacity_bytes: int, *, observed_s: float = float("inf")) -> int | None:
        """The densest grid a tier of ``capacity_bytes`` retains for the reuse horizon, among
        those whose retention is at most ``observed_s``: a horizon learnt from ``observed_s``
        seconds of traffic has seen no reuse older than that, so it cannot vouch for a grid that
        keeps pages longer."""
        if capacity_bytes <= 0:
            return None
        need = self.horizon_margin * self.reuse_horizon_s()
        for g in self.grid_choices:
            if need <= self.retention_s(capacity_bytes, g) <= observed_s:
                return g
        return None

    def _update(self, tier: str, capacity_bytes: int) -> int | None:
        # Re-decided at most every regrid_interval_s of trace time (no flapping between grids).
        now = 0.0 if self._last_insert is None else self._last_insert
        last = self._regrid_at.get(tier)
        if last is not None and now - last < self.regrid_interval_s:
            return getattr(self, f"{tier}_grid")  # type: ignore[no-any-return]
        self._regrid_at[tier] = now
        # The tree's tiers are scarce: no grid there before reuse has been observed, nor one
        # keeping pages longer than traffic has been observed (module docstring). Storage
        # snapshots are speculative (they only fill free space), so storage may start dense.
        if tier == "storage":
            grid = self.choose_grid(capacity_bytes)
        elif len(self._reuse_ages) < self.min_observations:
            grid = None
        else:
            grid = self.choose_grid(capacity_bytes, observed_s=self.observed_s(now))
        if grid != getattr(self, f"{tier}_grid"):
            setattr(self, f"{tier}_grid", grid)
            self.grid_history.append((now, tier, grid))
        return grid

    # ---- positions -----------------------------------------------------------------------
    @staticmethod
    def _grid(grid: int | None, prompt_len: int, page_size: int, start: int) -> set[int]:
        if grid is None:
            return set()
        step = grid * page_size
        end = prompt_len // page_size * page_size
        return {p for p in range(step, end + 1, step) if p > start}

    def state_positions(
        self,
        prompt_len: int,
        *,
        page_size: int,
        total_len: int | None = None,
        match: MatchResult | None = None,
    ) -> set[int]:
        """Ends and branch points, plus the tree tiers' grid over the prompt's full pages."""
        positions = super().state_positions(prompt_len, page_size=page_size, total_len=total_len, match=match)
        start = match.num_tokens if match is not None else 0
        return positions | self._grid(self._update("tree", self.tree_bytes), prompt_len, page_size, start)

    def storage_positions(self, prompt_len: int, *, page_size: int, match: MatchResult | None = None) -> set[int]:
        """Storage-only snapshots: the storage grid past the usable prefix, minus what the tree
        keeps anyway."""
        start = match.num_tokens if match is not None else 0
        grid = self._grid(self._update("storage", self.storage_bytes), prompt_len, page_size, start)
        if not grid:
            return set()
        return grid - self.state_positions(prompt_len, page_size=page_size, match=match)

    def describe(self) -> dict[str, Any]:
        return {
            "tree_grid": self.tree_grid,
            "storage_grid": self.storage_grid,
            "grid_history": self.grid_history[-20:],
            "reuse_horizon_s": self.reuse_horizon_s(),
            "pages_per_s": self.pages_per_s,
        }
