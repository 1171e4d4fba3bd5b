"""Reuse eviction (return probability by turn and age, per byte), superseded states, and the
attention-only reference: hand-made traces with known answers, and determinism."""

from __future__ import annotations

import numpy as np
import pytest
from trace_builders import BLOCK, make_config, make_spec, make_trace, mixed_trace

from asynccache.errors import ConfigError
from asynccache.policy.reuse import ReuseEviction, return_probability
from asynccache.trace.flops import FlopModel
from asynccache.trace.loader import Trace
from asynccache.trace.replay import ReplayConfig, TraceReplay, replay_trace
from asynccache.trace.results import TierBudget
from asynccache.tree import MatchResult, PageHashes, TreeNode, encode_tokens, seed_hash

BIG = 10_000
A = [0, 1, 2, 3]  # 3 full pages (+ 1 token)
A2 = A[:-1] + [4, 5]  # the next turn: 4 full pages
A3 = A2[:-1] + [6, 7]  # and the one after: 5 full pages
B = [10, 11, 12, 13]


def hits_per_request(trace: Trace, config: ReplayConfig) -> tuple[list[int], TraceReplay]:
    replay = TraceReplay(trace, config)
    out = []
    for i in range(len(trace)):
        out.append(sum(replay._request(i)))
        replay.tree.check_integrity()
    return out, replay


def test_return_probability_is_the_conditional_chance_within_the_horizon() -> None:
    gaps = np.asarray([10.0, 20.0, 30.0, 40.0])
    assert return_probability(1.0, gaps, 0.0, 15.0) == pytest.approx(0.25)  # G(15) − G(0)
    assert return_probability(1.0, gaps, 20.0, 15.0) == pytest.approx(0.5)  # 1/4 of the 1/2 left
    assert return_probability(0.5, gaps, 20.0, 15.0) == pytest.approx(0.5 * 0.25 / 0.75)
    assert return_probability(1.0, gaps, 45.0, 15.0) == 0.0


def _match(tokens: list[int]) -> MatchResult:
    buf, n = encode_tokens(np.asarray(tokens, dtype=np.int64), BLOCK)
    root = TreeNode(node_id=1, parent=None, key=b"", start_page=0, num_pages=0, page_size=BLOCK)
    return MatchResult(num_tokens=0, last_node=root, page_hashes=PageHashes(buf, n, BLOCK, seed_hash("t", "")))


def _prompt(ids: list[int]) -> list[int]:
    # Tokens of blocks ``ids`` (all full but the last, which holds one token), as the replay does.
    return [i * 1000 + k for i in ids[:-1] for k in range(BLOCK)] + [ids[-1] * 1000]


def test_turns_and_return_gaps_are_learnt_from_every_prompt() -> None:
    spec = make_spec()
    policy = ReuseEviction(spec=spec, flops=FlopModel.from_spec(spec), min_gaps=1)
    for t, ids in ((0.0, A), (5.0, B), (30.0, A2), (100.0, A3)):
        tokens = _prompt(ids)
        policy.observe_match(_match(tokens[:-1]), prompt_len=len(tokens), now=t)
    assert policy._end_turn == [1, 1, 2, 3]  # A2 extends A's end, A3 extends A2's
    assert list(policy._gaps) == [30.0, 70.0] and policy._resumed == [True, False, True, False]
    policy.refresh(200.0)
    assert policy.horizon_s == pytest.approx(50.0)  # the median gap
    # Every end is older than every gap (fully exposed): overall (2 + 1) / (4 + 2) = 0.5; per turn
    # (resumed + 5 · 0.5) / (ends + 5): turn 1 one of two, turn 2 one of one, turn 3 none of one.
    assert policy.pi[0] == pytest.approx(0.5)
    assert policy.pi[1] == pytest.approx(3.5 / 7)
    assert policy.pi[2] == pytest.approx(3.5 / 6)
    assert policy.pi[3] == pytest.approx(2.5 / 6)


def test_the_ledger_keeps_the_latest_prompt_ends_and_forgets_the_older() -> None:
    """With room for two prompt ends, the ledger drops the oldest as new ones come: an end
    still in it is found (its extension is turn 2, its gap recorded), a dropped one is not
    (its extension counts as a first turn), and the indices of the ends kept stay right."""
    spec = make_spec()
    policy = ReuseEviction(spec=spec, flops=FlopModel.from_spec(spec), min_gaps=1, ledger_size=2)
    c = [20, 21, 22, 23]
    b2 = B[:-1] + [14, 15]
    for t, ids in ((0.0, A), (5.0, B), (10.0, c), (20.0, b2), (30.0, A2)):
        tokens = _prompt(ids)
        policy.observe_match(_match(tokens[:-1]), prompt_len=len(tokens), now=t)
    assert policy._end_turn == [2, 1]  # b2 extended B (still kept); A2 found no end (A dropped)
    assert list(policy._gaps) == [15.0]
    assert len(policy._ledger) == 2 and policy._resumed == [False, False]
    # A prompt end seen again moves to its newer entry: dropping the older one keeps it.
    policy = ReuseEviction(spec=spec, flops=FlopModel.from_spec(spec), min_gaps=1, ledger_size=2)
    for t, ids in ((0.0, A), (1.0, A), (2.0, B), (3.0, A2)):
        tokens = _prompt(ids)
        policy.observe_match(_match(tokens[:-1]), prompt_len=len(tokens), now=t)
    assert policy._end_turn == [1, 3]  # B, then A2 extending the resent A (turn 2)


