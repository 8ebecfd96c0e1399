"""A broker group's master, epoch and in-sync set kept in etcd (RocketMQ 5's controller mode,
Kafka's ISR; docs/cluster.md "Automatic election"). etcd decides; nothing here votes.

Keys of a group, under ``<etcd_prefix>/<cluster>/<broker name>/``::

    state             {"epoch": 3, "master": M, "role": "SYNC_MASTER", "isr": [M, S1], "start": N}
                      changed only by transactions that compare its mod revision (compare-and-set)
    leader            {"member": M, "epoch": 3}: attached to the master's lease, so it disappears
                      when the master stops renewing it (dead, paused, cut off)
    members/<member>  {"addr", "ha", "broker_id", "role", "epoch", "max"}: every live broker of
                      the group, attached to its own lease

A *member* is a broker's identity: a random id kept with its data (``replication.json``), so a
broker restarted on another port is the same member and a wiped disk is a new one.

Who does what (HAService drives it, one round every ``election_poll_interval_ms``):

- every broker keeps a lease (``election_lease_ttl_ms``) and its member key;
- the master checks that ``state`` still names it at its epoch (else it was replaced: it stops
  taking writes and restarts as a slave), and keeps ``isr`` equal to the slaves that hold
  everything it acknowledged -- a slave leaves the set *in etcd* before a SYNC_MASTER send is
  acknowledged without it, and joins once it holds the high watermark;
- a slave in ``isr`` whose group has no ``leader`` campaigns: one transaction that succeeds only
  if there is still no leader and ``state`` is unchanged, and writes ``state`` (epoch + 1, the
  slave as master, ``isr`` = itself) and ``leader`` (its lease). The slave with the most data
  goes first, the others two poll intervals later each.

Fencing: a master's lease is valid, as far as it knows, until the time it *sent* its last
successful renewal plus the TTL, less a margin (etcd counts from when it received it, later). A
master acknowledges writes only before that moment; a new master can only be elected after the
lease expired in etcd, which is later. A master paused past its lease (SIGSTOP) therefore
answers nothing as written when it wakes.

Threads: the broker's event loop (``aetcd`` runs on it, uvloop included).
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidemq.broker.config import BrokerConfig

__all__ = ["Election", "EtcdUnavailable", "GroupView", "new_member_id", "parse_endpoints"]

log = logging.getLogger(__name__)


class EtcdUnavailable(Exception):
    """No etcd endpoint answered (the message names them and the last error)."""


def new_member_id() -> str:
    return uuid.uuid4().hex[:16]


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    out = []
    for part in text.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        for scheme in ("http://", "https://"):
            if part.startswith(scheme):
                part = part[len(scheme):]
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {part!r} must look like host:port")
        out.append((host.strip("[]"), int(port)))
    return out


@dataclass
class GroupView:
    """One read of a group's keys."""

    state: dict[str, Any] | None = None
    state_rev: int = 0  # mod revision of the state key (0: absent)
    leader: dict[str, Any] | None = None
    leader_created: int = 0  # create revision of the leader key (0: absent)
    leader_lease: int = 0
    members: dict[str, dict[str, Any]] = field(default_factory=dict)
    revision: int = 0

    @property
    def epoch(self) -> int:
        return int(self.state["epoch"]) if self.state else 0

    @property
    def isr(self) -> list[str]:
        return list(self.state.get("isr", [])) if self.state else []

    @property
    def master(self) -> str:
        return str(self.state.get("master", "")) if self.state else ""

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "leader": self.leader, "members": self.members}


