"""A prefix restored split through the scheduler: the head computed while the tail (KV pages and
the state at its end) is read from storage. The continuation equals, bit for bit, a cold run
with the same prefill segmentation; a corrupt tail is computed instead, never served; and under
an admission policy that keeps a state at every page, the states the request leaves in the tree
(the tail's end state among them) are the cold run's, bit for bit."""

from __future__ import annotations

import itertools
from pathlib import Path
from unittest import mock

import pytest
import torch
from serving import PAGE, device_of, serving_config, split_cost, tiny_model, tiny_spec

from asynccache.cache import HybridCache
from asynccache.policy import EveryPageAdmission
from asynccache.reference.model import HybridModel
from asynccache.reference.scheduler import RequestResult, Scheduler, SchedulerConfig
from asynccache.restore_cost import SplitTiming
from asynccache.spec import HybridSpec

OUT = 4
P1 = [(7 * t + 3) % 250 + 1 for t in range(48)]
Q2 = [(11 * t + 5) % 250 + 1 for t in range(9)]
# Chunks of one page: every split point is a chunk boundary of every run below, so a cold run
# with the same chunking computes exactly what the split path computes or restores.
SEGMENTATION = SchedulerConfig(chunk_size=PAGE, max_batch_tokens=4096)


@pytest.fixture(scope="module")
def spec() -> HybridSpec:
    return tiny_spec()


@pytest.fixture(scope="module")
def model(spec: HybridSpec, model_device: str) -> HybridModel:
    return tiny_model(spec, model_device, seed=5)


async def first_turn_in_storage(cache: HybridCache, sched: Scheduler) -> list[int]:
    """Serve P1, let its pages and states reach storage, flush device and host: the next
    turn's prompt (returned) finds its prefix in storage only."""
    r1 = await sched.generate(P1, OUT)
    p2 = P1 + r1.output_ids + Q2
    assert cache.controller.tiering is not None
    await cache.controller.wait_idle()
    await cache.controller.tiering.drain()
    cache.flush_device()
    cache.flush_host()
    assert cache.tree.match_prefix(p2[:-1]).num_tokens == 0
    return p2


async def serve_split(
    model: HybridModel, spec: HybridSpec, root: Path, *, corrupt_tail: bool = False
) -> tuple[RequestResult, list[int], dict[str, int]]:
    cache_cm = HybridCache(spec, serving_config(spec, root.as_uri()), device=device_of(model))
    async with cache_cm as cache, Scheduler(model, cache, SEGMENTATION) as sched:
        p2 = await first_turn_in_storage(cache, sched)
        tier = cache.controller.tiering
        assert tier is not None
        if corrupt_tail:
            for path in root.rglob("*"):  # flip one payload byte of every stored object
                if path.is_file():
                    data = bytearray(path.read_bytes())
                    data[-1] ^= 0xFF
                    path.write_bytes(bytes(data))
        tier.cost = split_cost(spec)
        with (
            mock.patch.object(SplitTiming, "head_started", autospec=True, side_effect=SplitTiming.head_started) as started,
            mock.patch.object(SplitTiming, "head_done", autospec=True, side_effect=SplitTiming.head_done) as done,
        ):
            r2 = await sched.generate(p2, OUT)
        await cache.controller.wait_idle()
        await tier.drain()
        cache.tree.check_integrity()
        counts = dict(tier.counts)
        counts["heads_reported"] = started.call_count + done.call_count  # by the scheduler
        counts["heads_observed"] = tier.compute_beside_reads.samples
        # Everything on host belongs to the tree again: flushing it frees every slot.
        cache.flush_device()
        cache.flush_host()
        host = (cache.host_kv, cache.host_mamba)
        counts["host_slots_leaked"] = sum(p.num_items - p.num_free for p in host if p is not None)
        return r2, p2, counts


async def cold(model: HybridModel, spec: HybridSpec, prompt: list[int]) -> RequestResult:
    cfg = SchedulerConfig(
        chunk_size=SEGMENTATION.chunk_size, max_batch_tokens=SEGMENTATION.max_batch_tokens, use_cache=False
    )
    cache_cm = HybridCache(spec, serving_config(spec), device=device_of(model))
    async with cache_cm as cache, Scheduler(model, cache, cfg) as sched:
        return await sched.generate(prompt, OUT)


