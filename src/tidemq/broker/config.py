"""Broker settings, with RocketMQ's defaults (BrokerConfig / MessageStoreConfig).

One dataclass holds everything a broker process needs; :meth:`BrokerConfig.store_config` turns
the storage part into the store's :class:`~tidemq.store.config.StoreConfig`. The CLI sets fields
by name (``tidemq broker -o long_polling_check_ms=500 -o store.segment_size=1048576``) through
:func:`apply_overrides`, so every field here is reachable without a new flag.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from tidemq.base.limits import ConnectionLimits
from tidemq.protocol.frame import DEFAULT_MAX_FRAME_SIZE
from tidemq.store.config import StoreConfig
from tidemq.store.flush import FlushMode

__all__ = ["BrokerConfig", "apply_overrides", "apply_setting_overrides", "MiB"]

MiB = 1 << 20
_STORE = StoreConfig(data_dir="")  # the store's defaults


@dataclass
class BrokerConfig:
    """Everything a broker process needs; plain data, set before :class:`Broker` starts."""

    # -- identity and network -----------------------------------------------------------------
    broker_name: str = "broker-a"
    cluster_name: str = "DefaultCluster"
    #: 0 = the master of the group, 1, 2, ... = its slaves (RocketMQ brokerId).
    broker_id: int = 0
    listen_host: str = "127.0.0.1"
    listen_port: int = 10911
    #: Address clients are told to use; empty = listen_host (127.0.0.1 when listening on 0.0.0.0).
    announce_host: str = ""
    #: Name servers to register with ("host:port"); empty = run without a name server.
    namesrv_addrs: list[str] = field(default_factory=list)

    # -- connections and memory (tidemq.base.limits; docs/operations.md) --------------------
    #: Connections served at once; one more is answered SYSTEM_BUSY and closed.
    max_connections: int = 10_000
    #: Largest frame accepted (length field included); a bigger one closes the connection.
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    #: SO_SNDBUF of client sockets (the kernel doubles it); 0 = the kernel's autotuning.
    socket_send_buffer: int = 256 * 1024
    #: Stop handling and reading a connection's requests while this many bytes of its
    #: responses are unsent; resume below the low-water mark.
    write_buffer_high_water: int = 64 * 1024
    write_buffer_low_water: int = 16 * 1024
    #: A connection with more unsent responses than this is closed.
    max_queued_response_bytes: int = 64 * MiB
    #: Bytes of partial frames held, all connections together; past it the oldest partial
    #: frame is dropped and its sender answered SYSTEM_BUSY.
    max_partial_frame_bytes: int = 128 * MiB
    #: A frame incomplete this long after its first byte closes its connection.
    partial_frame_timeout_ms: int = 30_000
    #: Retry hint sent with SYSTEM_BUSY.
    busy_retry_ms: int = 1000
    #: Pulls one connection may have held by long polling; one more is answered SYSTEM_BUSY.
    max_held_pulls_per_connection: int = 10_000

    # -- storage ------------------------------------------------------------------------------
    data_dir: str = os.path.join("~", "tidemq", "store")
    flush_mode: str = "async"  # "sync" (SYNC_FLUSH) or "async" (ASYNC_FLUSH)
    #: The store's settings (store/config.py: segment_size, cq_units_per_file, ...; ``-o
    #: store.KEY=VALUE`` sets one). The broker fills in ``data_dir`` and ``flush_mode`` from
    #: its own fields, and ``max_batch_bytes``, ``store_host`` and ``store_port`` unless they
    #: are set here. A dict of StoreConfig fields is accepted and turned into one.
    store: StoreConfig = field(default_factory=lambda: StoreConfig(data_dir=""))

    # -- topics -------------------------------------------------------------------------------
    #: RocketMQ autoCreateTopicEnable: a send to an unknown topic creates it.
    auto_create_topic: bool = True
    #: Queues of an auto-created topic (RocketMQ defaultTopicQueueNums).
    default_topic_queue_nums: int = 8

    # -- send limits (ref BR1) ---------------------------------------------------------------
    #: Largest batch accepted, as sent (RocketMQ maxMessageSize, 4 MiB) ...
    max_message_size: int = 4 * MiB
    #: ... plus this much for the batch's own headers and message index.
    batch_overhead_allowance: int = 64 * 1024
    #: Properties of one message (checked for single-message, uncompressed sends).
    max_properties_size: int = 32 * 1024

    # -- long polling (ref BR3) --------------------------------------------------------------
    long_polling_enable: bool = True
    #: Period of the fallback check of held pulls (PullRequestHoldService: 5 s).
    long_polling_check_ms: int = 5000
    #: Hold time and check period when long polling is off (shortPollingTimeMills: 1 s).
    short_polling_time_ms: int = 1000
    #: A held PULL_MULTI_QUEUE woken by an arrival waits this long (ms, <= 5) for more of its
    #: queues to receive messages before it answers, so spread traffic travels as a few
    #: multi-message answers rather than one answer per message; 0 = answer at once.
    multi_pull_linger_ms: float = 1.0
    #: When the store has this many more queues than at the last freeze and their number held
    #: still for a second, collect once and freeze what is alive
    #: (``tidemq.base.gc_tune.freeze_long_lived``): the queues' state is long-lived, and a full
    #: collection walking it held the loop 68-95 ms of CPU at 10,000 queues; 0 = never.
    gc_freeze_min_queues: int = 1000
    #: Upper bound of a pull's suspend_timeout_millis (a client cannot pin a request forever).
    max_suspend_ms: int = 60_000

    # -- name server registration (ref NS1) --------------------------------------------------
    register_interval_ms: int = 30_000
    register_timeout_ms: int = 6000  # RocketMQ registerBrokerTimeoutMills
    #: How long the name server keeps this broker without a registration (120 s).
    heartbeat_timeout_ms: int = 120_000

    # -- consumer offsets and stats (ref BR4, BR14) ------------------------------------------
    offset_persist_interval_ms: int = 5000  # RocketMQ flushConsumerOffsetInterval
    stats_sample_interval_ms: int = 5000
    #: Prometheus metrics at http://listen_host:PORT/metrics (docs/operations.md);
    #: -1 = off, 0 = any free port.
    metrics_port: int = -1

    # -- consumer groups (ref BR5-BR7, BR11) -------------------------------------------------
    #: A client silent this long is dropped from its groups (RocketMQ channelExpiredTimeout).
    client_channel_expired_ms: int = 120_000
    #: Period of the scan for silent clients (RocketMQ ClientHousekeepingService: 10 s).
    client_scan_interval_ms: int = 10_000
    #: A queue lock not renewed this long is free again (rebalance.lockMaxLiveTime: 60 s).
    queue_lock_max_live_ms: int = 60_000
    #: Auto-create subscription groups on first heartbeat (autoCreateSubscriptionGroup).
    auto_create_subscription_group: bool = True

    # -- producer path (ref BR12, BR13; docs/producer-path.md) -------------------------------
    #: Deduplicate batches of named producers (producer_id bit 63) by sequence id.
    dedup_enabled: bool = True
    #: How often the dedup table is snapshotted (restart replays the CommitLog after it).
    dedup_snapshot_interval_ms: int = 10_000
    #: A producer name silent this long leaves the dedup table (Pulsar: 6 h).
    dedup_producer_inactivity_ms: int = 6 * 3_600_000
    #: Pending limit of one queue of a non-persistent (``%NP%``) topic, in messages and bytes.
    non_persistent_max_pending_messages: int = 10_000
    non_persistent_max_pending_bytes: int = 64 * MiB

    # -- delayed and timed delivery (ref BR8; docs/delayed-and-transactional.md) -------------
    #: The delay levels (RocketMQ messageDelayLevel); units ms, s, m, h, d.
    message_delay_level: str = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
    #: Time slice of one bucket file of the timer index.
    timer_bucket_ms: int = 60_000
    #: Period of the timer index checkpoint (fsync of the buckets + progress).
    timer_checkpoint_ms: int = 1000
    #: Farthest deliver_at accepted, ahead of now (40 days).
    timer_max_delay_ms: int = 40 * 86_400_000

    # -- transactions (ref BR9) ---------------------------------------------------------------
    #: Period of the check of unresolved half messages (transactionCheckInterval: 60 s).
    transaction_check_interval_ms: int = 60_000
    #: A half message younger than this is not checked (transactionTimeOut: 6 s); a message
    #: may ask for longer with the CHECK_IMMUNITY_TIME_IN_SECONDS property.
    transaction_timeout_ms: int = 6000
    #: Checks before a half message goes to TRANS_CHECK_MAX_TIME_TOPIC (transactionCheckMax).
    transaction_check_max: int = 15
    #: A half message older than this is dropped unchecked (fileReservedTime: 72 h).
    transaction_skip_ms: int = 72 * 3_600_000

    # -- replication (ref BR15; docs/cluster.md) ---------------------------------------------
    #: SYNC_MASTER (a send is acknowledged once min_in_sync_replicas slaves hold it),
    #: ASYNC_MASTER (at once; slaves copy behind) or SLAVE (RocketMQ brokerRole).
    broker_role: str = "ASYNC_MASTER"
    #: A master's replication port (RocketMQ haListenPort): -1 = listen_port + 1 (any free port
    #: when listen_port is 0), 0 = any free port. Slaves learn it from the name servers.
    ha_port: int = -1
    #: A slave's master, "host:port" of its replication port (RocketMQ haMasterAddress);
    #: empty = the name servers say who the master of the group is.
    ha_master_addr: str = ""
    #: Slaves that must hold a SYNC_MASTER send before it is acknowledged.
    min_in_sync_replicas: int = 1
    #: A slave further behind than this is not in sync (RocketMQ haMaxGapNotInSync: 256 MiB) ...
    ha_max_gap_bytes: int = 256 * MiB
    #: ... nor one that has not caught up with the master within this (RocketMQ 5
    #: haMaxTimeSlaveNotCatchup: 15 s).
    ha_max_catchup_ms: int = 15_000
    #: Most CommitLog bytes in one transfer to a slave (RocketMQ haTransferBatchSize: 32 KiB).
    ha_transfer_batch_bytes: int = 1 * MiB
    #: A slave this far behind is sent whole runs of segment with os.sendfile from a worker
    #: thread (catch-up); closer to the tail the loop writes from the mapping; 0 = never.
    ha_sendfile_min_bytes: int = 8 * MiB
    #: Heartbeat and acknowledgement period of an idle link (haSendHeartbeatInterval: 5 s).
    ha_heartbeat_interval_ms: int = 5000
    #: A link silent this long is closed and re-established (haHousekeepingInterval: 20 s).
    ha_housekeeping_interval_ms: int = 20_000
    #: How often a slave copies topics, groups, offsets and delay/transaction progress from its
    #: master (RocketMQ: 10 s); it also does at once when the master's topics or groups change.
    ha_sync_metadata_interval_ms: int = 10_000
    #: A slave cuts a tail its new master never had (written under an older master) instead
    #: of refusing to follow.
    ha_truncate_divergent: bool = True
    #: Pull responses suggest a slave to a consumer that is far behind (RocketMQ
    #: slaveReadEnable); consumers read from a slave anyway when the master is down.
    slave_read_enable: bool = False
    #: "Far behind": more than this percentage of the machine's memory between what a pull
    #: returned and the CommitLog's end (RocketMQ accessMessageInMemoryMaxRatio: 40).
    access_message_in_memory_max_ratio: float = 40.0

    # -- automatic election on etcd (docs/cluster.md "Automatic election") ---------------------
    #: etcd client endpoints, "host:port[,host:port...]": election on (the group's master, epoch
    #: and in-sync set live in etcd); empty = off (`tidemq cluster promote` replaces a master).
    etcd_endpoints: str = ""
    #: Key prefix in etcd; a group's keys are <prefix>/<cluster>/<broker name>/...
    etcd_prefix: str = "/tidemq"
    #: A broker's etcd lease (liveness); a dead master is replaced about this long after it
    #: died. etcd counts leases in whole seconds (rounded up).
    election_lease_ttl_ms: int = 5000
    #: How often a broker renews its lease, reads its group's state and acts on it.
    election_poll_interval_ms: int = 500
    #: One etcd request's timeout (the next endpoint is tried after a failure).
    etcd_timeout_ms: int = 2000

    # -- files under data_dir -----------------------------------------------------------------
    config_dir_name: str = "config"

    def __post_init__(self) -> None:
        store: object = self.store
        if isinstance(store, dict):  # the untyped form of earlier versions
            self.store = StoreConfig(**{"data_dir": "", **store})

    @property
    def flush(self) -> FlushMode:
        return FlushMode(self.flush_mode)

    @property
    def data_path(self) -> str:
        return os.path.abspath(os.path.expanduser(self.data_dir))

    @property
    def config_path(self) -> str:
        """Where topics.json and consumer_offsets.json live (RocketMQ: ``store/config``)."""
        return os.path.join(self.data_path, self.config_dir_name)

    @property
    def store_path(self) -> str:
        return self.data_path

    def broker_addr(self, port: int) -> str:
        host = self.announce_host or self.listen_host
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"{host}:{port}"

    def store_config(self, port: int = 0) -> StoreConfig:
        s = self.store
        return dataclasses.replace(
            s,
            data_dir=self.store_path,
            flush_mode=self.flush,
            # The store refuses batches above this; the broker checks first with a clearer
            # message, this only keeps the two limits consistent.
            max_batch_bytes=s.max_batch_bytes if s.max_batch_bytes != _STORE.max_batch_bytes
            else self.max_message_size + self.batch_overhead_allowance,
            store_host=s.store_host if s.store_host != _STORE.store_host
            else self.announce_host or self.listen_host,
            store_port=s.store_port or port,
        )

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(
            max_connections=self.max_connections,
            max_frame_size=self.max_frame_size,
            socket_send_buffer=self.socket_send_buffer,
            write_buffer_high_water=self.write_buffer_high_water,
            write_buffer_low_water=self.write_buffer_low_water,
            max_queued_response_bytes=self.max_queued_response_bytes,
            max_partial_frame_bytes=self.max_partial_frame_bytes,
            partial_frame_timeout_ms=self.partial_frame_timeout_ms,
            busy_retry_ms=self.busy_retry_ms,
        )

    def validate(self) -> None:
        """Raise ValueError, naming the field, for settings that cannot work."""
        FlushMode(self.flush_mode)  # ValueError names the bad value
        self.connection_limits().validate("broker")
        if not 0 <= self.multi_pull_linger_ms <= 5:
            raise ValueError("broker setting multi_pull_linger_ms must be in [0, 5], got "
                             f"{self.multi_pull_linger_ms}")
        if self.gc_freeze_min_queues < 0:
            raise ValueError("broker setting gc_freeze_min_queues must be >= 0, got "
                             f"{self.gc_freeze_min_queues}")
        if self.max_held_pulls_per_connection <= 0:
            raise ValueError("broker setting max_held_pulls_per_connection must be > 0, got "
                             f"{self.max_held_pulls_per_connection}")
        if self.max_frame_size < self.max_message_size + self.batch_overhead_allowance:
            raise ValueError(
                f"broker setting max_frame_size ({self.max_frame_size}) must be at least "
                f"max_message_size + batch_overhead_allowance "
                f"({self.max_message_size + self.batch_overhead_allowance})"
            )
        for name in (
            "long_polling_check_ms", "short_polling_time_ms", "register_interval_ms",
            "register_timeout_ms", "heartbeat_timeout_ms", "offset_persist_interval_ms",
            "stats_sample_interval_ms", "max_message_size", "default_topic_queue_nums",
            "client_channel_expired_ms", "client_scan_interval_ms", "queue_lock_max_live_ms",
            "timer_bucket_ms", "timer_checkpoint_ms", "timer_max_delay_ms",
            "transaction_check_interval_ms", "transaction_timeout_ms", "transaction_check_max",
            "dedup_producer_inactivity_ms",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"broker setting {name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.listen_port <= 65535:
            raise ValueError(f"listen_port must be 0..65535, got {self.listen_port}")
        self.broker_role = self.broker_role.upper().replace("-", "_")
        if self.broker_role not in ("SYNC_MASTER", "ASYNC_MASTER", "SLAVE"):
            raise ValueError(
                f"broker_role must be SYNC_MASTER, ASYNC_MASTER or SLAVE, got {self.broker_role!r}"
            )
        if self.broker_role == "SLAVE":
            if self.broker_id < 1:
                raise ValueError(
                    "a SLAVE needs a broker_id of 1 or more (0 is the master of the group); "
                    "give --broker-id 1"
                )
            if not self.namesrv_addrs and not self.ha_master_addr:
                raise ValueError(
                    "a SLAVE needs its master: give --namesrv (the name servers name the master "
                    "of its group) or -o ha_master_addr=HOST:PORT (the master's replication port)"
                )
        elif self.broker_id != 0:
            raise ValueError(
                f"a master ({self.broker_role}) has broker_id 0, got {self.broker_id}; slaves "
                "take 1, 2, ... (--role SLAVE)"
            )
        if self.ha_sendfile_min_bytes < 0:
            raise ValueError("ha_sendfile_min_bytes must be >= 0 (0 = never use sendfile)")
        if not -1 <= self.ha_port <= 65535:
            raise ValueError(f"ha_port must be -1..65535, got {self.ha_port}")
        for name in ("min_in_sync_replicas", "ha_max_gap_bytes", "ha_max_catchup_ms",
                     "ha_transfer_batch_bytes", "ha_heartbeat_interval_ms",
                     "ha_housekeeping_interval_ms", "ha_sync_metadata_interval_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"broker setting {name} must be > 0, got {getattr(self, name)}")
        for name in ("election_lease_ttl_ms", "election_poll_interval_ms", "etcd_timeout_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"broker setting {name} must be > 0, got {getattr(self, name)}")
        if self.etcd_endpoints and self.election_poll_interval_ms * 2 > self.election_lease_ttl_ms:
            raise ValueError(
                f"election_poll_interval_ms ({self.election_poll_interval_ms}) must be at most "
                f"half of election_lease_ttl_ms ({self.election_lease_ttl_ms}): the lease is "
                "renewed at each poll"
            )
        if self.access_message_in_memory_max_ratio < 0:
            raise ValueError("access_message_in_memory_max_ratio must be >= 0 (a percentage)")


def _convert(text: str, like: object, name: str) -> object:
    if isinstance(like, bool):
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} wants true/false, got {text!r}")
    if isinstance(like, int):
        return int(text.replace("_", ""), 0)
    if isinstance(like, float):
        return float(text)
    if isinstance(like, list):
        return [p for p in text.replace(";", ",").split(",") if p]
    return text


def apply_setting_overrides(settings: object, pairs: list[str], what: str) -> None:
    """Set fields of the dataclass ``settings`` from ``KEY=VALUE`` strings (as
    :func:`apply_overrides`, for other servers' settings, e.g. the name server's); ``what``
    names them in errors."""
    fields = {f.name for f in dataclasses.fields(settings)}  # type: ignore[arg-type]
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ValueError(f"option {pair!r} must look like KEY=VALUE")
        if key not in fields:
            raise ValueError(f"unknown {what} setting {key!r}; known: {', '.join(sorted(fields))}")
        setattr(settings, key, _convert(value, getattr(settings, key), key))


def apply_overrides(config: BrokerConfig, pairs: list[str]) -> BrokerConfig:
    """Set fields from ``KEY=VALUE`` strings; ``store.KEY`` sets a StoreConfig field.

    Raises ValueError naming the key for unknown keys and values of the wrong type."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    store_fields = {f.name: f for f in dataclasses.fields(StoreConfig)}
    store_defaults = _STORE
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ValueError(f"option {pair!r} must look like KEY=VALUE")
        if key.startswith("store."):
            skey = key[len("store."):]
            if skey not in store_fields or skey == "data_dir":
                raise ValueError(
                    f"unknown store setting {skey!r}; known: {', '.join(sorted(store_fields))}"
                )
            like = getattr(store_defaults, skey)
            if isinstance(like, FlushMode):
                config.flush_mode = FlushMode(value).value
                continue
            setattr(config.store, skey, _convert(value, like, key))
            continue
        if key not in fields or key == "store":
            raise ValueError(f"unknown broker setting {key!r}; known: {', '.join(sorted(fields))}")
        setattr(config, key, _convert(value, getattr(config, key), key))
    return config
