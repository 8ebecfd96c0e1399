"""Store settings, with RocketMQ's defaults (ref ST1, ST5, ST7; docs/configuration.md)."""

from __future__ import annotations

from dataclasses import dataclass

from tidemq.store.flush import FlushMode

MiB = 1 << 20

#: The default of StoreConfig.pwrite_min_bytes (used by MessageStore.put): batches this large
#: are written with one pwritev, smaller ones through the mapping. On this machine a write fault
#: on a fresh page of the mapping costs a page zeroing plus the fault (1 GiB of 104 KB batches:
#: 350-1,275 MB/s and up to 2.7 s of system time through the mapping, ~2,000 MB/s and 0.28 s
#: with pwrite), while a syscall per small batch costs more than the copy (286 B: 1,100-1,200
#: MB/s mapped, ~280 MB/s with pwrite). See docs/format.md.
PWRITE_MIN_BYTES = 32 * 1024


@dataclass
class StoreConfig:
    data_dir: str
    #: CommitLog segment size (RocketMQ mapedFileSizeCommitLog: 1 GiB).
    segment_size: int = 1 << 30
    #: SYNC: a put completes after fsync (group commit). ASYNC: fsync every flush_interval_ms.
    flush_mode: FlushMode = FlushMode.ASYNC
    flush_interval_ms: int = 500
    #: ASYNC: also flush as soon as this many bytes are unflushed (0: only on the interval).
    flush_dirty_bytes: int = 64 * MiB
    #: How long a SYNC put waits for its fsync before answering FLUSH_DISK_TIMEOUT.
    sync_flush_timeout_ms: int = 5000
    #: Consume queue units per file (RocketMQ: 300,000 x 20 B).
    cq_units_per_file: int = 300_000
    #: Index file hash slots and entries per file (RocketMQ: 5,000,000 and 20,000,000).
    index_slots: int = 5_000_000
    index_max_entries: int = 20_000_000
    #: An index file (~420 MB with the geometry above, reserved at creation) never takes more
    #: than this fraction of the free disk space: on a smaller disk both numbers are halved
    #: until it fits (store/index_file.py), so preallocation never fills a small disk.
    index_max_free_ratio: float = 0.05
    #: Index message keys and unique ids (ST4).
    index_enabled: bool = True
    #: Largest batch accepted (ref BR1: batch 4 MiB), headers included.
    max_batch_bytes: int = 4 * MiB + 64 * 1024
    #: Consume queues, index and checkpoint are flushed this often.
    checkpoint_interval_ms: int = 1000
    #: Retention (ST7): keep segments this long (RocketMQ fileReservedTime 72 h) ...
    file_reserved_hours: float = 72.0
    #: ... deleting expired ones at this hour of the day (RocketMQ deleteWhen "04") ...
    delete_when_hour: int = 4
    #: ... or at once when disk use passes this ratio (diskMaxUsedSpaceRatio 75 %).
    disk_max_used_ratio: float = 0.75
    #: Past this, delete the oldest segment even if not expired -- when everything in it was
    #: consumed, or with ``clean_file_forcibly`` (RocketMQ cleanForcibly, 85 %).
    disk_clean_forcibly_ratio: float = 0.85
    #: Under that pressure, delete unexpired segments that still hold unconsumed messages too
    #: (RocketMQ cleanFileForciblyEnable, whose default is true). Off by default, a deliberate
    #: change: the store refuses writes (DISK_FULL) rather than silently drop messages nobody
    #: has read; what a forced deletion drops is logged per queue (store/retention.py).
    clean_file_forcibly: bool = False
    #: Past this, refuse writes with DiskFullError (diskSpaceWarningLevelRatio, 90 %).
    disk_refuse_writes_ratio: float = 0.90
    retention_check_interval_ms: int = 10_000
    #: Verify both CRCs of every batch read (corrupt batches are reported and skipped).
    verify_reads: bool = True
    #: Pre-allocate the next segment in the background and keep the pages ahead of the writer
    #: in the page cache (segment.WarmAhead).
    preallocate: bool = True
    #: How far ahead of the write position pages are kept warm (with ``preallocate``).
    warm_ahead_bytes: int = 64 * MiB
    #: Batches of at least this many bytes are written with one pwritev, smaller ones through
    #: the mapping (see PWRITE_MIN_BYTES).
    pwrite_min_bytes: int = PWRITE_MIN_BYTES
    #: Written into every stored batch's store_host / store_port.
    store_host: str = "127.0.0.1"
    store_port: int = 0
    #: Largest amount of data one read returns (RocketMQ maxTransferBytesOnMessageInMemory).
    max_read_bytes: int = 4 * MiB
