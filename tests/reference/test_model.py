"""The reference hybrid model on CPU (fp32, tiny preset): segmentation, snapshots, KV placement,
restore-and-continue, safetensors, and the per-layer wait on the transfer counter."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from asynccache.errors import ConfigError
from asynccache.layer_counter import LayerTransferCounter
from asynccache.pools import DeviceKVPool, DeviceMambaPool
from asynccache.reference import ForwardBatch, HybridModel, SequenceInput
from asynccache.spec import HybridSpec

SPEC = HybridSpec.preset("tiny")
P = SPEC.page_size


#: Every test runs with the recurrent layers' segments at their own lengths and padded to
#: bucket lengths (asynccache.reference.padding; the default on CUDA).
_BUCKET_PASSES = {"on": False}


@pytest.fixture(autouse=True, params=[False, True], ids=["own-lengths", "bucketed"])
def bucket_passes(request: pytest.FixtureRequest) -> bool:
    _BUCKET_PASSES["on"] = request.param
    return bool(request.param)


def make_model(seed: int = 0, **kwargs: object) -> HybridModel:
    kwargs.setdefault("bucket_passes", _BUCKET_PASSES["on"])
    return HybridModel(SPEC, seed=seed, **kwargs)  # type: ignore[arg-type]


def make_pools(num_pages: int = 24, num_slots: int = 12) -> tuple[DeviceKVPool, DeviceMambaPool]:
    """Pools filled with 0xFF bytes (NaN in fp32), so reading anything unwritten poisons the logits."""
    kv, st = DeviceKVPool(SPEC, num_pages), DeviceMambaPool(SPEC, num_slots)
    assert kv.buffer is not None and st.buffer is not None
    kv.buffer.fill_(0xFF)
    st.buffer.fill_(0xFF)
    return kv, st


def make_tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def seq(
    ids: torch.Tensor, start: int, pages: list[int] | torch.Tensor, slot: int, snapshots: Mapping[int, int] | None = None
) -> SequenceInput:
    return SequenceInput(
        token_ids=ids,
        start=start,
        kv_page_indices=torch.as_tensor(pages, dtype=torch.int64),
        state_slot=slot,
        snapshots=dict(snapshots or {}),
    )


async def run(
    model: HybridModel, kv: DeviceKVPool, st: DeviceMambaPool, *seqs: SequenceInput, counter: object = None
) -> torch.Tensor:
    return await model.forward(ForwardBatch(sequences=seqs), kv, st, counter)  # type: ignore[arg-type]


async def prefill(
    model: HybridModel,
    kv: DeviceKVPool,
    st: DeviceMambaPool,
    ids: torch.Tensor,
    cuts: list[int],
    pages: list[int],
    slot: int,
) -> torch.Tensor:
    """Prefill ``ids`` in forward calls split at ``cuts``; returns the last call's logits."""
    bounds = [0, *cuts, len(ids)]
    logits = torch.empty(0)
    for lo, hi in itertools.pairwise(bounds):
        logits = await run(model, kv, st, seq(ids[lo:hi], lo, pages, slot))
    return logits


def state_of(st: DeviceMambaPool, slot: int) -> dict[tuple[int, str], torch.Tensor]:
    return {(lid, name): t[slot].clone() for lid in SPEC.mamba_layer_ids for name, t in st.state(lid).items()}


