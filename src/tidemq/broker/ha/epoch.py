"""Epochs: which master wrote which part of the CommitLog (RocketMQ 5's EpochFile, Kafka's
leader-epoch checkpoint; docs/cluster.md).

Every time a broker becomes the master of its group it starts a new *epoch*, one more than the
highest it knows, beginning at its CommitLog's end. The history is a list of (epoch, start
offset), ascending in both, kept in ``<data_dir>/epoch``, one entry per line::

    1 0
    2 1048576

(written atomically: tmp, fsync, rename, fsync dir). A slave keeps the history of the master it
copies (the handshake hands it over; every transfer names the master's current epoch, and a new
one is appended), so two logs with the same entry for an epoch hold the same bytes for it, up to
where the shorter of the two ends. That is what :func:`consistent_offset` computes: the point
up to which a slave's log is known to agree with its master's. Everything past it is a tail the
master never had -- written by an older master after its slave was promoted -- and the slave
cuts it off before it follows (:class:`~tidemq.protocol.ha.HaAction` TRUNCATE).

Threads: the broker's event loop and its HA threads call it one at a time (the HA service
orders them).
"""

from __future__ import annotations

import logging
import os

from tidemq.base.atomic_file import read_file, write_atomic

__all__ = ["EpochFile", "consistent_offset"]

log = logging.getLogger(__name__)

Epochs = list[tuple[int, int]]


def consistent_offset(
    master: Epochs, master_end: int, slave: Epochs, slave_end: int
) -> int | None:
    """The offset up to which ``slave``'s log (ending at ``slave_end``) is known to equal the
    master's (ending at ``master_end``), given both epoch histories; None when they share no
    epoch (then nothing is known to agree)."""
    where = {e: i for i, (e, _s) in enumerate(master)}
    for i in range(len(slave) - 1, -1, -1):
        epoch, start = slave[i]
        j = where.get(epoch)
        if j is None or master[j][1] != start:
            continue
        s_end = slave[i + 1][1] if i + 1 < len(slave) else slave_end
        m_end = master[j + 1][1] if j + 1 < len(master) else master_end
        return min(s_end, m_end)
    return None


class EpochFile:
    """The epoch history of one broker and its file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: Epochs = []

    def load(self) -> EpochFile:
        raw = read_file(self.path)
        entries: Epochs = []
        if raw:
            for n, line in enumerate(raw.decode("ascii", "replace").splitlines(), 1):
                parts = line.split()
                if not parts:
                    continue
                try:
                    epoch, start = int(parts[0]), int(parts[1])
                except (ValueError, IndexError):
                    raise ValueError(
                        f"{self.path} line {n} is not 'EPOCH START_OFFSET': {line!r}; fix the "
                        "file or remove it (a slave then copies its master's history again)"
                    ) from None
                if entries and (epoch <= entries[-1][0] or start < entries[-1][1]):
                    raise ValueError(
                        f"{self.path} line {n}: epoch {epoch} at {start} does not follow epoch "
                        f"{entries[-1][0]} at {entries[-1][1]} (both must grow)"
                    )
                entries.append((epoch, start))
        self.entries = entries
        return self

    def _save(self) -> None:
        text = "".join(f"{e} {s}\n" for e, s in self.entries)
        write_atomic(self.path, text.encode("ascii"))

    @property
    def last_epoch(self) -> int:
        return self.entries[-1][0] if self.entries else 0

    @property
    def last_start(self) -> int:
        return self.entries[-1][1] if self.entries else 0

    def start_of(self, epoch: int) -> int | None:
        for e, s in self.entries:
            if e == epoch:
                return s
        return None

    def append(self, epoch: int, start: int) -> None:
        """Record that ``epoch`` began at ``start`` (durable when this returns)."""
        if self.entries and (epoch <= self.last_epoch or start < self.last_start):
            raise ValueError(
                f"epoch {epoch} at {start} cannot follow epoch {self.last_epoch} at "
                f"{self.last_start}"
            )
        self.entries.append((epoch, start))
        self._save()
        log.info("epoch %d begins at CommitLog offset %d", epoch, start)

    def replace(self, entries: Epochs) -> None:
        """Adopt a master's history (a slave that starts over or cuts its tail)."""
        new = [(int(e), int(s)) for e, s in entries]
        if new != self.entries:
            self.entries = new
            self._save()

    def follow(self, epoch: int, start: int) -> None:
        """A transfer of the master's ``epoch`` begun at ``start``: record it if new."""
        if epoch > self.last_epoch:
            self.append(epoch, start)

    def remove(self) -> None:
        self.entries = []
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