def test_superseded_prompt_ends_are_released_and_the_next_turns_still_hit() -> None:
    trace = make_trace([(0, A), (1, A2), (2, A3)])
    hits, replay = hits_per_request(trace, make_config("branch/reuse", device_pages=BIG))
    assert hits == [0, 3 * BLOCK, 4 * BLOCK]
    assert replay.released_states == 2
    assert replay.tree.stats().device_states == 1  # one state per live conversation
    # LRU keeps every turn's end.
    hits, replay = hits_per_request(trace, make_config("branch/lru", device_pages=BIG))
    assert hits == [0, 3 * BLOCK, 4 * BLOCK] and replay.tree.stats().device_states == 3


def test_reuse_keeps_the_conversation_likelier_to_return() -> None:
    # Two cached conversations, a deep one (turn 3) and a new one (turn 1) used more recently;
    # with turn 3 far likelier to return, reuse scores the older deep one higher than LRU does.
    trace = make_trace([(0, A), (1, A2), (2, A3), (3, B)])
    _, replay = hits_per_request(trace, make_config("branch/reuse", device_pages=BIG))
    policy = replay.eviction
    assert isinstance(policy, ReuseEviction)
    deep = replay.tree.match_prefix(np.asarray(_synth(replay, A3)[:-1])).last_node
    new = replay.tree.match_prefix(np.asarray(_synth(replay, B)[:-1])).last_node
    assert policy._turn[deep.node_id] == 3 and policy._turn[new.node_id] == 1
    policy.gaps = np.asarray([5.0, 10.0, 20.0, 40.0])
    policy.horizon_s = 30.0
    policy.pi[1], policy.pi[3] = 0.1, 0.9
    deep.last_access, new.last_access = 3.0, 4.0
    now = 10.0
    assert policy.score(deep, key="device_kv", now=now) > policy.score(new, key="device_kv", now=now) > 0


def _synth(replay: TraceReplay, ids: list[int]) -> list[int]:
    length = (len(ids) - 1) * BLOCK + 1
    return replay.synth.tokens(np.asarray(ids), length).tolist()


def test_attention_only_reference_reuses_any_cached_prefix_and_counts_no_state_bytes() -> None:
    shared = make_trace([(0, [0, 1, 2, 3, 4]), (1, [0, 1, 2, 7, 8])])
    hits, _ = hits_per_request(shared, make_config("attention-only/lru", device_pages=BIG))
    assert hits == [0, 3 * BLOCK]  # the second occurrence already: any prefix is usable
    # Two 3-page sequences fit 7 pages of KV; with states (2.75 pages each) they do not.
    trace = make_trace([(0, A), (1, B), (2, A2)])
    hits, replay = hits_per_request(trace, make_config("attention-only/lru", device_pages=7))
    assert hits == [0, 0, 3 * BLOCK]
    assert replay.device_budget.used_bytes() <= 7 * make_spec().kv_page_bytes
    hits, _ = hits_per_request(trace, make_config("ends/lru", device_pages=7))
    assert hits == [0, 0, 0]


def test_attention_only_reference_has_no_storage_tier() -> None:
    with pytest.raises(ConfigError, match="attention-only"):
        ReplayConfig(
            spec=make_spec(),
            budget=TierBudget(device=1 << 20, host=1 << 20, storage=1 << 30),
            combo=make_config("attention-only/lru", device_pages=1).combo,
        )


def _mixed_trace(seed: int) -> Trace:
    return mixed_trace(seed, 150, shared=2)


@pytest.mark.parametrize("combo", ["branch/reuse/write_back", "adaptive/reuse/write_back", "attention-only/lru"])
def test_reuse_and_reference_replays_are_deterministic(combo: str) -> None:
    trace = _mixed_trace(4)
    config = make_config(combo, device_pages=24, host_pages=60)
    a = replay_trace(trace, config).to_json()
    b = replay_trace(trace, config).to_json()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    assert 0 < a["hit_rate"] <= a["extra"]["bound_hit_tokens"] / a["prompt_tokens"]


async def test_controller_engine_releases_like_the_synchronous_one() -> None:
    from asynccache.trace.controller_replay import ControllerReplay

    trace = _mixed_trace(9)
    config = make_config("branch/reuse/write_back", device_pages=24, host_pages=60)
    sync = replay_trace(trace, config)
    ctrl = await ControllerReplay(trace, config).arun()
    assert ctrl.hit_tokens == sync.hit_tokens and ctrl.evictions == sync.evictions
    assert sync.evictions["released_states"] > 0
