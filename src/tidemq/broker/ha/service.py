"""The broker's replication role (ref BR15; docs/cluster.md): master or slave of its group.

::

    SYNC_MASTER / ASYNC_MASTER                      SLAVE
      HAServer: slaves connect, the CommitLog         MasterLink: follows the master's HA
        streams to them (master.py)                     address (from the name servers, or
      ReplicaWaiters: SYNC_MASTER sends answered         ha_master_addr), stores the bytes
        when min_in_sync_replicas slaves hold them      write requests refused (SERVICE_NOT_
      serves GET_BROKER_METADATA and                      AVAILABLE); pulls served
        MERGE_CONSUMER_OFFSETS to its slaves           every ha_sync_metadata_interval_ms and
      delay, timer and transaction services run         on a change: topics, groups, offsets,
                                                         delay/txn progress from the master;
                                                         its own offsets flow back (max wins)
                                                       PROMOTE_TO_MASTER: a new epoch, id 0,
                                                         the services start

Role and id come from the settings (``broker_role``, ``broker_id``) unless a promotion recorded
others in ``<config>/replication.json``, which then wins (a promoted broker stays master across
restarts; delete the file to go back to the flags). The epoch history is ``<data_dir>/epoch``
(epoch.py).

Fencing without election: a master the name servers refuse because another master of its
group has a higher epoch stops taking writes (until restarted as a slave).

Election (``etcd_endpoints`` set; election.py): etcd holds the group's master, epoch and in-sync
set. At start the broker reads them and becomes the master (a new group) or a slave; then every
``election_poll_interval_ms`` it renews its lease and acts: a slave of the in-sync set whose
group lost its leader campaigns and, when it wins, is promoted; a master keeps the in-sync set
in etcd and acknowledges writes only while its lease holds; a master that finds itself replaced
stops taking writes and restarts as a slave (``Broker.restart_hook``: the ``tidemq broker``
process re-executes itself), which cuts its divergent tail when it joins the new master.

Threads: the broker's event loop, except the callbacks the HA threads make, which hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tidemq.base.atomic_file import read_file, write_atomic
from tidemq.broker.errors import RequestRejected
from tidemq.broker.ha.election import Election, EtcdUnavailable, GroupView, new_member_id
from tidemq.broker.ha.epoch import EpochFile
from tidemq.broker.ha.master import HAServer, SlaveLink
from tidemq.broker.ha.slave import MasterLink
from tidemq.broker.ha.waiters import ReplicaWaiters
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import TidemqError
from tidemq.protocol.frame import Frame
from tidemq.protocol.headers import (
    MASTER_ID,
    BrokerMetadata,
    EmptyHeader,
    OffsetTable,
    PromoteRequestHeader,
    PromoteResponseHeader,
    RegisterBrokerResponseHeader,
)

if TYPE_CHECKING:
    from tidemq.broker.broker import Broker
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.errors import StoreError
    from tidemq.store.flush import FlushCallback

__all__ = ["HAService", "ROLES", "SYNC_MASTER", "ASYNC_MASTER", "SLAVE"]

log = logging.getLogger(__name__)

SYNC_MASTER = "SYNC_MASTER"
ASYNC_MASTER = "ASYNC_MASTER"
SLAVE = "SLAVE"
ROLES = (SYNC_MASTER, ASYNC_MASTER, SLAVE)

#: Requests a slave refuses (they write), with what they would have done.
_WRITES = {
    RequestCode.SEND_MESSAGE: "sends",
    RequestCode.SEND_BATCH: "sends",
    RequestCode.SEND_MULTI_QUEUE: "sends",
    RequestCode.UPDATE_AND_CREATE_TOPIC: "topic changes",
    RequestCode.DELETE_TOPIC: "topic changes",
    RequestCode.UPDATE_AND_CREATE_SUBSCRIPTION_GROUP: "group changes",
    RequestCode.CONSUMER_SEND_MSG_BACK: "messages sent back for retry",
    RequestCode.END_TRANSACTION: "transaction commits and rollbacks",
    RequestCode.CANCEL_TIMER_MESSAGE: "timer cancellations",
    # POP writes its state into rmq_sys_POP_LOG: served by the master only
    RequestCode.POP_MESSAGE: "pops",
    RequestCode.ACK_MESSAGE: "pop acks",
    RequestCode.CHANGE_INVISIBLE_TIME: "pop invisible-time changes",
    RequestCode.NOTIFICATION: "pop notifications",  # the windows are the master's
}
_TICK_S = 1.0


class HAService:
    """One per broker (see the module doc). Event loop only."""

    def __init__(self, broker: Broker) -> None:
        cfg = broker.config
        self.broker = broker
        self.cfg = cfg
        self.role = cfg.broker_role
        self.broker_id = cfg.broker_id
        self.epochs = EpochFile(os.path.join(cfg.data_path, "epoch"))
        self.state_path = os.path.join(cfg.config_path, "replication.json")
        self.server: HAServer | None = None
        self.link: MasterLink | None = None
        self.waiters: ReplicaWaiters | None = None
        self.ha_addr = ""
        self.learned_master_ha = ""
        self.learned_master_addr = ""
        self.fenced = ""
        self.timer_done_before: int | None = None
        self.promoted_at = 0.0
        self.unreplicated_at_promotion = 0
        self.metadata_syncs = 0
        self.offsets_flowed_back = 0
        self._guarded: dict[int, Callable[..., None]] = {}
        self._handlers: dict[int, Callable[..., None]] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._kick: asyncio.Event | None = None
        self._last_register_kick = 0.0
        self._pool: Any = None
        self._stopped = False
        self._was_promoted = False
        #: election on etcd (None: off); this broker's identity there
        self.election: Election | None = None
        self.member = ""
        #: the in-sync set in etcd (members, the master included): a SYNC_MASTER send is
        #: acknowledged once every slave in it holds the batch
        self.isr: list[str] = []
        self._addr_member: dict[str, str] = {}
        self._leaderless_since = 0.0
        self.replaced = ""
        self.elections_won = 0

    # -- role ----------------------------------------------------------------------------------
    @property
    def is_slave(self) -> bool:
        return self.role == SLAVE

    @property
    def is_master(self) -> bool:
        return self.role != SLAVE

    @property
    def epoch(self) -> int:
        return self.epochs.last_epoch

    def load(self) -> None:
        """Before the store opens: the recorded role (a promotion) and the epoch history."""
        raw = read_file(self.state_path)
        if raw:
            try:
                data = json.loads(raw)
                role, bid = str(data["role"]), int(data["broker_id"])
                promoted = bool(data.get("promoted", False))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{self.state_path} is not a valid replication state file ({exc}); remove "
                    "it to use --role / broker_role"
                ) from None
            self._was_promoted = promoted and role != SLAVE
            self.member = str(data.get("member", ""))
            if self.cfg.etcd_endpoints:
                pass  # election: etcd says who the master is, not this file
            elif promoted and (role, bid) != (self.role, self.broker_id):
                log.warning(
                    "role %s, id %d from %s (recorded by a promotion) overrides the configured "
                    "%s, id %d; delete the file to use the configured role",
                    role, bid, self.state_path, self.role, self.broker_id,
                )
                self.role, self.broker_id = role, bid
            self.timer_done_before = data.get("timer_done_before")
        self.cfg.broker_role, self.cfg.broker_id = self.role, self.broker_id
        self.epochs.load()
        if not self.member:
            self.member = new_member_id()
            self._save_state()

    def _save_state(self) -> None:
        data = {"role": self.role, "broker_id": self.broker_id, "epoch": self.epoch,
                "promoted": bool(self.promoted_at) or self._was_promoted,
                "member": self.member}
        if self.timer_done_before is not None:
            data["timer_done_before"] = self.timer_done_before
        write_atomic(self.state_path, json.dumps(data).encode())

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """After the store, the processors and the handlers exist; before registration."""
        loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        if self.is_master:
            await self._start_master()
        else:
            self._start_slave()
        self._tasks.append(loop.create_task(self._tick_forever(), name="ha-tick"))
        if self.election is not None:
            self._tasks.append(loop.create_task(self._elect_forever(), name="ha-election"))

    async def _start_master(self) -> None:
        b = self.broker
        cfg = self.cfg
        store = b.store
        if not self.epochs.entries:
            self.epochs.append(1, store.min_phys_offset)
        self.server = srv = HAServer(
            store, cfg, self.epochs, loop=b.loop, role=lambda: self.role,
            meta_version=self.meta_version, broker_addr=b.addr, on_acked=self._acked,
        )
        port = cfg.ha_port
        if port < 0:
            port = cfg.listen_port + 1 if cfg.listen_port else 0
        await srv.start(cfg.listen_host, port)
        host = b.addr.rsplit(":", 1)[0]
        self.ha_addr = f"{host}:{srv.port}"
        el = self.election
        if el is None:
            self.waiters = ReplicaWaiters(
                lambda: srv.replicated_offset(cfg.min_in_sync_replicas),
                lambda: len(srv.in_sync_links()),
                cfg.min_in_sync_replicas,
                timeout_s=store.config.sync_flush_timeout_ms / 1000,
            )
        else:
            self.waiters = ReplicaWaiters(
                self._isr_replicated_offset, lambda: len(self._isr_slaves()),
                cfg.min_in_sync_replicas, may_ack=el.lease_ok,
                timeout_s=store.config.sync_flush_timeout_ms / 1000,
            )
        store.add_dispatch_listener(srv.on_put)
        b.send_processor.sync_master = self.role == SYNC_MASTER
        if self.role == SYNC_MASTER:
            store.replication_gate = self._gate
        log.info("broker %s is %s (id 0, epoch %d); replication on %s", cfg.broker_name,
                 self.role, self.epoch, self.ha_addr)

    def _start_slave(self) -> None:
        b = self.broker
        cfg = self.cfg
        loop = b.loop
        b.offsets.local_commits = {}
        b.dedup.follow_store = True
        b.store.warm_ahead(False)
        self.link = MasterLink(
            b.store, cfg, self.epochs, broker_id=lambda: self.broker_id, broker_addr=b.addr,
            master_addr=lambda: cfg.ha_master_addr or self.learned_master_ha,
            on_reset=lambda why: loop.call_soon_threadsafe(self._after_reset, why),
            on_meta_version=lambda v: loop.call_soon_threadsafe(self._kick_sync),
            on_connected=lambda up: loop.call_soon_threadsafe(self._connected, up),
            min_epoch=self._known_epoch,
        )
        self.link.start()
        self._tasks.append(loop.create_task(self._sync_forever(), name="ha-sync"))
        log.info("broker %s is a SLAVE (id %d); master %s", cfg.broker_name, self.broker_id,
                 cfg.ha_master_addr or "from the name servers")

    async def stop(self) -> None:
        self._stopped = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.waiters is not None:
            self.waiters.fail_all(ResponseCode.FLUSH_SLAVE_TIMEOUT)
        if self.link is not None:
            await asyncio.to_thread(self.link.stop)
        if self.server is not None:
            await self.server.stop()
        if self._pool is not None:
            self._pool.close()
        if self.election is not None:
            # a clean stop of the master hands leadership over at once (its lease revoked)
            await self.election.close(release=not self.replaced)

    # -- requests ------------------------------------------------------------------------------
    def handlers(self) -> dict[int, Callable[[BrokerConnection, Frame], None]]:
        return {
            RequestCode.GET_BROKER_METADATA: self._get_metadata,
            RequestCode.MERGE_CONSUMER_OFFSETS: self._merge_offsets,
            RequestCode.PROMOTE_TO_MASTER: self._promote_request,
        }

    def guard(self, handlers: dict[int, Callable[..., None]]) -> None:
        """Keep ``handlers`` (the broker's table); a slave's write requests are refused; with
        election a master's are taken only while its lease holds."""
        self._handlers = handlers
        if self.is_slave:
            self._refuse_writes()
        elif self.election is not None:
            self._lease_checked_writes()

    def _lease_checked_writes(self) -> None:
        handlers = self._handlers
        el = self.election
        assert handlers is not None and el is not None
        for code, what in _WRITES.items():
            if code in handlers and code not in self._guarded:
                self._guarded[code] = handlers[code]
                handlers[code] = self._lease_checked(handlers[code], what, el)

    def _lease_checked(self, handler: Callable[[BrokerConnection, Frame], None], what: str,
                       el: Election) -> Callable[[BrokerConnection, Frame], None]:
        def checked(conn: BrokerConnection, frame: Frame) -> None:
            if not el.lease_ok():
                raise RequestRejected(
                    ResponseCode.SERVICE_NOT_AVAILABLE,
                    f"broker {self.cfg.broker_name} holds no valid mastership lease in etcd now "
                    f"(renewal failed or came too late): it takes no {what} until it renews it "
                    "or another master is elected; send to the group's master",
                )
            handler(conn, frame)

        return checked

    def _refuse_writes(self) -> None:
        handlers = self._handlers
        assert handlers is not None
        for code, what in _WRITES.items():
            if code in handlers and code not in self._guarded:
                self._guarded[code] = handlers[code]
                handlers[code] = self._refuser(what)

    def _allow_writes(self) -> None:
        if self._handlers is not None:
            self._handlers.update(self._guarded)
        self._guarded = {}

    def _refuser(self, what: str) -> Callable[[BrokerConnection, Frame], None]:
        def refuse(conn: BrokerConnection, frame: Frame) -> None:
            cfg = self.cfg
            if self.fenced:
                raise RequestRejected(
                    ResponseCode.SERVICE_NOT_AVAILABLE,
                    f"broker {cfg.broker_name} is not the master of its group any more and takes "
                    f"no {what}: {self.fenced}",
                )
            raise RequestRejected(
                ResponseCode.SERVICE_NOT_AVAILABLE,
                f"broker {cfg.broker_name} id {self.broker_id} is a SLAVE: it takes no {what}; "
                f"send to the master of {cfg.broker_name} (id 0, "
                f"{self._master_client_addr() or 'unknown now'})",
            )

        return refuse

    def _get_metadata(self, conn: BrokerConnection, frame: Frame) -> None:
        b = self.broker
        md = BrokerMetadata(
            topics=b.topics.all(),
            topics_version=b.topics.data_version,
            subscription_groups=b.subscription_groups.all(),
            offset_table=b.offsets.table(),
            meta_version=self.meta_version(),
        )
        if self.is_master and b.services_started:
            md.delay_offsets = b.schedule._snapshot()
            md.transaction_progress = b.transactions._snapshot()
            md.timer_done_before = b.timers.done_before()
        conn.respond(frame.opaque, ResponseCode.SUCCESS, md)

    def _merge_offsets(self, conn: BrokerConnection, frame: Frame) -> None:
        from tidemq.broker.connection import decode_request

        h: OffsetTable = decode_request(frame, OffsetTable)
        moved = self.broker.offsets.merge_max(h.offset_table)
        if moved:
            self.offsets_flowed_back += moved
            log.info("%d consumer offsets taken on a slave flowed back", moved)
        if not frame.is_oneway:
            conn.respond(frame.opaque, ResponseCode.SUCCESS, EmptyHeader())

    def meta_version(self) -> int:
        b = self.broker
        return (b.topics.data_version + b.subscription_groups.version) & 0xFFFF_FFFF

    # -- SYNC_MASTER ---------------------------------------------------------------------------
    def expect_replicas(self, pending: Any, end: int) -> None:
        w = self.waiters
        if w is None:
            pending.replicated(ResponseCode.SLAVE_NOT_AVAILABLE)
            return
        w.expect(pending, end)

    def _acked(self) -> None:
        w = self.waiters
        if w is not None:
            w.acked()

    # -- registration --------------------------------------------------------------------------
    def on_register_response(self, addr: str, frame: Frame) -> None:
        h = frame.header
        if frame.code == ResponseCode.SUCCESS:
            if isinstance(h, RegisterBrokerResponseHeader) and self.is_slave and \
                    self.election is None:  # with election etcd names the master
                if h.ha_server_addr and h.ha_server_addr != self.learned_master_ha:
                    log.info("the name server %s names %s (replication %s) as the master",
                             addr, h.master_addr, h.ha_server_addr)
                    self.learned_master_ha = h.ha_server_addr
                    if self.link is not None:
                        self.link.kick()
                if h.master_addr:
                    self.learned_master_addr = h.master_addr
            return
        msg = getattr(h, "message", "")
        if frame.code == ResponseCode.NO_PERMISSION and "epoch" in msg and self.is_master:
            self.fence(msg)

    def fence(self, why: str) -> None:
        """Another master of the group has a newer epoch: take no more writes (with election,
        then restart as a slave)."""
        if self.fenced:
            return
        self.fenced = why
        log.error("broker %s stops taking writes: %s", self.cfg.broker_name, why)
        if self._handlers is not None:
            self._allow_writes()  # the originals, then the refusal over them
            self._refuse_writes()
        self.broker.store.replication_gate = None
        if self.waiters is not None:
            self.waiters.fail_all(ResponseCode.SERVICE_NOT_AVAILABLE
                                  if self.election is not None
                                  else ResponseCode.SLAVE_NOT_AVAILABLE)
        if self.election is not None:
            self.replaced = why
            hook = self.broker.restart_hook
            if hook is not None:
                log.warning("broker %s restarts as a slave of the new master", self.cfg.broker_name)
                self.broker.loop.call_soon(hook, why)
            else:
                log.error("broker %s is embedded (no restart hook): restart it to make it a "
                          "slave of the new master", self.cfg.broker_name)

    # -- the slave's periodic work -------------------------------------------------------------
    def _master_client_addr(self) -> str:
        link = self.link
        if link is not None and link.connected and link.master_broker_addr:
            return link.master_broker_addr
        return self.learned_master_addr

    def _connected(self, up: bool) -> None:
        if up:
            self._kick_sync()

    def _kick_sync(self) -> None:
        if self._kick is not None:
            self._kick.set()

    def _after_reset(self, why: str) -> None:
        """The store was cut back or started over: state derived from the lost bytes goes."""
        b = self.broker
        shutil.rmtree(os.path.join(self.cfg.data_path, "timerlog"), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(b.dedup.path)
        b.dedup.rebuild(b.store)
        log.info("after the %s: dedup table rebuilt from the CommitLog, timer index dropped "
                 "(rebuilt at promotion)", why)

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            try:
                self._tick()
            except Exception:
                log.exception("replication housekeeping failed")

    def _tick(self) -> None:
        if self.waiters is not None:
            self.waiters.sweep()
        if not self.is_slave:
            return
        b = self.broker
        b.dedup.catch_up(b.store)
        link = self.link
        if (link is not None and not link.connected and not self.cfg.ha_master_addr
                and b.registration is not None):
            now = time.monotonic()
            if now - self._last_register_kick >= 1.0:
                # ask the name servers who the master is now (the registration answer says)
                self._last_register_kick = now
                b.registration.changed()

    async def _sync_forever(self) -> None:
        assert self._kick is not None
        interval = self.cfg.ha_sync_metadata_interval_ms / 1000
        while True:
            try:
                async with asyncio.timeout(interval):
                    await self._kick.wait()
            except TimeoutError:
                pass
            self._kick.clear()
            addr = self._master_client_addr()
            if not addr:
                continue
            try:
                await self.sync_once(addr)
            except TidemqError as exc:
                log.debug("metadata sync with master %s failed: %s", addr, exc)
            except Exception:
                log.exception("metadata sync with master %s failed", addr)

    async def sync_once(self, addr: str) -> None:
        """Offsets taken here go back to the master (it keeps the larger), then topics, groups,
        offsets and the delay/transaction progress come from it."""
        from tidemq.client.connection import ConnectionPool

        if self._pool is None:
            self._pool = ConnectionPool(connect_timeout=3.0)
        pool = self._pool
        b = self.broker
        local = b.offsets.local_commits
        if local:
            sent = {k: dict(v) for k, v in local.items()}
            await pool.request(addr, RequestCode.MERGE_CONSUMER_OFFSETS,
                               OffsetTable(offset_table=sent), timeout=5.0)
            b.offsets.delivered_back(sent)
            log.info("offsets of %d group/topic pairs taken on this slave went to master %s",
                     len(sent), addr)
        frame = await pool.request(addr, RequestCode.GET_BROKER_METADATA, EmptyHeader(),
                                   timeout=10.0)
        md = frame.header
        if not isinstance(md, BrokerMetadata):
            return
        await self._apply_metadata(md)
        self.metadata_syncs += 1

    async def _apply_metadata(self, md: BrokerMetadata) -> None:
        b = self.broker
        cfg = self.cfg
        if b.topics.adopt(md.topics, md.topics_version):
            b.topics_changed()
        b.subscription_groups.adopt(md.subscription_groups)
        b.offsets.adopt(md.offset_table)
        for data, name in ((md.delay_offsets, "delay_offset.json"),
                           (md.transaction_progress, "transaction_progress.json")):
            if not data:
                continue
            path = os.path.join(cfg.config_path, name)
            if read_file(path) != data:
                await asyncio.to_thread(write_atomic, path, data)
        if md.timer_done_before and md.timer_done_before != self.timer_done_before:
            self.timer_done_before = md.timer_done_before
            await asyncio.to_thread(self._save_state)

    # -- promotion -----------------------------------------------------------------------------
    def _promote_request(self, conn: BrokerConnection, frame: Frame) -> None:
        from tidemq.broker.connection import decode_request

        h: PromoteRequestHeader = decode_request(frame, PromoteRequestHeader)
        if self.election is not None and not h.force:
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT,
                f"broker {self.cfg.broker_name} runs with election on etcd: the group's master "
                "is elected there (a slave of the in-sync set takes over when the master's "
                "lease expires); promote by hand only with force",
            )
        if not self.is_slave:
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT,
                f"broker {self.cfg.broker_name} is already the master ({self.role}, epoch "
                f"{self.epoch}); promote one of its slaves",
            )
        role = (h.role or "").upper()
        if role and role not in (SYNC_MASTER, ASYNC_MASTER):
            raise RequestRejected(ResponseCode.INVALID_ARGUMENT,
                                  f"role must be SYNC_MASTER or ASYNC_MASTER, got {h.role!r}")
        link = self.link
        if link is not None and link.connected and not h.force:
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT,
                f"this slave still follows master {link.current_addr} (connected): two masters "
                "would take writes. Stop the master first, or promote with force",
            )

        async def go() -> None:
            try:
                r = await self.promote(role)
            except Exception as exc:
                self.broker.answer_failure(conn, frame.opaque, "PROMOTE_TO_MASTER", exc)
                return
            conn.respond(frame.opaque, ResponseCode.SUCCESS, r)

        self.broker.loop.create_task(go())

    async def promote(self, role: str = "", epoch: int = 0) -> PromoteResponseHeader:
        """Make this slave the master of its group (RocketMQ 4.9's manual switch): a new epoch
        from its CommitLog's end, id 0, writes allowed, the delay/timer/transaction services
        started, registered as the master."""
        b = self.broker
        store = b.store
        link = self.link
        previous = ""
        unreplicated = 0
        learned_role = ""
        if link is not None:
            await asyncio.to_thread(link.stop)
            previous = link.current_addr
            learned_role = link.master_role
            if link.master_max:
                unreplicated = max(0, link.master_max - store.max_phys_offset)
            self.link = None
        for t in self._tasks:
            if t.get_name() == "ha-sync":
                t.cancel()
        b.dedup.catch_up(store)
        b.dedup.follow_store = False
        if b.pop is not None:  # the POP windows: what the old master's log says
            b.pop.catch_up(commit=True)
        store.warm_ahead(True)
        self._topics_from_queues()
        self.role = role or learned_role or ASYNC_MASTER
        if self.role == SLAVE:
            self.role = ASYNC_MASTER
        old_id = self.broker_id
        self.broker_id = MASTER_ID
        self.cfg.broker_role, self.cfg.broker_id = self.role, MASTER_ID
        start = store.max_phys_offset
        epoch = max(epoch, self.epoch + 1)
        await asyncio.to_thread(self.epochs.append, epoch, start)
        await asyncio.to_thread(self._save_state)
        b.offsets.local_commits = None
        self.promoted_at = time.time()
        self.unreplicated_at_promotion = unreplicated
        await self._start_master()
        self._allow_writes()
        if self.election is not None:
            self._lease_checked_writes()
        b.start_services(timer_done_before=self.timer_done_before or 0)
        log.warning(
            "promoted: broker %s (was id %d) is now %s of its group, epoch %d from CommitLog "
            "offset %d; %d bytes the old master %s had written were never received here",
            self.cfg.broker_name, old_id, self.role, epoch, start, unreplicated,
            previous or "(unknown)",
        )
        if b.registration is not None:
            await b.registration.register_all()
        return PromoteResponseHeader(
            broker_name=self.cfg.broker_name, epoch=epoch, start_offset=start, role=self.role,
            unreplicated_bytes=unreplicated, previous_master=previous,
        )

    def _topics_from_queues(self) -> None:
        """A topic this store has messages of but no config for (its creation had not been
        synced when the master died) gets one, so its queues stay in the routes."""
        from tidemq.protocol.headers import Perm, TopicConfig
        from tidemq.protocol.names import dlq_group, is_system_topic

        b = self.broker
        widest: dict[str, int] = {}
        for topic, qid in b.store.queues():
            widest[topic] = max(widest.get(topic, 0), qid + 1)
        added = []
        for topic, n in widest.items():
            if b.topics.get(topic) is None and not is_system_topic(topic):
                # a dead-letter topic stays write-only (protocol/names.py)
                perm = Perm.WRITE if dlq_group(topic) is not None else Perm.READ_WRITE
                b.topics.update(TopicConfig(topic_name=topic, read_queue_nums=n,
                                            write_queue_nums=n, perm=perm))
                added.append(topic)
        if added:
            log.warning("topics %s had messages here but no config (not synced before the "
                        "master was lost): created with the queues found", added)
            b.topics_changed()

    # -- election on etcd ----------------------------------------------------------------------
    def _known_epoch(self) -> int:
        """The newest epoch of the group this broker knows (the slave link's floor)."""
        return self.election.last_view.epoch if (self.election is not None
                                                 and self.election.last_view) else 0

    def _member_info(self) -> dict[str, Any]:
        return {"addr": self.broker.addr, "ha": self.ha_addr if self.is_master else "",
                "broker_id": self.broker_id, "role": self.role, "epoch": self.epoch,
                "max": self.broker.store.max_phys_offset}

    def _slave_id(self, view: GroupView) -> int:
        """The configured id when it is a slave's and free, else the lowest free one."""
        used = {int(m.get("broker_id", -1)) for k, m in view.members.items()
                if k != self.member}
        want = self.cfg.broker_id if self.broker_id else 0
        if want >= 1 and want not in used:
            return want
        n = 1
        while n in used:
            n += 1
        return n

    async def join_election(self) -> None:
        """Before the role's services start: read the group in etcd and take the role it
        gives (a new group's configured master creates it)."""
        cfg = self.cfg
        if not cfg.etcd_endpoints:
            return
        self.election = el = Election(cfg, self.member)
        deadline = time.monotonic() + max(30.0, 3 * el.ttl_s)
        configured = self.role
        while True:
            try:
                await el.keep_lease()
                view = await el.read()
                decided = await self._join(view, configured)
            except EtcdUnavailable as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"etcd ({cfg.etcd_endpoints}) did not answer: {exc}; election needs it "
                        "(start etcd, or remove etcd_endpoints to run without election)"
                    ) from None
                log.warning("waiting for etcd: %s", exc)
                await asyncio.sleep(1.0)
                continue
            if decided:
                break
            await asyncio.sleep(el.poll_s)
        self.cfg.broker_role, self.cfg.broker_id = self.role, self.broker_id
        await asyncio.to_thread(self._save_state)

    async def _join(self, view: GroupView, configured: str) -> bool:
        el = self.election
        assert el is not None
        store = self.broker.store
        if view.leader is not None and view.leader.get("member") == self.member and \
                view.leader_lease != el.lease_id:
            # this broker's previous process (the store's lock proves it is gone): free its lease
            log.info("the group's leader key is this broker's previous process's; revoking "
                     "its lease %x", view.leader_lease)
            await el.revoke(view.leader_lease)
            return False
        if view.state is None:
            if configured == SLAVE:
                self.role = SLAVE
                self.broker_id = max(1, self.broker_id)
                log.info("group %s has no state in etcd yet: waiting as a slave for its master",
                         self.cfg.broker_name)
                return True
            epoch = self.epoch + 1
            state = {"epoch": epoch, "master": self.member, "role": configured,
                     "isr": [self.member], "start": store.max_phys_offset}
            if not await el.create_group(state):
                return False
            await asyncio.to_thread(self.epochs.append, epoch, store.max_phys_offset)
            self.role, self.broker_id = configured, MASTER_ID
            self.isr = [self.member]
            self.elections_won += 1
            log.warning("group %s created in etcd: this broker is its %s, epoch %d",
                        self.cfg.broker_name, configured, epoch)
            return True
        self.role = SLAVE
        self.broker_id = self._slave_id(view)
        log.info("group %s in etcd: epoch %d, master %s, in sync %s; this broker (%s) joins as "
                 "slave id %d", self.cfg.broker_name, view.epoch, view.master or "none",
                 view.isr, self.member, self.broker_id)
        return True

    async def _elect_forever(self) -> None:
        el = self.election
        assert el is not None
        while not self._stopped:
            try:
                await self._elect_round(el)
            except EtcdUnavailable as exc:
                level = logging.WARNING if el.failures <= 1 else logging.DEBUG
                log.log(level, "election round: %s", exc)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("election round failed")
            await asyncio.sleep(el.poll_s)

    async def _elect_round(self, el: Election) -> None:
        if self.replaced:
            return
        await el.keep_lease()
        await el.put_member(self._member_info())
        view = await el.read()
        if self.is_master:
            await self._master_round(el, view)
        else:
            await self._slave_round(el, view)

    async def _master_round(self, el: Election, view: GroupView) -> None:
        st = view.state
        if st is None or st.get("master") != self.member or int(st["epoch"]) != self.epoch:
            self.fence(
                f"etcd names {st.get('master') if st else 'nobody'} the master of "
                f"{self.cfg.broker_name} at epoch {view.epoch} (this broker was master at epoch "
                f"{self.epoch}): it was replaced"
            )
            return
        if view.leader is None:
            if await el.reacquire(view):
                log.warning("mastership lease of %s taken again (epoch %d; nobody had replaced "
                            "this broker)", self.cfg.broker_name, self.epoch)
            return
        self._addr_member = {str(m.get("addr", "")): k for k, m in view.members.items()}
        await self._update_isr(el, view)

    def _links_by_member(self) -> dict[str, SlaveLink]:
        srv = self.server
        out: dict[str, SlaveLink] = {}
        if srv is None:
            return out
        for link in srv.links:
            h = link.hello
            if h is None or link.closed:
                continue
            m = self._addr_member.get(h.broker_addr)
            if m is not None:
                out[m] = link
        return out

    def _isr_slaves(self) -> list[str]:
        return [m for m in self.isr if m != self.member]

    def _isr_replicated_offset(self) -> int:
        """What every slave of the in-sync set in etcd holds (-1: fewer than
        min_in_sync_replicas slaves in it, or one not connected)."""
        slaves = self._isr_slaves()
        if len(slaves) < self.cfg.min_in_sync_replicas:
            return -1
        links = self._links_by_member()
        acked: list[int] = []
        for m in slaves:
            link = links.get(m)
            if link is None:
                return -1
            acked.append(int(link.acked))
        return min(acked)

    async def _update_isr(self, el: Election, view: GroupView) -> None:
        srv, w = self.server, self.waiters
        assert srv is not None and w is not None
        self.isr = view.isr
        committed = set(self._isr_slaves())
        now = time.monotonic()
        wp = self.broker.store.max_phys_offset
        want = set()
        for m, link in self._links_by_member().items():
            if link.in_sync(now, wp) and (m in committed or link.acked >= w.high_watermark):
                want.add(m)
        if want == committed:
            return
        isr = [self.member, *sorted(want)]
        if await el.set_isr(view, isr):
            log.warning("in-sync set of %s in etcd: %s (was %s)", self.cfg.broker_name, isr,
                        view.isr)
            self.isr = isr
            w.acked()

    async def _slave_round(self, el: Election, view: GroupView) -> None:
        leader = view.leader
        if leader is not None:
            self._leaderless_since = 0.0
            lm = str(leader.get("member", ""))
            if lm == self.member:
                if view.leader_lease != el.lease_id:
                    await el.revoke(view.leader_lease)
                return
            info = view.members.get(lm, {})
            ha, addr = str(info.get("ha", "")), str(info.get("addr", ""))
            if addr:
                self.learned_master_addr = addr
            if ha and ha != self.learned_master_ha:
                log.info("etcd names %s (replication %s) the master of %s, epoch %d", addr, ha,
                         self.cfg.broker_name, view.epoch)
                self.learned_master_ha = ha
                if self.link is not None:
                    self.link.kick()
            return
        st = view.state
        if st is None or self.member not in view.isr or not el.lease_ok():
            return
        now = time.monotonic()
        if not self._leaderless_since:
            self._leaderless_since = now
            log.warning("group %s has no master in etcd (its lease expired)",
                        self.cfg.broker_name)
        live = [m for m in view.isr if m in view.members or m == self.member]
        live.sort(key=lambda m: (-int(view.members.get(m, {}).get("max", 0)), m))
        rank = live.index(self.member) if self.member in live else len(live)
        if now - self._leaderless_since < rank * el.poll_s * 2:
            return
        epoch = max(view.epoch, self.epoch) + 1
        role = str(st.get("role") or ASYNC_MASTER)
        state = {"epoch": epoch, "master": self.member, "role": role, "isr": [self.member],
                 "start": self.broker.store.max_phys_offset}
        if not await el.campaign(view, state):
            log.info("campaign for %s lost (another broker changed the group first)",
                     self.cfg.broker_name)
            return
        self.elections_won += 1
        self.isr = [self.member]
        log.warning("elected: this broker becomes the %s of %s at epoch %d", role,
                    self.cfg.broker_name, epoch)
        await self.promote(role, epoch)
        await el.put_member(self._member_info(), force=True)

    def _gate(self, callback: FlushCallback, end: int) -> FlushCallback:
        """MessageStore.replication_gate: a broker-made write's callback waits for the
        slaves (SYNC_MASTER) once it is durable."""
        def after_durable(err: StoreError | None) -> None:
            w = self.waiters
            if err is not None or w is None or self.fenced:
                callback(err)
            else:
                w.after(callback, end)

        return after_durable

    # -- status --------------------------------------------------------------------------------
    def runtime_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "pid": os.getpid(),
            "broker_id": self.broker_id,
            "broker_role": self.role,
            "epoch": self.epoch,
            "epoch_start_offset": self.epochs.last_start,
        }
        if self.fenced:
            info["fenced"] = self.fenced
        el = self.election
        if el is not None:
            info["election"] = True
            info["member"] = self.member
            info["etcd_lease_ok"] = el.lease_ok()
            info["etcd_lease_left_ms"] = max(0, int((el.valid_until - time.monotonic()) * 1000))
            info["etcd_failures"] = el.failures
            info["elections_won"] = self.elections_won
            view = el.last_view
            if view is not None:
                info["group_epoch"] = view.epoch
                info["group_isr"] = json.dumps(view.isr)
                info["group_master"] = view.master
        srv = self.server
        if srv is not None:
            links = srv.status()
            info["ha_addr"] = self.ha_addr
            info["ha_slaves"] = len(links)
            info["ha_in_sync_slaves"] = sum(1 for x in links if x["in_sync"])
            info["ha_max_lag_bytes"] = max((x["lag_bytes"] for x in links), default=0)
            info["ha_max_lag_ms"] = max((x["lag_ms"] for x in links), default=0)
            info["ha_slave_links"] = json.dumps(links)
            for k, v in srv.lag_percentiles().items():
                info[f"ha_ack_lag_ms_{k}"] = v
            w = self.waiters
            if w is not None:
                info["ha_replicated_offset"] = w.replicated
                info["ha_high_watermark"] = w.high_watermark
                info["ha_fenced_answers"] = w.fenced_answers
                info["ha_waiting_sends"] = len(w)
                info["ha_slave_not_available"] = w.not_available
                info["ha_wait_rounds"] = w.rounds
                info["ha_waited_sends"] = w.waited
            if self.promoted_at:
                info["ha_promoted_at"] = int(self.promoted_at * 1000)
                info["ha_unreplicated_at_promotion"] = self.unreplicated_at_promotion
        link = self.link
        if link is not None:
            info["ha_master_addr"] = link.current_addr or self.cfg.ha_master_addr or \
                self.learned_master_ha
            info["ha_connected"] = link.connected
            info["ha_master_offset"] = link.master_max
            info["ha_lag_bytes"] = link.lag_bytes
            info["ha_last_heard_ms"] = (
                int((time.monotonic() - link.last_heard) * 1000) if link.last_heard else -1
            )
            info["ha_sessions"] = link.sessions
            info["ha_received_bytes"] = link.received_bytes
            info["ha_metadata_syncs"] = self.metadata_syncs
            info["ha_truncated_bytes"] = link.truncated_bytes
            if link.refused:
                info["ha_refused"] = link.refused
        info["ha_offsets_flowed_back"] = self.offsets_flowed_back
        return info