def assert_states_equal(a: dict[tuple[int, str], torch.Tensor], b: dict[tuple[int, str], torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), f"state {key} differs"


# ---- (1) segmentation ------------------------------------------------------------------
@pytest.mark.parametrize("cuts", [[128], [100], [64, 65, 130], [1]])
async def test_segmented_prefill_matches_single_pass(cuts: list[int]) -> None:
    model = make_model()
    ids = make_tokens(200)
    kv, st = make_pools()
    single = await prefill(model, kv, st, ids, [], [0, 1, 2, 3], slot=0)
    kv2, st2 = make_pools()
    split = await prefill(model, kv2, st2, ids, cuts, [0, 1, 2, 3], slot=0)
    assert torch.isfinite(single).all()
    torch.testing.assert_close(split, single, rtol=1e-5, atol=1e-5)
    assert torch.equal(split.argmax(-1), single.argmax(-1))
    for key, value in state_of(st, 0).items():
        torch.testing.assert_close(state_of(st2, 0)[key], value, rtol=1e-5, atol=1e-5)


async def test_state_matters() -> None:
    """Continuing from another sequence's state changes the logits (the state is really used)."""
    model = make_model()
    kv, st = make_pools()
    ids = make_tokens(150)
    await run(model, kv, st, seq(ids[:128], 0, [0, 1, 2], 0))
    await run(model, kv, st, seq(make_tokens(128, seed=9), 0, [3, 4, 5], 1))
    own = await run(model, kv, st, seq(ids[128:], 128, [0, 1, 2], 0))
    st.buffer[:, 0] = st.buffer[:, 1]  # type: ignore[index]
    swapped = await run(model, kv, st, seq(ids[128:], 128, [0, 1, 2], 0))
    assert (own - swapped).abs().max() > 1e-2


# ---- (2) determinism -------------------------------------------------------------------
async def test_same_segmentation_is_bit_identical() -> None:
    model = make_model()
    ids = make_tokens(200)
    results = []
    for slot in (0, 7):
        kv, st = make_pools()
        logits = await prefill(model, kv, st, ids, [128], [0, 1, 2, 3], slot=slot)
        results.append((logits, state_of(st, slot), kv.buffer[:, :4].clone()))  # type: ignore[index]
    (l0, s0, k0), (l1, s1, k1) = results
    assert torch.equal(l0, l1)
    assert_states_equal(s0, s1)
    assert torch.equal(k0, k1)


async def test_start_zero_ignores_the_slot_contents() -> None:
    model = make_model()
    ids = make_tokens(70)
    kv, st = make_pools()  # slot 0 holds NaN bytes
    dirty = await run(model, kv, st, seq(ids, 0, [0, 1], 0))
    kv2, st2 = make_pools()
    st2.buffer.zero_()  # type: ignore[union-attr]
    clean = await run(model, kv2, st2, seq(ids, 0, [0, 1], 0))
    assert torch.isfinite(dirty).all()
    assert torch.equal(dirty, clean)


# ---- (3) snapshots ---------------------------------------------------------------------
async def test_snapshots_equal_the_state_of_a_run_stopped_there() -> None:
    model = make_model()
    ids = make_tokens(200)
    pages = [0, 1, 2, 3]
    kv, st = make_pools()
    logits = await run(model, kv, st, seq(ids, 0, pages, 0, {64: 1, 128: 2, 150: 3, 200: 4}))
    # The same positions as separate forward calls.
    kv2, st2 = make_pools()
    for lo, hi, snap in ((0, 64, 1), (64, 128, 2), (128, 150, 3), (150, 200, 4)):
        split = await run(model, kv2, st2, seq(ids[lo:hi], lo, pages, 5))
        assert_states_equal(state_of(st, snap), state_of(st2, 5))
    assert torch.equal(logits, split)
    assert_states_equal(state_of(st, 0), state_of(st2, 5))  # working slot: state after 200 tokens
    assert torch.equal(kv.buffer[:, :4], kv2.buffer[:, :4])  # type: ignore[index]


async def test_snapshot_states_differ_by_position() -> None:
    model = make_model()
    kv, st = make_pools()
    await run(model, kv, st, seq(make_tokens(192), 0, [0, 1, 2], 0, {64: 1, 128: 2}))
    a, b = state_of(st, 1), state_of(st, 2)
    assert all(torch.isfinite(t).all() for t in a.values())
    assert any(not torch.equal(a[key], b[key]) for key in a)


async def test_continuing_from_a_snapshot_matches_the_split_cold_run() -> None:
    """Restore a snapshot taken mid-prompt into a fresh slot, continue with another suffix."""
    model = make_model()
    prefix, suffix_a, suffix_b = make_tokens(128, 1), make_tokens(72, 2), make_tokens(40, 3)
    kv, st = make_pools()
    await run(model, kv, st, seq(torch.cat([prefix, suffix_a]), 0, [0, 1, 2, 3], 0, {128: 1}))
    st.buffer[:, 6] = st.buffer[:, 1]  # type: ignore[index]  # the cache hands a copy to a new request
    restored = await run(model, kv, st, seq(suffix_b, 128, [0, 1, 4], 6))
    kv2, st2 = make_pools()
    cold = await prefill(model, kv2, st2, torch.cat([prefix, suffix_b]), [128], [5, 6, 7], slot=2)
    assert torch.equal(restored, cold)


# ---- (4) restore into fresh pages and slots --------------------------------------------
async def test_restored_pages_and_state_continue_bit_identically() -> None:
    model = make_model()
    ids = make_tokens(230)
    kv, st = make_pools()
    await run(model, kv, st, seq(ids[:128], 0, [0, 1], 0))
    # Copy the prefix's two pages (every attention layer) and the state into fresh places.
    kv.buffer[:, [10, 11]] = kv.buffer[:, [0, 1]]  # type: ignore[index]
    st.buffer[:, 5] = st.buffer[:, 0]  # type: ignore[index]
    in_place = await run(model, kv, st, seq(ids[128:200], 128, [0, 1, 2, 3], 0))
    restored = await run(model, kv, st, seq(ids[128:200], 128, [10, 11, 12, 13], 5))
    assert torch.equal(in_place, restored)
    assert_states_equal(state_of(st, 0), state_of(st, 5))
    # Decode steps continue identically too.
    a = b = in_place
    for i in range(3):
        a = await run(model, kv, st, seq(a.argmax(-1), 200 + i, [0, 1, 2, 3], 0))
        b = await run(model, kv, st, seq(b.argmax(-1), 200 + i, [10, 11, 12, 13], 5))
        assert torch.equal(a, b)


# ---- (5) KV placement ------------------------------------------------------------------
async def test_kv_written_at_the_right_pages_and_placement_does_not_matter() -> None:
    model = make_model()
    ids = make_tokens(150)  # three pages, the last one partly filled
    kv, st = make_pools()
    contiguous = await prefill(model, kv, st, ids, [70], [0, 1, 2], slot=0)
    kv2, st2 = make_pools()
    scattered_pages = [17, 4, 9]
    scattered = await prefill(model, kv2, st2, ids, [70], scattered_pages, slot=3)
    assert torch.equal(contiguous, scattered)
    for lid in SPEC.attention_layer_ids:
        for cache, cache2 in zip(kv.kv_cache(lid), kv2.kv_cache(lid), strict=True):
            assert torch.equal(cache[[0, 1, 2]].flatten(0, 1)[:150], cache2[scattered_pages].flatten(0, 1)[:150])
            assert torch.isnan(cache2[9, 150 - 2 * P :]).all()  # past the end: untouched
            untouched = [i for i in range(kv2.num_items) if i not in scattered_pages]
            assert torch.isnan(cache2[untouched]).all()


async def test_kv_holds_the_keys_of_each_position() -> None:
    """A position's K/V do not depend on later tokens: a longer run rewrites the same values."""
    model = make_model()
    ids = make_tokens(130)
    kv, st = make_pools()
    await run(model, kv, st, seq(ids[:64], 0, [0], 0))
    page0 = kv.buffer[:, 0].clone()  # type: ignore[index]
    await run(model, kv, st, seq(make_tokens(64, seed=7), 0, [0], 0))
    assert not torch.equal(kv.buffer[:, 0], page0)  # type: ignore[index]
    await run(model, kv, st, seq(ids[:64], 0, [0], 0))
    assert torch.equal(kv.buffer[:, 0], page0)  # type: ignore[index]


# ---- batches ---------------------------------------------------------------------------
async def test_unpacked_batch_equals_sequences_run_alone() -> None:
    model = make_model()
    a, b, c = make_tokens(100, 1), make_tokens(37, 2), make_tokens(1, 3)
    kv, st = make_pools()
    batch = await run(
        model,
        kv,
        st,
        seq(a, 0, [0, 1], 0, {64: 3}),
        seq(b, 0, [2], 1),
        seq(c, 0, [4], 2),
    )
    alone = []
    for s in (seq(a, 0, [5, 6], 6, {64: 9}), seq(b, 0, [7], 7), seq(c, 0, [8], 8)):
        kv2, st2 = make_pools()
        alone.append(await run(model, kv2, st2, s))
    assert torch.equal(batch, torch.cat(alone))


async def test_packed_batch_matches_unpacked() -> None:
    """Packing (the CUDA default) agrees with one-by-one within fp32 tolerance, decode included."""
    unpacked, packed = make_model(), make_model(pack_sequences=True)
    prompts = [make_tokens(n, seed=n) for n in (130, 64, 64, 20, 1)]
    pages = [[0, 1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    results = []
    for model in (unpacked, packed):
        kv, st = make_pools()
        first = await run(
            model, kv, st, *(seq(p, 0, pg, i, {64: 10 + i} if len(p) > 64 else None) for i, (p, pg) in enumerate(zip(prompts, pages, strict=True)))
        )
        lengths = [len(p) for p in prompts]
        steps = [first]
        for _ in range(3):  # batched decode: every sequence one token, different context lengths
            nxt = steps[-1].argmax(-1)
            steps.append(await run(model, kv, st, *(seq(nxt[i : i + 1], lengths[i], pages[i], i) for i in range(5))))
            lengths = [n + 1 for n in lengths]
        results.append((steps, state_of(st, 10)))
    (steps_u, snap_u), (steps_p, snap_p) = results
    for u, p in zip(steps_u, steps_p, strict=True):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, u, rtol=1e-5, atol=1e-5)
        assert torch.equal(p.argmax(-1), u.argmax(-1))
    for key in snap_u:
        torch.testing.assert_close(snap_p[key], snap_u[key], rtol=1e-5, atol=1e-5)


async def test_token_by_token_prefill_matches_chunked() -> None:
    """Single-token forwards take the exact recurrence; a long forward the chunked form."""
    model = make_model()
    ids = make_tokens(80)
    kv, st = make_pools()
    chunked = await run(model, kv, st, seq(ids, 0, [0, 1], 0))
    kv2, st2 = make_pools()
    stepwise = await prefill(model, kv2, st2, ids, list(range(1, 80)), [0, 1], slot=0)
    torch.testing.assert_close(stepwise, chunked, rtol=1e-4, atol=1e-4)
    assert torch.equal(stepwise.argmax(-1), chunked.argmax(-1))


# ---- (6) safetensors -------------------------------------------------------------------
async def test_safetensors_round_trip(tmp_path: Path) -> None:
    model = make_model(seed=3)
    path = tmp_path / "tiny.safetensors"
    model.save_safetensors(path)
    loaded = HybridModel.from_safetensors(SPEC, path)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert "model.layers.0.linear_attn.A_log" in loaded.state_dict()
    assert "model.layers.1.self_attn.qkv_proj.weight" in loaded.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = make_tokens(90)
    kv, st = make_pools()
    expected = await run(model, kv, st, seq(ids, 0, [0, 1], 0))
    kv, st = make_pools()
    assert torch.equal(await run(loaded, kv, st, seq(ids, 0, [0, 1], 0)), expected)
    other = make_model(seed=4)
    kv, st = make_pools()
    assert not torch.equal(await run(other, kv, st, seq(ids, 0, [0, 1], 0)), expected)


def test_safetensors_rejects_another_shape(tmp_path: Path) -> None:
    path = tmp_path / "tiny.safetensors"
    make_model().save_safetensors(path)
    bigger = HybridSpec.from_hf_config({**_tiny_config(), "intermediate_size": 256})
    with pytest.raises(ConfigError, match="shape"):
        HybridModel.from_safetensors(bigger, path)
    deeper = HybridSpec.from_hf_config({**_tiny_config(), "num_hidden_layers": 6})
    with pytest.raises(ConfigError, match="missing"):
        HybridModel.from_safetensors(deeper, path)
    with pytest.raises(ConfigError, match="cannot read"):
        HybridModel.from_safetensors(SPEC, tmp_path / "absent.safetensors")
    # Integer tensors are not weights (floats of another width are cast).
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.int32)
    save_file(tensors, str(tmp_path / "ints.safetensors"))
    with pytest.raises(ConfigError, match="lm_head.weight.*int32"):
        HybridModel.from_safetensors(SPEC, tmp_path / "ints.safetensors")


def _tiny_config() -> dict[str, object]:
    from asynccache.spec import PRESETS

    return dict(PRESETS["tiny"])


# ---- (7) the transfer counter ----------------------------------------------------------
class RecordingCounter:
    """Records each wait; on a recurrent layer's wait, seeds the working slot (as a scheduler does)."""

    def __init__(self, st: DeviceMambaPool, seed: tuple[int, int] | None = None) -> None:
        self.st, self.seed, self.waits = st, seed, []

    async def wait(self, layer_id: int) -> None:
        self.waits.append(layer_id)
        if self.seed is not None and layer_id in SPEC.mamba_layer_ids:
            items = self.st.layer_items(layer_id)
            items[self.seed[1]] = items[self.seed[0]]


async def test_forward_waits_once_per_cached_layer_in_order() -> None:
    model = make_model()
    kv, st = make_pools()
    counter = RecordingCounter(st)
    await run(model, kv, st, seq(make_tokens(200), 0, [0, 1, 2, 3], 0, {64: 1, 128: 2}), counter=counter)
    assert counter.waits == list(SPEC.cached_layer_ids) == [0, 1, 2, 3]


async def test_working_slot_is_read_after_its_layer_wait() -> None:
    """A counter that seeds the working slot at wait time gives the seeded state's result."""
    model = make_model()
    ids = make_tokens(160)
    kv, st = make_pools()
    await run(model, kv, st, seq(ids[:128], 0, [0, 1, 2], 4))  # cached state in slot 4
    expected = await run(model, kv, st, seq(ids[128:], 128, [0, 1, 2], 4))
    kv2, st2 = make_pools()
    await run(model, kv2, st2, seq(ids[:128], 0, [0, 1, 2], 4))
    seeded = await run(model, kv2, st2, seq(ids[128:], 128, [0, 1, 2], 0), counter=RecordingCounter(st2, (4, 0)))
    assert torch.equal(seeded, expected)


async def test_forward_blocks_until_the_layer_is_enqueued() -> None:
    model = make_model()
    ids = make_tokens(100)
    kv, st = make_pools()
    expected = await run(model, kv, st, seq(ids, 0, [0, 1], 0))
    kv, st = make_pools()
    counter = LayerTransferCounter(SPEC.cached_layer_ids)
    counter.mark_enqueued(0)
    task = asyncio.create_task(run(model, kv, st, seq(ids, 0, [0, 1], 0), counter=counter))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), timeout=0.2)
    assert not task.done()
    # Layer 0 (recurrent) ran, layer 1 (attention) did not: its KV pages are still untouched.
    assert torch.isfinite(st.state(0)["ssm"][0]).all()
    assert torch.isnan(kv.kv_cache(1)[0][0]).all()
    for lid in (1, 2, 3):
        counter.mark_enqueued(lid)
    logits = await asyncio.wait_for(task, timeout=30)
    assert torch.equal(logits, expected)


