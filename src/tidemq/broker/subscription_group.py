"""Subscription group configs (RocketMQ's SubscriptionGroupManager; ref BR11).

Per consumer group: whether it may consume, whether broadcasting is allowed, how many queues its
retry topic has (1) and how many times a message is retried before it goes to the dead-letter
queue (``retry_max_times``, 16). A group is created on its first heartbeat when
``auto_create_subscription_group`` is on (the default), or explicitly with
UPDATE_AND_CREATE_SUBSCRIPTION_GROUP (``tidemq group update``). Persisted to
``<data_dir>/config/subscription_groups.json`` (base.atomic_file: tmp, fsync, rename, fsync dir)::

    {"groups": {"billing": {"group_name": "billing", "retry_max_times": 3}}}

Threads: the broker's event loop only; :meth:`snapshot` returns bytes another thread may write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from tidemq.base.atomic_file import read_file, write_atomic
from tidemq.broker.connection import decode_request
from tidemq.broker.errors import RequestRejected, check_group
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.headers import EmptyHeader, SubscriptionGroupConfig

if TYPE_CHECKING:
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.frame import Frame

__all__ = ["SubscriptionGroupManager"]

log = logging.getLogger(__name__)


class _GroupsFile(msgspec.Struct, omit_defaults=True):
    groups: dict[str, SubscriptionGroupConfig] = {}


_decoder = msgspec.json.Decoder(_GroupsFile)
_encoder = msgspec.json.Encoder()


class SubscriptionGroupManager:
    """The group table and its file (event loop only)."""

    def __init__(self, path: str, *, auto_create: bool = True) -> None:
        self.path = path
        self.auto_create = auto_create
        self._groups: dict[str, SubscriptionGroupConfig] = {}
        self.dirty = False
        #: grows with every change (a master's slaves copy the table when it moves)
        self.version = 0
        #: Called with a config UPDATE_AND_CREATE_SUBSCRIPTION_GROUP changed (the broker
        #: resizes the group's retry topic, which clients may not update themselves).
        self.on_update: Callable[[SubscriptionGroupConfig], None] | None = None

    def load(self) -> None:
        raw = read_file(self.path)
        if raw is None:
            return
        try:
            self._groups = dict(_decoder.decode(raw).groups)
        except msgspec.DecodeError as exc:
            raise ValueError(
                f"{self.path} is not a valid subscription groups file ({exc}); fix or remove "
                "it (groups are re-created with defaults on their next heartbeat)"
            ) from exc

    def snapshot(self) -> bytes:
        self.dirty = False
        return _encoder.encode(_GroupsFile(dict(self._groups)))

    def persist(self) -> None:
        write_atomic(self.path, self.snapshot())

    def handlers(self) -> dict[int, Callable[..., None]]:
        return {RequestCode.UPDATE_AND_CREATE_SUBSCRIPTION_GROUP: self.update_request}

    def update_request(self, conn: BrokerConnection, frame: Frame) -> None:
        cfg: SubscriptionGroupConfig = decode_request(frame, SubscriptionGroupConfig)
        check_group(cfg.group_name, "group_name")
        if not 1 <= cfg.retry_queue_nums <= 64:
            raise RequestRejected(ResponseCode.INVALID_ARGUMENT,
                                  f"retry_queue_nums must be 1..64, got {cfg.retry_queue_nums}")
        self.update(cfg)
        if self.on_update is not None:
            self.on_update(cfg)
        if not frame.is_oneway:
            conn.respond(frame.opaque, ResponseCode.SUCCESS, EmptyHeader())

    # -- the table ---------------------------------------------------------------------------
    def get(self, group: str) -> SubscriptionGroupConfig | None:
        return self._groups.get(group)

    def all(self) -> dict[str, SubscriptionGroupConfig]:
        return dict(self._groups)

    def ensure(self, group: str) -> SubscriptionGroupConfig:
        """The group's config, created with the defaults if auto-create is on."""
        cfg = self._groups.get(group)
        if cfg is None:
            cfg = SubscriptionGroupConfig(group_name=group)
            if self.auto_create:
                self._groups[group] = cfg
                self.dirty = True
                self.version += 1
                log.info("subscription group %s created", group)
        return cfg

    def update(self, cfg: SubscriptionGroupConfig) -> None:
        if self._groups.get(cfg.group_name) != cfg:
            self._groups[cfg.group_name] = cfg
            self.dirty = True
            self.version += 1
            log.info("subscription group %s updated: %s", cfg.group_name, cfg)

    def adopt(self, groups: dict[str, SubscriptionGroupConfig]) -> bool:
        """A slave takes its master's table (groups only it knows stay); True if it changed."""
        merged = {**self._groups, **groups}
        if merged == self._groups:
            return False
        self._groups = merged
        self.dirty = True
        self.version += 1
        return True
