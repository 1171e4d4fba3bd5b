"""Unit tests of the trace policies' decisions (positions, grid density, α tuning)."""

from __future__ import annotations

import numpy as np
import pytest
from trace_builders import make_config, make_spec, mixed_trace

from asynccache.errors import ConfigError
from asynccache.policy.adaptive import AdaptiveAdmission
from asynccache.policy.branch import BranchAdmission, branch_position
from asynccache.policy.cost_aware import CostAwareEviction, _auc
from asynccache.trace.policies import PolicyCombo, parse_combo
from asynccache.trace.replay import TraceReplay
from asynccache.tree import (
    InsertResult,
    MatchResult,
    PageHashes,
    TreeNode,
    encode_tokens,
    seed_hash,
)

PAGE = 8


def _root() -> TreeNode:
    return TreeNode(node_id=1, parent=None, key=b"", start_page=0, num_pages=0, page_size=PAGE)


def _match(num_tokens: int, matched: int) -> MatchResult:
    return MatchResult(num_tokens=num_tokens, last_node=_root(), num_matched_tokens=matched)


def test_branch_position_is_where_the_prompt_leaves_the_cached_kv() -> None:
    assert branch_position(_match(0, 24), prompt_len=41, page_size=PAGE) == 24
    assert branch_position(_match(24, 24), prompt_len=41, page_size=PAGE) is None  # state already there
    assert branch_position(_match(0, 40), prompt_len=41, page_size=PAGE) is None  # the prompt end covers it
    assert branch_position(_match(0, 0), prompt_len=41, page_size=PAGE) is None
    assert branch_position(None, prompt_len=41, page_size=PAGE) is None


def test_branch_admission_positions() -> None:
    adm = BranchAdmission()
    assert adm.state_positions(41, page_size=PAGE, match=_match(0, 24)) == {24, 40}
    assert adm.state_positions(41, page_size=PAGE, match=_match(8, 16)) == {16, 40}
    assert adm.state_positions(41, page_size=PAGE, total_len=60, match=None) == {40, 56}
    assert adm.state_positions(40, page_size=PAGE) == {32, 40}  # prompt end and the page before it


def _feed(adm: AdaptiveAdmission, *, pages_per_s: float, seconds: int) -> None:
    root = _root()
    for t in range(seconds + 1):
        adm.observe_insert(InsertResult(last_node=root, num_new_pages=int(pages_per_s)), now=float(t))


def _match_of(tokens: list[int], page_hashes_of: list[int] | None = None) -> MatchResult:
    buf, n = encode_tokens(np.asarray(tokens, dtype=np.int64), PAGE)
    return MatchResult(num_tokens=0, last_node=_root(), page_hashes=PageHashes(buf, n, PAGE, seed_hash("t", "")))


def test_adaptive_grid_is_the_densest_that_a_tier_retains_for_the_reuse_horizon() -> None:
    spec = make_spec(PAGE)
    kv, state = spec.kv_page_bytes, spec.state_bytes
    adm = AdaptiveAdmission(spec=spec, budget={}, horizon_margin=1.0, initial_horizon_s=100.0)
    _feed(adm, pages_per_s=10, seconds=50)
    rate = adm.pages_per_s
    assert rate == pytest.approx(510 / 50)
    # A grid g needs rate · horizon · (kv + state / g) bytes.
    need = {g: rate * 100.0 * (kv + state / g) for g in (1, 2, 4)}
    assert adm.choose_grid(int(need[1] * 1.01)) == 1
    assert adm.choose_grid(int(need[2] * 1.01)) == 2
    assert adm.choose_grid(int(need[4] * 1.01)) == 4
    assert adm.choose_grid(int(rate * 100.0 * kv * 0.5)) is None  # not even the KV: no grid
    assert adm.choose_grid(0) is None


def test_adaptive_learns_the_reuse_horizon_from_every_prompt() -> None:
    spec = make_spec(PAGE)
    adm = AdaptiveAdmission(
        spec=spec, budget={"device": 1 << 30}, min_observations=1, initial_horizon_s=9999.0, regrid_interval_s=0.0
    )
    first = list(range(3 * PAGE + 1))  # 3 full pages
    adm.observe_match(_match_of(first), prompt_len=len(first), now=0.0)
    assert adm.reuse_horizon_s() == 9999.0
    # No reuse seen yet: the tree's tiers get no grid, whatever their size.
    assert adm.state_positions(len(first), page_size=PAGE) == {3 * PAGE}
    second = first[:-1] + list(range(900, 900 + 2 * PAGE))  # extends the first prompt's end
    adm.observe_match(_match_of(second), prompt_len=len(second), now=100.0)
    assert adm.reuse_horizon_s() == pytest.approx(100.0)
    _feed(adm, pages_per_s=1, seconds=10)
    assert adm.choose_grid(1 << 30) == 1  # a GiB holds hours of 1 page/s


def _insert_each_second(adm: AdaptiveAdmission, begin: int, end: int) -> None:
    root = _root()
    for t in range(begin, end + 1):
        adm.observe_insert(InsertResult(last_node=root, num_new_pages=1), now=float(t))