async def test_failed_transfer_propagates() -> None:
    model = make_model()
    kv, st = make_pools()
    counter = LayerTransferCounter(SPEC.cached_layer_ids)
    counter.fail(OSError("disk gone"))
    with pytest.raises(Exception, match="load of layer 0 failed"):
        await run(model, kv, st, seq(make_tokens(10), 0, [0], 0), counter=counter)


# ---- validation ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (lambda: seq(make_tokens(70), 0, [0], 0), "cannot hold"),
        (lambda: seq(make_tokens(10), 0, [0], 0, {0: 1}), "snapshot position"),
        (lambda: seq(make_tokens(10), 0, [0], 0, {11: 1}), "snapshot position"),
        (lambda: seq(make_tokens(10), 0, [0], 0, {5: 0}), "working slot"),
        (lambda: seq(make_tokens(10), 0, [0], 99), "outside the pool"),
        (lambda: seq(make_tokens(10), 0, [0], 1.5), "state slot 1.5 is not an int"),
        (lambda: seq(make_tokens(10), 0, [0], True), "state slot True is not an int"),
        (lambda: seq(make_tokens(10), 0, [0], 0, {4: 3.7}), "state slot 3.7 is not an int"),
        (lambda: seq(make_tokens(10), 0.5, [0], 0), "start must be an int"),
        (lambda: seq(make_tokens(10), 0, [99], 0), "outside the pool"),
        (lambda: seq(torch.zeros(0, dtype=torch.int64), 0, [0], 0), "non-empty"),
        (lambda: seq(torch.tensor([1, 2, SPEC.vocab_size]), 0, [0], 0), f"token id {SPEC.vocab_size} outside"),
        (lambda: seq(torch.tensor([1, -3, 2]), 0, [0], 0), "token id -3 outside"),
    ],
)
async def test_rejects_bad_inputs(bad: object, match: str) -> None:
    model = make_model()
    kv, st = make_pools()
    with pytest.raises(ConfigError, match=match):
        await run(model, kv, st, bad())  # type: ignore[operator]