class Election:
    """The etcd side of one broker (see the module doc). Event loop only."""

    def __init__(self, cfg: BrokerConfig, member: str) -> None:
        self.endpoints = parse_endpoints(cfg.etcd_endpoints)
        if not self.endpoints:
            raise ValueError("etcd_endpoints names no endpoint")
        self.member = member
        self.prefix = f"{cfg.etcd_prefix.rstrip('/')}/{cfg.cluster_name}/{cfg.broker_name}/"
        self.ttl_s = max(1, math.ceil(cfg.election_lease_ttl_ms / 1000))
        self.poll_s = cfg.election_poll_interval_ms / 1000
        self.timeout_s = cfg.etcd_timeout_ms / 1000
        self.lease_id = 0
        self.lease_ttl = 0
        #: monotonic time until which this broker's lease surely holds (0: no lease)
        self.valid_until = 0.0
        self.last_view: GroupView | None = None
        self.failures = 0
        self.last_error = ""
        self._client: Any = None
        self._endpoint = 0
        self._member_put: tuple[Any, ...] = ()
        self._member_put_at = 0.0

    # -- connection ---------------------------------------------------------------------------
    def _key(self, name: str) -> bytes:
        return (self.prefix + name).encode()

    async def _get_client(self) -> Any:
        if self._client is None:
            try:
                import aetcd
            except ImportError:  # pragma: no cover - installed by `make setup`
                raise EtcdUnavailable(
                    "election needs the etcd client: pip install 'tidemq[etcd]' (aetcd)"
                ) from None
            host, port = self.endpoints[self._endpoint]
            self._client = aetcd.Client(host=host, port=port, timeout=self.timeout_s,
                                        connect_wait_timeout=max(1, int(self.timeout_s)))
        return self._client

    async def _drop_client(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            try:
                await c.close()
            except Exception:  # closing a broken channel
                pass
        self._endpoint = (self._endpoint + 1) % len(self.endpoints)

    async def call(self, op: str, *args: Any, **kw: Any) -> Any:
        """``client.<op>(*args)``; EtcdUnavailable after a failure (the next call tries the
        next endpoint)."""
        client = await self._get_client()
        try:
            r = await getattr(client, op)(*args, **kw)
        except Exception as exc:  # aetcd raises its ClientError family and grpc errors
            host, port = self.endpoints[self._endpoint]
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            await self._drop_client()
            raise EtcdUnavailable(f"etcd {host}:{port}: {self.last_error}") from None
        self.failures = 0
        return r

    async def close(self, *, release: bool) -> None:
        """Stop; ``release``: revoke the lease (a clean stop hands leadership over at once)."""
        if release and self.lease_id and self._client is not None:
            try:
                await self.call("revoke_lease", self.lease_id)
            except EtcdUnavailable:
                pass
        self.lease_id = 0
        self.valid_until = 0.0
        c, self._client = self._client, None
        if c is not None:
            try:
                await c.close()
            except Exception:
                pass

    # -- the lease ----------------------------------------------------------------------------
    def lease_ok(self) -> bool:
        return time.monotonic() < self.valid_until

    def _margin(self) -> float:
        return min(1.0, 0.15 * self.ttl_s)

    async def keep_lease(self) -> bool:
        """Renew the lease, or take a new one when it is gone; True when this broker holds a
        lease now (False: it had one and lost it -- its keys are gone)."""
        sent = time.monotonic()
        if self.lease_id:
            r = await self.call("refresh_lease", self.lease_id)
            ttl = int(getattr(r, "TTL", 0)) if r is not None else 0
            if ttl > 0:
                self.lease_ttl = ttl
                self.valid_until = sent + ttl - self._margin()
                return True
            log.warning("etcd lease %x expired (this broker was silent longer than %d s)",
                        self.lease_id, self.ttl_s)
            self.lease_id = 0
            self.valid_until = 0.0
            self._member_put = ()
            return False
        lease = await self.call("lease", self.ttl_s)
        self.lease_id = int(lease.id)
        self.lease_ttl = int(lease.ttl)
        self.valid_until = sent + self.lease_ttl - self._margin()
        self._member_put = ()
        log.info("etcd lease %x granted (%d s)", self.lease_id, self.lease_ttl)
        return True

    async def revoke(self, lease_id: int) -> None:
        await self.call("revoke_lease", lease_id)

    # -- reads and writes ---------------------------------------------------------------------
    async def read(self) -> GroupView:
        r = await self.call("get_prefix", self.prefix.encode())
        v = GroupView()
        plen = len(self.prefix)
        for kv in r:
            name = kv.key.decode()[plen:]
            try:
                value = json.loads(kv.value)
            except ValueError:
                log.error("etcd key %s%s holds no JSON; ignored", self.prefix, name)
                continue
            if name == "state":
                v.state, v.state_rev = value, int(kv.mod_revision)
            elif name == "leader":
                v.leader, v.leader_created = value, int(kv.create_revision)
                v.leader_lease = int(kv.lease)
            elif name.startswith("members/"):
                v.members[name[len("members/"):]] = value
        hdr = getattr(r, "header", None)
        v.revision = int(getattr(hdr, "revision", 0) or 0)
        self.last_view = v
        return v

    async def put_member(self, info: dict[str, Any], *, force: bool = False) -> None:
        """This broker's member key (on its lease); rewritten when something but the offset
        changed, and at most every second for the offset."""
        if not self.lease_id:
            return
        now = time.monotonic()
        fixed = tuple(sorted((k, v) for k, v in info.items() if k != "max"))
        if not force and fixed == self._member_put and now - self._member_put_at < 1.0:
            return
        await self.call("put", self._key("members/" + self.member), _dump(info),
                        lease=self.lease_id)
        self._member_put = fixed
        self._member_put_at = now

    def _state_ops(self, tx: Any, state: dict[str, Any], leader: bool) -> list[Any]:
        ops = [tx.put(self._key("state"), _dump(state))]
        if leader:
            ops.append(tx.put(self._key("leader"),
                              _dump({"member": self.member, "epoch": state["epoch"]}),
                              lease=self.lease_id))
        return ops

    async def _txn(self, compare: list[Any], success: list[Any]) -> bool:
        ok, _ = await self.call("transaction", compare=compare, success=success, failure=[])
        return bool(ok)

    async def create_group(self, state: dict[str, Any]) -> bool:
        """The group's first master: only if the group has no state yet."""
        client = await self._get_client()
        tx = client.transactions
        return await self._txn([tx.version(self._key("state")) == 0,
                                tx.version(self._key("leader")) == 0],
                               self._state_ops(tx, state, True))

    async def campaign(self, view: GroupView, state: dict[str, Any]) -> bool:
        """Become the master: only if there is still no leader and the state is the one read."""
        client = await self._get_client()
        tx = client.transactions
        return await self._txn([tx.version(self._key("leader")) == 0,
                                tx.mod(self._key("state")) == view.state_rev],
                               self._state_ops(tx, state, True))

    async def reacquire(self, view: GroupView) -> bool:
        """The master's lease lapsed but nobody replaced it: the leader key again, same epoch."""
        client = await self._get_client()
        tx = client.transactions
        assert view.state is not None
        return await self._txn(
            [tx.version(self._key("leader")) == 0, tx.mod(self._key("state")) == view.state_rev],
            [tx.put(self._key("leader"), _dump({"member": self.member,
                                               "epoch": view.state["epoch"]}),
                    lease=self.lease_id)],
        )

    async def set_isr(self, view: GroupView, isr: list[str]) -> bool:
        """The master's change of the in-sync set: only while it is the leader it read."""
        client = await self._get_client()
        tx = client.transactions
        assert view.state is not None
        state = dict(view.state)
        state["isr"] = isr
        return await self._txn(
            [tx.mod(self._key("state")) == view.state_rev,
             tx.create(self._key("leader")) == view.leader_created],
            [tx.put(self._key("state"), _dump(state))],
        )


def _dump(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


async def read_group(endpoints: str, prefix: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """Every group's keys under ``prefix`` (``tidemq cluster status``): {"cluster/group":
    {"state", "leader", "leader_lease_ttl", "members"}}."""
    import aetcd

    host, port = parse_endpoints(endpoints)[0]
    out: dict[str, Any] = {}
    async with aetcd.Client(host=host, port=port, timeout=timeout_s) as c:
        r = await c.get_prefix(prefix.rstrip("/").encode() + b"/")
        plen = len(prefix.rstrip("/")) + 1
        leases: dict[str, int] = {}
        for kv in r:
            parts = kv.key.decode()[plen:].split("/", 2)
            if len(parts) < 3:
                continue
            group = out.setdefault(f"{parts[0]}/{parts[1]}", {"members": {}})
            try:
                value = json.loads(kv.value)
            except ValueError:
                continue
            if parts[2] == "state":
                group["state"] = value
            elif parts[2] == "leader":
                group["leader"] = value
                leases[f"{parts[0]}/{parts[1]}"] = int(kv.lease)
            elif parts[2].startswith("members/"):
                group["members"][parts[2][len("members/"):]] = value
        for g, lease_id in leases.items():
            try:
                info = await c.get_lease_info(lease_id, keys=False)
                out[g]["leader_lease_ttl_s"] = int(info.TTL)
            except Exception:
                out[g]["leader_lease_ttl_s"] = -1
    return out
