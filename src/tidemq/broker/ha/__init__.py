"""Replication of a broker group: master and slaves (ref BR15; docs/cluster.md).

- ``service``: the broker's role (master or slave), promotion, metadata sync, status;
- ``master``: a master's replication port (the CommitLog streams to its slaves);
- ``slave``: a slave's link to its master;
- ``waiters``: SYNC_MASTER sends waiting for their slaves;
- ``epoch``: the epoch history (which master wrote which part of the CommitLog).

The wire format is ``tidemq.protocol.ha``; the store's side is ``MessageStore.append_replicated``
/ ``truncate_to`` / ``reset_to`` and ``tidemq.store.replica``.
"""