async def test_rejects_shared_slots_and_foreign_pools() -> None:
    model = make_model()
    kv, st = make_pools()
    with pytest.raises(ConfigError, match="share a working state slot"):
        await run(model, kv, st, seq(make_tokens(5), 0, [0], 0), seq(make_tokens(5), 0, [1], 0))
    other = HybridSpec.from_hf_config({**_tiny_config(), "linear_num_value_heads": 2})
    with pytest.raises(ConfigError, match="state pool"):
        await run(model, kv, DeviceMambaPool(other, 4), seq(make_tokens(5), 0, [0], 0))
    wider = HybridSpec.from_hf_config({**_tiny_config(), "num_key_value_heads": 2 * SPEC.num_kv_heads})
    with pytest.raises(ConfigError, match="KV pool geometry"):
        await run(model, DeviceKVPool(wider, 24), st, seq(make_tokens(5), 0, [0], 0))
    with pytest.raises(ConfigError, match="materialized"):
        await run(model, DeviceKVPool(SPEC, 24, materialize=False), st, seq(make_tokens(5), 0, [0], 0))


def test_rejects_unsupported_specs() -> None:
    with pytest.raises(ConfigError, match="gated_deltanet"):
        HybridModel(_mamba2_spec())


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float64])
def test_rejects_dtypes_it_cannot_compute_in(dtype: torch.dtype) -> None:
    with pytest.raises(ConfigError, match="computes in"):
        HybridModel(SPEC, dtype=dtype)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"head_dim": 15}, "head_dim must be even"),
        ({"kv_dtype": "int8"}, "kv_dtype must be a floating-point"),
        ({"kv_dtype": "uint8"}, "kv_dtype must be a floating-point"),
        ({"ssm_dtype": "int8"}, "'ssm' must be a floating-point"),
    ],
)
def test_rejects_specs_it_would_compute_wrong(overrides: dict[str, object], match: str) -> None:
    """An odd head_dim broke RoPE in the first forward; integer KV or state dtypes truncated
    K/V and states silently (the logits changed)."""
    cfg = {k: v for k, v in overrides.items() if k == "head_dim"}
    dtypes = {k: v for k, v in overrides.items() if k != "head_dim"}
    spec = HybridSpec.from_hf_config({**_tiny_config(), **cfg}, page_size=P, **dtypes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=match):
        HybridModel(spec)


def test_takes_floating_point_cache_dtypes() -> None:
    for dtypes in ({"kv_dtype": "fp8"}, {"ssm_dtype": "bf16"}):
        HybridModel(HybridSpec.from_hf_config(_tiny_config(), page_size=P, **dtypes))  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["intermediate_size", "vocab_size", "hidden_size"])
def test_rejects_specs_without_positive_dimensions(field: str) -> None:
    import dataclasses

    with pytest.raises(ConfigError, match=field):
        HybridModel(dataclasses.replace(SPEC, **{field: 0}))
    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(SPEC, **{field: -4})  # a spec holds no negative dimension


def _mamba2_spec() -> HybridSpec:
    return HybridSpec.from_hf_config(
        {
            "model_type": "nemotron_h",
            "hybrid_override_pattern": "M*M-",
            "num_hidden_layers": 4,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 1,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "intermediate_size": 128,
            "vocab_size": 256,
            "torch_dtype": "float32",
        }
    )


def test_cuda_graphs_need_cuda() -> None:
    with pytest.raises(ConfigError, match="cuda_graphs"):
        HybridModel(SPEC, cuda_graphs=True)
    assert HybridModel(SPEC).layer_graphs is None  # off on CPU by default
