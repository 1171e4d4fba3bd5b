"""The scheduler's warm-up (``SchedulerConfig.warm_up_tokens`` → ``HybridModel.warm_up``): a
prompt's first pass at every bucket length, computed before serving on device pages and a slot
that are given back after, changing nothing that requests then get.

On the CPU a model's passes always run eagerly (a ``LayerGraphs`` never captures there), so these
tests give the tiny CPU model the graphs' bookkeeping and check what the warm-up computes, takes
and gives back; ``tests/gpu/test_layer_graphs_gpu.py`` checks the graphs it captures on a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from serving import config_with, free_counts, serving_config, tiny_model, tiny_spec

from asynccache.cache import HybridCache
from asynccache.errors import CapacityError, ConfigError
from asynccache.reference.graphs import LayerGraphs
from asynccache.reference.model import HybridModel
from asynccache.reference.padding import bucket_lengths
from asynccache.reference.scheduler import Scheduler, SchedulerConfig

SPEC = tiny_spec()
PROMPT = [(7 * t + 3) % 250 + 1 for t in range(41)]


def graphed_model(*, graphs: bool = True, bucket_passes: bool = True, max_tokens: int = 2048) -> HybridModel:
    """The tiny CPU model with the bookkeeping of CUDA graphs, as a CUDA model has it."""
    model = tiny_model(SPEC, "cpu", seed=3, bucket_passes=bucket_passes)
    model.layer_graphs = LayerGraphs(max_tokens=max_tokens) if graphs else None
    return model


def record_forwards(model: HybridModel) -> list[list[tuple[int, int]]]:
    """Each forward's sequences as ``(start, new tokens)``, from now on."""
    calls: list[list[tuple[int, int]]] = []
    forward = model.forward

    async def spy(batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append([(s.start, s.num_new_tokens) for s in batch.sequences])
        return await forward(batch, *args, **kwargs)

    model.forward = spy  # type: ignore[method-assign]
    return calls


async def serve(model: HybridModel, warm_up_tokens: int) -> tuple[Any, list[list[tuple[int, int]]], int]:
    """One prompt served after entering a scheduler with that warm-up (which gives back all it
    took): the result, the forwards the warm-up made and the layer graphs it reports."""
    async with HybridCache(SPEC, serving_config(SPEC)) as cache:
        before = free_counts(cache)
        calls = record_forwards(model)
        async with Scheduler(model, cache, SchedulerConfig(warm_up_tokens=warm_up_tokens)) as sched:
            warm_calls = list(calls)
            assert free_counts(cache) == before  # the warm-up's pages and slot are back
            assert cache.tree.root.children == {}  # and nothing of it entered the tree
            result = await sched.generate(PROMPT, 4)
        return result, warm_calls, sched.warmed_graphs


async def test_the_warm_up_computes_each_bucket_length_before_serving() -> None:
    cold, no_calls, _ = await serve(graphed_model(), 0)
    warm, calls, warmed = await serve(graphed_model(), 256)
    assert no_calls == []
    # Each bucket length from position 0, twice: computed eagerly once, then (on a GPU) captured.
    assert calls == [[(0, n)] for n in bucket_lengths(256) for _ in range(2)]
    assert bucket_lengths(256) == (64, 128, 192, 256)
    assert warmed == 0  # nothing is captured on the CPU
    # What a request gets does not depend on the warm-up having run.
    assert warm.output_ids == cold.output_ids
    assert torch.equal(warm.first_logits, cold.first_logits)


async def test_the_warm_up_stops_at_the_graphs_bound() -> None:
    _, calls, _ = await serve(graphed_model(max_tokens=200), 10**6)
    assert [c[0][1] for c in calls[::2]] == [64, 128, 192]


@pytest.mark.parametrize("graphs, buckets", [(False, True), (True, False)], ids=["no-graphs", "own-lengths"])
async def test_nothing_is_warmed_without_graphs_or_buckets(graphs: bool, buckets: bool) -> None:
    """Without graphs nothing would be captured; without buckets a head's own length would not
    meet the bucket lengths' graphs."""
    _, calls, warmed = await serve(graphed_model(graphs=graphs, bucket_passes=buckets), 2048)
    assert calls == [] and warmed == 0


async def test_a_warm_up_without_room_is_refused_and_takes_nothing() -> None:
    model = graphed_model()
    async with HybridCache(SPEC, config_with(SPEC, device_kv_pages=3)) as cache:
        before = free_counts(cache)
        with pytest.raises(CapacityError, match="warm-up pass of 256 tokens"):
            async with Scheduler(model, cache, SchedulerConfig(warm_up_tokens=256)):
                pass
        assert free_counts(cache) == before


@pytest.mark.parametrize("value", [-1, 1.5, True, "64"])
def test_warm_up_tokens_is_checked(value: object) -> None:
    with pytest.raises(ConfigError, match="warm_up_tokens"):
        SchedulerConfig(warm_up_tokens=value)  # type: ignore[arg-type]


async def test_the_model_checks_its_warm_up() -> None:
    model = graphed_model(max_tokens=256)
    async with HybridCache(SPEC, serving_config(SPEC)) as cache:
        kv, st = cache.device_kv, cache.device_mamba
        pages = torch.arange(256 // SPEC.page_size)
        with pytest.raises(ConfigError, match=r"warm-up lengths must be in \[1, 256\]"):
            await model.warm_up(kv, st, lengths=[64, 320], kv_page_indices=pages, state_slot=0)
        with pytest.raises(ConfigError, match=f"needs {256 // SPEC.page_size} KV pages, got 2"):
            await model.warm_up(kv, st, lengths=[256], kv_page_indices=pages[:2], state_slot=0)
        calls = record_forwards(model)
        assert await model.warm_up(kv, st, lengths=[], kv_page_indices=pages, state_slot=0) == 0
        assert await model.warm_up(kv, st, lengths=[128, 64, 128], kv_page_indices=pages, state_slot=0) == 0
        assert calls == [[(0, 64)], [(0, 64)], [(0, 128)], [(0, 128)]]  # ascending, each once
