"""The producer's retry policy (ref PR1): what a failed or not-quite-stored send does next.

A synchronous send is tried up to ``1 + retries`` times within its overall timeout, each retry on
a queue of another broker when there is one. Retries re-send the same bytes with the same
producer id and sequence, so a broker that deduplicates (BR12) stores the batch once. Pinned
sends (queue_id, selector, hash_key) are never moved to another queue: that would break their
order; nor are a deduplicated producer's (the resend must reach the broker that may hold the
first copy). SYSTEM_BUSY with a retry hint was refused before anything was done, so even a
pinned send may go again, after the wait asked for.

Statuses: FLUSH_DISK_TIMEOUT, FLUSH_SLAVE_TIMEOUT and SLAVE_NOT_AVAILABLE mean "stored on the
master, not yet safe": not repeated unless ``retry_another_broker_when_not_store_ok`` (RocketMQ's
retryAnotherBrokerWhenNotStoreOK), and then only for sends that may move.
"""

from __future__ import annotations

from tidemq.client.errors import MessageRejectedError
from tidemq.protocol.codes import ResponseCode
from tidemq.protocol.errors import BrokerError

__all__ = ["CONTENT_CODES", "RETRY_CODES", "RetryPolicy"]

# Refusals of a batch for the content of one of its messages: retrying elsewhere cannot help,
# but in a batch shared by several callers the others must not fail with it -- the batch is
# sent again to tell the bad message apart (client/accumulator.py, client/multi_sender.py).
CONTENT_CODES = frozenset({ResponseCode.MESSAGE_ILLEGAL, ResponseCode.MESSAGE_TOO_LARGE,
                           ResponseCode.INVALID_ARGUMENT})

# Error responses worth another broker (RocketMQ's retryResponseCodes plus the retryable ones).
RETRY_CODES = frozenset(
    {
        ResponseCode.TOPIC_NOT_EXIST,
        ResponseCode.SERVICE_NOT_AVAILABLE,
        ResponseCode.SYSTEM_ERROR,
        ResponseCode.SYSTEM_BUSY,
        ResponseCode.NO_PERMISSION,
        ResponseCode.RETRY_LATER,
        ResponseCode.DISK_FULL,
    }
)
_REFETCH = (ResponseCode.TOPIC_NOT_EXIST, ResponseCode.NO_PERMISSION)


class RetryPolicy:
    def __init__(self, retries: int, retry_another_broker_when_not_store_ok: bool) -> None:
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.retries = retries
        self.attempts = 1 + retries
        self.not_store_ok_elsewhere = retry_another_broker_when_not_store_ok

    @staticmethod
    def route_may_have_moved(exc: Exception) -> bool:
        """Unreachable, or not the master any more: the name servers may name another by now
        (an election), so the route is asked for again in the background."""
        return not isinstance(exc, BrokerError) or \
            exc.response_code == ResponseCode.SERVICE_NOT_AVAILABLE

    @staticmethod
    def refetch_route(exc: Exception) -> bool:
        """The topic is not (or no longer) where the route said: fetch the route now."""
        return isinstance(exc, BrokerError) and exc.response_code in _REFETCH

    def wait_before_retry(self, exc: Exception, *, pinned: bool, dedup: bool, brokers: int,
                          time_left: float) -> float | None:
        """Seconds to wait before the next attempt after ``exc``, or None: give up (raise it).
        The settle time of a deduplicated resend (:meth:`settle`) comes on top."""
        if isinstance(exc, MessageRejectedError):
            return None
        retry = not isinstance(exc, BrokerError) or exc.response_code in RETRY_CODES
        wait = exc.retry_after if isinstance(exc, BrokerError) else 0.0
        if (pinned and not dedup and not wait) or not retry:
            return None
        if wait and (dedup or pinned or brokers < 2):
            # The retry goes to the same broker: wait as asked, or give up now if the wait
            # outlasts the send's deadline.
            return None if wait >= time_left else wait
        return 0.0

    @staticmethod
    def settle(attempt: int, time_left: float) -> float:
        """A deduplicated resend must reach the broker that may hold the first copy (same
        queue, same bytes); give an uncertain first copy time to settle."""
        return min(0.05 * (attempt + 1), max(0.0, time_left / 2))

    def again_elsewhere(self, success: bool, *, pinned: bool, dedup: bool, attempt: int
                        ) -> bool:
        """Whether a stored-but-not-safe answer is sent again to another broker."""
        return (not success and self.not_store_ok_elsewhere and not pinned and not dedup
                and attempt + 1 < self.attempts)
