"""A prefetch lands in the tenant of the match it extends: its keys are that tenant's."""

from __future__ import annotations

from pathlib import Path

import pytest
from serving import arith_prompt, config_with, store_only, tiny_spec

from asynccache.cache import HybridCache
from asynccache.errors import ConfigError

SPEC = tiny_spec()


@pytest.mark.parametrize("given", [None, "A"])
async def test_a_prefetch_lands_in_the_matchs_tenant(tmp_path: Path, given: str | None) -> None:
    tokens = arith_prompt(8 * SPEC.page_size, 7, 3)
    config = config_with(SPEC, storage_uri=(tmp_path / "l3").as_uri())
    async with HybridCache(SPEC, config) as cache:
        await store_only(cache, tokens, grid=8, salt="A")
        match = cache.tree.match_prefix(tokens, salt="A")
        ctrl = cache.controller
        result = await ctrl.wait_prefetch(ctrl.prefetch(tokens, match, salt=given), len(tokens))
        assert result is not None and result.num_tokens == len(tokens)
        assert cache.tree.match_prefix(tokens, salt="A").num_tokens == len(tokens)
        assert cache.tree.match_prefix(tokens).num_tokens == 0  # nothing of A's in tenant ""


async def test_a_prefetch_for_another_tenant_than_the_matchs_is_refused(tmp_path: Path) -> None:
    tokens = arith_prompt(8 * SPEC.page_size, 7, 3)
    config = config_with(SPEC, storage_uri=(tmp_path / "l3").as_uri())
    async with HybridCache(SPEC, config) as cache:
        await store_only(cache, tokens, grid=8, salt="A")
        match = cache.tree.match_prefix(tokens, salt="A")
        with pytest.raises(ConfigError, match="tenant"):
            cache.controller.prefetch(tokens, match, salt="")
        assert cache.tree.match_prefix(tokens).num_tokens == 0
