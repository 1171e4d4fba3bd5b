"""Exactness from every tier: a prefix restored from device, host, local disk or the object
store gives (a) the bytes that were saved, (b) logits equal bit for bit to a cold run with the
same prefill segmentation, (c) the greedy output of a cold unsegmented run. A corrupted stored
state is a miss, never served."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from serving import PAGE, device_of, serving_config, tiny_model, tiny_spec

from asynccache.cache import HybridCache
from asynccache.policy import EndsAdmission
from asynccache.pools import DeviceKVPool, DeviceMambaPool
from asynccache.reference.model import ForwardBatch, HybridModel, SequenceInput
from asynccache.reference.scheduler import Scheduler, SchedulerConfig
from asynccache.spec import HybridSpec

OUT = 8
P1 = [(7 * t + 3) % 250 + 1 for t in range(41)]
Q2 = [(11 * t + 5) % 250 + 1 for t in range(13)]


@pytest.fixture(scope="module")
def spec() -> HybridSpec:
    return tiny_spec()


@pytest.fixture(scope="module", params=[False, True], ids=["own-lengths", "bucketed"])
def model(spec: HybridSpec, model_device: str, request: pytest.FixtureRequest) -> HybridModel:
    """Recurrent segments computed at their own lengths and padded to bucket lengths
    (asynccache.reference.padding, the default on CUDA)."""
    return tiny_model(spec, model_device, seed=3, bucket_passes=request.param)


def snapshot_positions(spec: HybridSpec, prompt_len: int, computed_len: int, cached: int) -> list[int]:
    pos = EndsAdmission().state_positions(prompt_len, page_size=spec.page_size, total_len=computed_len)
    return sorted(p for p in pos if cached < p <= computed_len)


def prefix_bytes(cache: HybridCache, tokens: list[int]) -> bytes:
    """Device bytes of a device-resident prefix: every layer's KV pages and the boundary state."""
    m = cache.tree.match_prefix(tokens)
    assert not m.needs_load and m.num_tokens == len(tokens)
    pages = m.device_kv_indices.to(cache.device_kv.device)
    kv = torch.stack([cache.device_kv.layer_items(lid)[pages] for lid in cache.spec.attention_layer_ids])
    slot = m.last_node.device_state
    st = torch.stack([cache.device_mamba.layer_items(lid)[slot] for lid in cache.spec.mamba_layer_ids])
    return kv.cpu().numpy().tobytes() + st.cpu().numpy().tobytes()


async def cold_same_segmentation(model: HybridModel, spec: HybridSpec, out1: list[int], p2: list[int], a: int) -> torch.Tensor:
    """Replay the segmentation the cached path used, with no cache: request 1's prefill (split at
    its snapshots) and decode steps, then request 2's prefill from the state at ``a``."""
    kv = DeviceKVPool(spec, 64, device=device_of(model))
    st = DeviceMambaPool(spec, 8, device=device_of(model))
    pages = torch.arange(32, dtype=torch.int64)
    computed1 = len(P1) + OUT - 1
    snaps1 = snapshot_positions(spec, len(P1), computed1, 0)
    scratch = {p: 2 + i for i, p in enumerate(snaps1)}
    await model.forward(
        ForwardBatch((SequenceInput(token_ids=torch.tensor(P1), start=0, kv_page_indices=pages, state_slot=0,
                                    snapshots={p: s for p, s in scratch.items() if p <= len(P1)}),)),
        kv, st,
    )
    for i in range(OUT - 1):
        start = len(P1) + i
        await model.forward(
            ForwardBatch((SequenceInput(token_ids=torch.tensor([out1[i]]), start=start, kv_page_indices=pages,
                                        state_slot=0, snapshots={p: s for p, s in scratch.items() if p == start + 1}),)),
            kv, st,
        )
    assert a in scratch, f"the cached boundary {a} is one of request 1's snapshots {sorted(scratch)}"
    for lid in spec.mamba_layer_ids:
        items = st.layer_items(lid)
        items[1] = items[scratch[a]]
    snaps2 = snapshot_positions(spec, len(p2), len(p2) + OUT - 1, a)
    logits = await model.forward(
        ForwardBatch((SequenceInput(token_ids=torch.tensor(p2[a:]), start=a, kv_page_indices=pages, state_slot=1,
                                    snapshots={p: 6 for p in snaps2 if p <= len(p2)}),)),
        kv, st,
    )
    return logits[0]