async def test_split_restore_equals_cold_bit_for_bit(model: HybridModel, spec: HybridSpec, tmp_path: Path) -> None:
    r2, p2, counts = await serve_split(model, spec, tmp_path)
    assert counts["prefetch_tail"] == 1 and counts["tail_pages"] > 0
    restored = r2.cached_by_tier["storage"]
    assert restored == counts["tail_pages"] * PAGE
    assert 0 < restored < len(p2) - PAGE and r2.cached_tokens == restored  # the head was computed
    ref = await cold(model, spec, p2)
    assert torch.equal(r2.first_logits, ref.first_logits)
    assert r2.output_ids == ref.output_ids
    assert counts["host_slots_leaked"] == 0
    # The scheduler reports the head's start and end; whether its time corrects the compute
    # estimate depends on which side finished first (see SplitTiming), so that is not asserted.
    assert counts["heads_reported"] == 2


async def test_corrupt_tail_is_computed_not_served(model: HybridModel, spec: HybridSpec, tmp_path: Path) -> None:
    r2, p2, counts = await serve_split(model, spec, tmp_path, corrupt_tail=True)
    assert counts.get("prefetch_tail", 0) == 1 and counts.get("tail_pages", 0) == 0
    assert r2.cached_tokens == 0
    ref = await cold(model, spec, p2)
    assert torch.equal(r2.first_logits, ref.first_logits)
    assert counts["host_slots_leaked"] == 0
    assert counts["heads_observed"] == 0  # a failed read teaches the model nothing


def states_on_device(cache: HybridCache, prompt: list[int]) -> dict[int, bytes]:
    """The tree's device state at each page boundary of ``prompt`` where it holds one, as the
    bytes of every recurrent layer."""
    pool, out = cache.device_mamba, {}
    for p in range(PAGE, len(prompt), PAGE):
        node = cache.tree.match_prefix(prompt[:p]).last_node
        if node.end_tokens == p and node.device_state is not None:
            slot = node.device_state
            out[p] = b"".join(pool.layer_items(lid)[slot].cpu().numpy().tobytes() for lid in cache.spec.mamba_layer_ids)
    return out


async def test_split_restore_fills_the_state_snapshots_the_admission_keeps(
    model: HybridModel, spec: HybridSpec, tmp_path: Path
) -> None:
    """Every-page admission snapshots the request's state at each page it passes: at the pages
    its head computes, at the tail's end (the restored state, copied to that snapshot's slot
    with the working slot's) and at the pages after it. Each equals the cold run's state."""
    device = device_of(model)
    cache_cm = HybridCache(spec, serving_config(spec, tmp_path.as_uri()), device=device, admission=EveryPageAdmission())
    async with cache_cm as cache, Scheduler(model, cache, SEGMENTATION) as sched:
        p2 = await first_turn_in_storage(cache, sched)
        tier = cache.controller.tiering
        assert tier is not None
        tier.cost = split_cost(spec)
        r2 = await sched.generate(p2, OUT)
        await cache.controller.wait_idle()
        assert tier.counts["prefetch_tail"] == 1 and tier.counts["tail_pages"] > 0
        restored = r2.cached_by_tier["storage"]
        split_states = states_on_device(cache, p2)
        cache.tree.check_integrity()
    cold_cm = HybridCache(spec, serving_config(spec), device=device, admission=EveryPageAdmission())
    async with cold_cm as cold_cache, Scheduler(model, cold_cache, SEGMENTATION) as cold_sched:
        ref = await cold_sched.generate(p2, OUT)
        cold_states = states_on_device(cold_cache, p2)
    assert r2.output_ids == ref.output_ids
    # The tail is the one gap between snapshots: its pages were read, not computed.
    keys = sorted(split_states)
    gaps = [(a, b) for a, b in itertools.pairwise(keys) if b - a > PAGE]
    assert len(gaps) == 1 and gaps[0][1] - gaps[0][0] == restored > 0
    tail_end = gaps[0][1]
    assert keys[0] == PAGE and keys[-1] > tail_end  # snapshots in the head, at its end and past it
    assert {p: cold_states[p] for p in split_states} == split_states