def test_adaptive_tree_grid_waits_until_traffic_was_observed_for_its_retention() -> None:
    # A horizon learnt from T seconds of traffic has seen no reuse older than T: the tree's
    # tiers take a grid only once T reaches the time that grid keeps a page.
    spec = make_spec(PAGE)
    capacity = 350 * (spec.kv_page_bytes + spec.state_bytes)  # grid 1 at 1 page/s: ~350 s
    adm = AdaptiveAdmission(
        spec=spec, budget={"device": capacity}, min_observations=1, horizon_margin=1.0, regrid_interval_s=0.0
    )
    first = list(range(3 * PAGE + 1))
    adm.observe_match(_match_of(first), prompt_len=len(first), now=0.0)
    second = first[:-1] + list(range(900, 900 + 2 * PAGE))
    adm.observe_match(_match_of(second), prompt_len=len(second), now=100.0)
    assert adm.reuse_horizon_s() == pytest.approx(100.0)
    _insert_each_second(adm, 100, 200)
    assert 300 < adm.retention_s(capacity, 1) < 400
    # Without the observed time every grid qualifies; after 200 s none does.
    assert adm.choose_grid(capacity) == 1
    assert adm.choose_grid(capacity, observed_s=adm.observed_s(200.0)) is None
    assert adm.state_positions(5 * PAGE + 1, page_size=PAGE) == {5 * PAGE}  # the prompt end alone
    assert adm.tree_grid is None
    _insert_each_second(adm, 201, 400)
    assert adm.state_positions(5 * PAGE + 1, page_size=PAGE) == {PAGE, 2 * PAGE, 3 * PAGE, 4 * PAGE, 5 * PAGE}
    assert adm.tree_grid == 1
    assert adm.grid_history == [(400.0, "tree", 1)]


def test_adaptive_storage_positions_skip_the_tree_positions_and_the_match() -> None:
    adm = AdaptiveAdmission(spec=make_spec(PAGE), budget={"storage": 1 << 40})
    positions = adm.storage_positions(6 * PAGE + 3, page_size=PAGE, match=_match(16, 32))
    # Grid 1 (nothing observed yet: all fits) past the usable prefix (16); the tree keeps 32
    # (branch) and 48 (prompt end) itself.
    assert positions == {24, 40}
    assert AdaptiveAdmission(spec=make_spec(PAGE), budget={}).storage_positions(99, page_size=PAGE) == set()


def test_auc_ranks_regretted_victims() -> None:
    assert _auc(np.array([3.0, 4.0]), np.array([1.0, 2.0])) == 1.0
    assert _auc(np.array([1.0]), np.array([1.0])) == 0.5
    assert _auc(np.array([]), np.array([1.0])) == 0.5
    assert _auc(np.array([1.0, 3.0]), np.array([2.0])) == 0.5


def test_cost_aware_retunes_alpha_online_to_the_weight_that_best_ranks_regretted_victims() -> None:
    """Replayed with a budget that evicts states a later prompt needs again, cost-aware
    re-tunes α every ``tune_every`` requests from the victims it remembers: each time to a
    weight of its grid under which the victims a later prompt needed (regretted) outrank the
    others at least as often as under any other weight, then starts a new window; and α
    moves as the windows differ."""
    trace = mixed_trace(1, 600, shared=3)
    replay = TraceReplay(trace, make_config("branch/cost-aware", device_pages=24, host_pages=60))
    policy = replay.eviction
    assert isinstance(policy, CostAwareEviction)
    policy.tune_every = 20
    windows: list[tuple[np.ndarray, np.ndarray, int]] = []
    real_tune = policy._tune

    def tune(now: float) -> None:
        ghosts = list(policy._ghosts.resolved)
        tuned_before = len(policy.alpha_history)
        real_tune(now)
        if len(policy.alpha_history) > tuned_before:
            feats = np.asarray([g.features for g in ghosts])
            regret = np.asarray([g.regret for g in ghosts])
            windows.append((feats, regret, len(policy.alpha_history) - 1))
            assert not policy._ghosts.resolved  # the next window starts empty

    policy._tune = tune  # type: ignore[method-assign]
    for i in range(len(trace)):
        replay._request(i)
    assert len(windows) >= 3
    assert len({a for _, a in policy.alpha_history}) >= 2
    for feats, regret, k in windows:
        assert regret.any() and not regret.all()
        scores = {a: feats[:, 0] + a * feats[:, 1] for a in policy.alpha_grid}
        auc = {a: _auc(s[regret], s[~regret]) for a, s in scores.items()}
        chosen = policy.alpha_history[k][1]
        assert chosen in auc and auc[chosen] >= max(auc.values()) - 1e-9


def test_policy_combos_parse_and_validate() -> None:
    c = parse_combo("adaptive/utility/write_back/demote")
    assert c == PolicyCombo(admission="adaptive", eviction="utility", write_policy="write_back", storage_write="demote")
    assert parse_combo("branch/cost-aware").write_policy == "write_through"
    for bad in ("branch", "a/b/c/d/e", "ends/lru/sometimes", "ends/lru/write_back/never"):
        with pytest.raises(ConfigError):
            parse_combo(bad)
