"""Arguments of the wrong type are refused with a typed error where they are handed in: the
cache's policies, the tree's locks, the controller's loads, backups and waits, and the spec's
constructors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import ConfigError, SpecError, TreeError
from asynccache.policy import (
    AdmissionPolicy,
    EndsAdmission,
    EveryPageAdmission,
    EvictionPolicy,
    LRUEviction,
)
from asynccache.presets import PRESETS
from asynccache.spec import HybridSpec

SPEC = HybridSpec.preset("tiny", page_size=4)
CONFIG = HybridCacheConfig(device_kv_pages=8, device_state_slots=4)
HOST_CONFIG = HybridCacheConfig(
    device_kv_pages=8,
    device_state_slots=4,
    host_kv_bytes=16 * SPEC.kv_page_bytes,
    host_state_bytes=4 * SPEC.state_bytes,
)


# ---- HybridCache(admission=, eviction=) ----------------------------------------------------
@pytest.mark.parametrize(
    ("admission", "got"),
    [("ends", "'ends'"), (EndsAdmission, "the class EndsAdmission"), (LRUEviction(), "LRUEviction()"), (5, "5")],
)
def test_an_admission_that_is_no_policy_instance_is_refused(admission: Any, got: str) -> None:
    with pytest.raises(ConfigError, match=f"admission must be an instance of AdmissionPolicy .*got {got}"):
        HybridCache(SPEC, CONFIG, admission=admission)


@pytest.mark.parametrize(
    ("eviction", "got"),
    [("lru", "'lru'"), (LRUEviction, "the class LRUEviction"), (EndsAdmission(), "EndsAdmission()")],
)
def test_an_eviction_that_is_no_policy_instance_is_refused(eviction: Any, got: str) -> None:
    with pytest.raises(ConfigError, match=f"eviction must be an instance of EvictionPolicy .*got {got}"):
        HybridCache(SPEC, CONFIG, eviction=eviction)


def test_policy_instances_and_the_defaults_are_taken() -> None:
    admission, eviction = EveryPageAdmission(), LRUEviction()
    cache = HybridCache(SPEC, CONFIG, admission=admission, eviction=eviction)
    assert cache.tree.admission is admission and cache.tree.eviction is eviction
    default = HybridCache(SPEC, CONFIG)
    assert isinstance(default.tree.admission, EndsAdmission) and isinstance(default.tree.eviction, LRUEviction)
    assert isinstance(default.tree.admission, AdmissionPolicy) and isinstance(default.tree.eviction, EvictionPolicy)
    default.flush_device()


# ---- the tree's locks -----------------------------------------------------------------------
@pytest.mark.parametrize("node", [None, "x", 3])
def test_locking_what_is_no_tree_node_is_a_tree_error(node: Any) -> None:
    tree = HybridCache(SPEC, CONFIG).tree
    with pytest.raises(TreeError, match=f"expected a TreeNode .*got {type(node).__name__}"):
        tree.lock(node)
    with pytest.raises(TreeError, match="expected a TreeNode"):
        tree.lock_host(node)
    with pytest.raises(TreeError, match="expected a TreeNode"):
        tree.unlock(node, 1)
    with pytest.raises(TreeError, match="expected a TreeNode"):
        tree.unlock_host(node)
    with pytest.raises(TreeError, match="expected a TreeNode"):
        tree.check_alive([tree.root, node])


def test_a_refused_lock_changes_nothing() -> None:
    tree = HybridCache(SPEC, CONFIG).tree
    tokens = list(range(1, 9))
    alloc = tree.alloc_device(2, 1)
    assert alloc is not None
    node = tree.insert(tokens, alloc.kv_indices, states={8: alloc.state_slot}).last_node
    with pytest.raises(TreeError):
        tree.lock(None)  # type: ignore[arg-type]
    assert node.device_lock == 0 and tree.stats().device_locked_pages == 0
    token = tree.lock(node)
    tree.unlock(node, token)
    assert node.device_lock == 0


# ---- the controller's loads, backups and waits -----------------------------------------------
@pytest.mark.parametrize("match", [None, "x", 3])
async def test_a_load_of_what_is_no_match_is_a_config_error(match: Any) -> None:
    async with HybridCache(SPEC, HOST_CONFIG) as cache:
        with pytest.raises(ConfigError, match=f"load needs a MatchResult .*got {type(match).__name__}"):
            cache.controller.load(match)
        with pytest.raises(ConfigError, match=f"wait_loaded needs a MatchResult .*got {type(match).__name__}"):
            await cache.controller.wait_loaded(match)
        with pytest.raises(ConfigError, match="pending_ops needs a MatchResult"):
            cache.controller.pending_ops(match)
        assert cache.controller.statistics().load_queue == 0


@pytest.mark.parametrize("nodes", [None, "x", b"x", 3, iter(())])
async def test_a_write_of_what_is_no_sequence_of_nodes_is_a_config_error(nodes: Any) -> None:
    async with HybridCache(SPEC, HOST_CONFIG) as cache:
        with pytest.raises(ConfigError, match=f"write needs a sequence of tree nodes, got {type(nodes).__name__}"):
            cache.controller.write(nodes)
        assert cache.controller.statistics().write_queue == 0


async def test_a_write_of_a_sequence_holding_no_node_is_a_tree_error() -> None:
    async with HybridCache(SPEC, HOST_CONFIG) as cache:
        with pytest.raises(TreeError, match="expected a TreeNode .*got NoneType"):
            cache.controller.write([None])


async def test_matches_and_node_sequences_are_taken() -> None:
    async with HybridCache(SPEC, HOST_CONFIG) as cache:
        tokens = list(range(1, 9))
        alloc = cache.tree.alloc_device(2, 1)
        assert alloc is not None
        node = cache.tree.insert(tokens, alloc.kv_indices, states={8: alloc.state_slot}).last_node
        match = cache.tree.match_prefix(tokens)
        await cache.controller.wait_loaded(match)
        load = cache.controller.load(match)
        assert load is not None and load.done
        backup = cache.controller.write((node,))
        assert backup is not None
        cache.controller.start_writing()
        await backup
        assert node.host_kv is not None


# ---- HybridSpec.preset, HybridSpec.from_hf_config --------------------------------------------
def test_an_unknown_preset_keyword_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="unknown argument bogus for preset 'small'; known: .*'tp_size'"):
        HybridSpec.preset("small", bogus=1)
    with pytest.raises(SpecError, match="unknown arguments bogus, other for preset 'small'"):
        HybridSpec.preset("small", other=2, bogus=1)
    with pytest.raises(SpecError, match="unknown argument config"):
        HybridSpec.preset("small", config={})


@pytest.mark.parametrize("name", [None, 3, ["small"]])
def test_a_preset_name_that_is_no_string_is_a_spec_error(name: Any) -> None:
    with pytest.raises(SpecError, match="unknown preset"):
        HybridSpec.preset(name)


def test_preset_keywords_are_passed_on() -> None:
    spec = HybridSpec.preset("small", page_size=16, model_id="mine")
    assert spec.page_size == 16 and spec.model_id == "mine"
    assert HybridSpec.preset("small").model_id == "small"


@pytest.mark.parametrize("config", [123, None, 1.5, [("model_type", "qwen3_next")]])
def test_a_config_that_is_neither_a_mapping_nor_a_path_is_a_spec_error(config: Any) -> None:
    with pytest.raises(SpecError, match=f"config must be a mapping, or a path .*got {type(config).__name__}"):
        HybridSpec.from_hf_config(config)


@pytest.mark.parametrize("model_id", [5, "", "  ", b"name"])
def test_a_model_id_that_is_no_non_empty_string_is_a_spec_error(model_id: Any) -> None:
    with pytest.raises(SpecError, match="model_id must be a non-empty string"):
        HybridSpec.preset("small", model_id=model_id)


def test_an_empty_model_id_does_not_fall_back_for_a_config_file(tmp_path: Path) -> None:
    """Only ``None`` takes the default: an empty id would have named the architecture alone,
    letting two checkpoints' folders share one namespace."""
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["small"]), encoding="utf-8")
    assert HybridSpec.from_hf_config(tmp_path).model_id.endswith(f"@{tmp_path.resolve()}")
    with pytest.raises(SpecError, match="model_id must be a non-empty string"):
        HybridSpec.from_hf_config(tmp_path, model_id="")


@pytest.mark.parametrize("model_id", [5, "", None])
def test_a_spec_built_directly_needs_a_non_empty_string_model_id(model_id: Any) -> None:
    with pytest.raises(SpecError, match="model_id must be a non-empty string"):
        dataclasses.replace(SPEC, model_id=model_id)
