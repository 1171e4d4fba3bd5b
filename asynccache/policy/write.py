"""Write policies: when device data is copied to the host tier.

- ``write_through``: every inserted node is backed up at once (``InsertResult.backup_nodes``).
- ``write_through_selective``: a node is backed up once it has been hit ``hit_threshold`` times
  (``MatchResult.backup_nodes``), so one-off prompts never use host bandwidth.
- ``write_back``: nothing is copied until device eviction; then the tree hands the victims to
  the ``write_back`` callback, and frees their device copies only once the backup has completed.

Under the two write-through modes device eviction drops what is not backed up yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from asynccache.errors import ConfigError

if TYPE_CHECKING:
    from asynccache.tree.node import TreeNode

__all__ = ["WriteMode", "WritePolicy"]


class WriteMode(str, Enum):
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


@dataclass(frozen=True, slots=True, kw_only=True)
class WritePolicy:
    """A write mode plus its parameter (``hit_threshold`` for ``write_through_selective``)."""

    mode: WriteMode = WriteMode.WRITE_THROUGH
    hit_threshold: int = 2

    def __post_init__(self) -> None:
        if self.hit_threshold < 1:
            raise ConfigError(f"hit_threshold must be >= 1, got {self.hit_threshold}")

    @classmethod
    def write_through(cls) -> WritePolicy:
        return cls(mode=WriteMode.WRITE_THROUGH)

    @classmethod
    def write_through_selective(cls, hit_threshold: int = 2) -> WritePolicy:
        return cls(mode=WriteMode.WRITE_THROUGH_SELECTIVE, hit_threshold=hit_threshold)

    @classmethod
    def write_back(cls) -> WritePolicy:
        return cls(mode=WriteMode.WRITE_BACK)

    @classmethod
    def parse(cls, value: str | WriteMode | WritePolicy) -> WritePolicy:
        """``"write_through"``, ``"write_back"``, ``"write_through_selective"`` or
        ``"write_through_selective:N"`` (N = hit threshold)."""
        if isinstance(value, WritePolicy):
            return value
        if isinstance(value, WriteMode):
            return cls(mode=value)
        name, _, arg = str(value).partition(":")
        try:
            mode = WriteMode(name)
        except ValueError:
            raise ConfigError(f"unknown write policy {value!r}; known: {[m.value for m in WriteMode]}") from None
        if not arg:
            return cls(mode=mode)
        if mode is not WriteMode.WRITE_THROUGH_SELECTIVE:
            raise ConfigError(f"write policy {name!r} takes no parameter (got {value!r})")
        try:
            threshold = int(arg)
        except ValueError:
            raise ConfigError(f"hit threshold must be an integer in {value!r}") from None
        return cls(mode=mode, hit_threshold=threshold)

    @property
    def writes_back_on_evict(self) -> bool:
        """Device eviction backs up what is not on the host yet instead of dropping it."""
        return self.mode is WriteMode.WRITE_BACK

    def backup_on_insert(self, node: TreeNode) -> bool:
        """Whether a node that is not backed up should be backed up when it is inserted."""
        if self.mode is WriteMode.WRITE_THROUGH:
            return True
        return self.mode is WriteMode.WRITE_THROUGH_SELECTIVE and node.hit_count >= self.hit_threshold

    def backup_on_hit(self, node: TreeNode) -> bool:
        """Whether a node that is not backed up should be backed up when a match uses it.

        ``write_through`` says yes too: a node whose backup found no host room at insert time is
        retried when it is used again.
        """
        return self.backup_on_insert(node)

    def __str__(self) -> str:
        if self.mode is WriteMode.WRITE_THROUGH_SELECTIVE:
            return f"{self.mode.value}:{self.hit_threshold}"
        return self.mode.value