async def serve_two_turns(
    model: HybridModel, spec: HybridSpec, tier: str, storage_uri: str | None, *, corrupt: Any = None
) -> dict[str, Any]:
    async with HybridCache(spec, serving_config(spec, storage_uri), device=device_of(model)) as cache, Scheduler(
        model, cache, SchedulerConfig(chunk_size=4096)
    ) as sched:
        r1 = await sched.generate(P1, OUT)
        p2 = P1 + r1.output_ids + Q2
        a = (len(P1) + OUT - 1) // PAGE * PAGE  # the end-of-output state
        saved = prefix_bytes(cache, p2[:a])
        await cache.controller.wait_idle()
        if tier in ("host", "disk", "s3"):
            cache.flush_device()
        if tier in ("disk", "s3"):
            assert cache.controller.tiering is not None
            await cache.controller.tiering.drain()
            assert cache.controller.tiering.counts["backup_ok"] >= 1
            cache.flush_host()
            assert cache.tree.match_prefix(p2[:-1]).num_tokens == 0
            if corrupt is not None:
                await corrupt(cache)
        r2 = await sched.generate(p2, OUT)
        restored = prefix_bytes(cache, p2[:a]) if r2.cached_tokens == a else None
        cache.tree.check_integrity()
        return {"r1": r1, "r2": r2, "p2": p2, "a": a, "saved": saved, "restored": restored}


async def cold_unsegmented(model: HybridModel, spec: HybridSpec, p2: list[int]) -> list[int]:
    async with HybridCache(spec, serving_config(spec), device=device_of(model)) as cache, Scheduler(
        model, cache, SchedulerConfig(chunk_size=4096, use_cache=False)
    ) as sched:
        return (await sched.generate(p2, OUT)).output_ids


@pytest.mark.parametrize("tier", ["device", "host", "disk", pytest.param("s3", marks=pytest.mark.s3)])
async def test_restored_prefix_is_exact(
    tier: str, model: HybridModel, spec: HybridSpec, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    uri = None
    if tier == "disk":
        uri = (tmp_path / "l3").as_uri()
    elif tier == "s3":
        uri = request.getfixturevalue("s3_uri")
    res = await serve_two_turns(model, spec, tier, uri)
    r2, a = res["r2"], res["a"]
    key = {"device": "device", "host": "host", "disk": "storage", "s3": "storage"}[tier]
    assert r2.cached_tokens == a
    assert r2.cached_by_tier[key] == a
    # (a) bytes restored equal bytes saved
    assert res["restored"] == res["saved"]
    # (b) logits equal bit for bit a cold run with the same segmentation
    ref = await cold_same_segmentation(model, spec, res["r1"].output_ids, res["p2"], a)
    assert torch.equal(r2.first_logits, ref.float().cpu())
    # (c) the greedy output equals a cold unsegmented run
    assert r2.output_ids == await cold_unsegmented(model, spec, res["p2"])


async def test_corrupted_state_on_disk_is_a_miss(model: HybridModel, spec: HybridSpec, tmp_path: Path) -> None:
    root = tmp_path / "l3"

    async def flip_one_byte_of_a_state(cache: HybridCache) -> None:
        states = sorted(p for p in root.rglob("*") if p.is_file() and "/mamba/" in str(p))
        assert states, "no state object was stored"
        for path in states:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x40
            path.write_bytes(bytes(data))

    res = await serve_two_turns(model, spec, "disk", root.as_uri(), corrupt=flip_one_byte_of_a_state)
    r2 = res["r2"]
    # Nothing from storage was served: the corrupt state was detected, the request computed cold.
    assert r2.cached_by_tier["storage"] == 0
    assert r2.cached_tokens == 0
    assert r2.output_ids == await cold_unsegmented(model, spec, res["p2"])


async def test_every_way_of_seeding_a_working_slot_gives_the_same_logits(model: HybridModel, spec: HybridSpec) -> None:
    """The same continuation of a cached prefix, its boundary state brought to the working slot
    three ways: by the request's own load from the host (``load(state_to=)``), per layer after
    the wait (a second request admitted in the same step, whose node slot the first one's load
    fills), and by one copy before the forward (the state already on the device; a second
    cache, same history). The logits agree bit for bit; a missing or early seed would start
    from another state."""

    async def serve(*, flush: bool) -> tuple[list[Any], Any]:
        async with HybridCache(spec, serving_config(spec), device=device_of(model)) as cache, Scheduler(
            model, cache, SchedulerConfig(chunk_size=4096, max_running=2)
        ) as sched:
            r1 = await sched.generate(P1, OUT)
            p2 = P1 + r1.output_ids + Q2
            await cache.controller.wait_idle()
            if flush:
                cache.flush_device()
            # Poison every free state slot: a working slot must get its state from a seed.
            pool = cache.device_mamba
            free = pool.alloc(pool.num_free)
            assert free is not None and pool.buffer is not None
            for slot in free.tolist():
                pool.index_bytes(slot).fill_(0x7F)
            pool.free(free)
            if flush:
                results = list(await asyncio.gather(sched.generate(p2, 1), sched.generate(p2, 1)))
            else:
                results = [await sched.generate(p2, 1)]
            cache.tree.check_integrity()
            return results, (len(P1) + OUT - 1) // PAGE * PAGE

    (own, shared), a = await serve(flush=True)
    (device,), _ = await serve(flush=False)
    assert own.cached_by_tier["host"] == a and device.cached_by_tier["device"] == a
    assert shared.cached_tokens == a
    for r in (shared, device):
        assert torch.equal(r.first_logits, own.first_logits)
