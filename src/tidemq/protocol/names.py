"""Names: what a topic or group may be called, and which topics belong to the broker.

The one owner of these rules: the broker checks every name a request carries with them, and
the client checks its own names with them before it sends anything.

Characters are RocketMQ's (``TopicValidator`` / ``Validators``): letters, digits, ``%``, ``|``,
``_`` and ``-``. Lengths:

- a topic: 1..127 characters (RocketMQ's ``TOPIC_MAX_LENGTH``; a topic is also a directory
  name of the store);
- a group (consumer or producer): 1..120 characters. RocketMQ allows 255, but a consumer
  group's retry and dead-letter topics are ``%RETRY%<group>`` / ``%DLQ%<group>``, which must
  themselves be valid topic names: 7 + 120 = 127.

Topics clients never create, update, delete or send to (``topic_admin_problem``,
``send_problem``):

- *system topics* the broker writes itself: ``SCHEDULE_TOPIC_XXXX`` (delay levels), every
  ``rmq_sys_*`` / ``RMQ_SYS_*`` topic (timers, transaction half and op messages) and
  ``TRANS_CHECK_MAX_TIME_TOPIC``, as RocketMQ's ``NOT_ALLOWED_SEND_TOPIC_SET``;
- a group's dead-letter topic ``%DLQ%<group>``: written only by the broker's send-back;
- a group's retry topic ``%RETRY%<group>``: written by the broker's send-back and, as in
  RocketMQ (whose consumers fall back to sending a failed message straight to the retry topic
  when the send-back fails), by a direct send from a connection that is a live member of
  ``<group>`` (it sent HEART_BEAT for it). The broker decides membership; this module only
  names the group (:func:`retry_group`).

Pure functions: any thread.
"""

from __future__ import annotations

import re

from tidemq.protocol.codes import DLQ_PREFIX, RETRY_PREFIX

__all__ = [
    "MAX_TOPIC_LEN",
    "MAX_GROUP_LEN",
    "SYSTEM_TOPIC_PREFIXES",
    "SYSTEM_TOPICS",
    "RETRY_PREFIX",
    "DLQ_PREFIX",
    "topic_name_problem",
    "group_name_problem",
    "is_system_topic",
    "retry_group",
    "dlq_group",
    "topic_admin_problem",
]

MAX_TOPIC_LEN = 127
MAX_GROUP_LEN = MAX_TOPIC_LEN - len(RETRY_PREFIX)  # 120: %RETRY%<group> is a valid topic
_CHARS = "letters, digits, '%', '|', '_' and '-'"
_TOPIC = re.compile(rf"[%|a-zA-Z0-9_-]{{1,{MAX_TOPIC_LEN}}}")
_GROUP = re.compile(rf"[%|a-zA-Z0-9_-]{{1,{MAX_GROUP_LEN}}}")
_BAD_CHAR = re.compile(r"[^%|a-zA-Z0-9_-]")

#: Topics only the broker writes (delayed, timed and transactional messages): a client batch
#: there would be taken for the broker's own envelope by the services that read them.
SYSTEM_TOPIC_PREFIXES = ("SCHEDULE_TOPIC_XXXX", "rmq_sys_", "RMQ_SYS_")
SYSTEM_TOPICS = frozenset({"TRANS_CHECK_MAX_TIME_TOPIC"})


def _name_problem(name: object, what: str, pattern: re.Pattern[str], limit: int) -> str | None:
    if not isinstance(name, str):
        return f"the {what} name must be a string, got {type(name).__name__}"
    if pattern.fullmatch(name):
        return None
    if not name:
        return f"the {what} name is empty"
    if len(name) > limit:
        return f"{what} name of {len(name)} characters is longer than {limit}"
    bad = "".join(sorted(set(_BAD_CHAR.findall(name))))
    return f"{what} name {name!r} contains {bad!r}; use only {_CHARS}"


def topic_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a topic, for a person; None when it can."""
    return _name_problem(name, "topic", _TOPIC, MAX_TOPIC_LEN)


def group_name_problem(name: str, what: str = "consumer group") -> str | None:
    """Why ``name`` cannot be a group (``what``: "consumer group", "producer group"), for a
    person; None when it can."""
    return _name_problem(name, what, _GROUP, MAX_GROUP_LEN)


def is_system_topic(topic: str) -> bool:
    """True for a topic only the broker writes (SCHEDULE_TOPIC_XXXX, rmq_sys_*, ...)."""
    return topic.startswith(SYSTEM_TOPIC_PREFIXES) or topic in SYSTEM_TOPICS


def retry_group(topic: str) -> str | None:
    """The consumer group of a retry topic ``%RETRY%<group>``; None for any other topic."""
    return topic[len(RETRY_PREFIX):] if topic.startswith(RETRY_PREFIX) else None


def dlq_group(topic: str) -> str | None:
    """The consumer group of a dead-letter topic ``%DLQ%<group>``; None for any other topic."""
    return topic[len(DLQ_PREFIX):] if topic.startswith(DLQ_PREFIX) else None


def topic_admin_problem(topic: str) -> str | None:
    """Why a client may not create, update or delete ``topic``; None when it may."""
    if is_system_topic(topic):
        return (
            f"topic {topic!r} is a system topic the broker keeps itself (delayed, timed or "
            "transactional messages); it cannot be created, updated or deleted by a client"
        )
    group = retry_group(topic)
    if group is not None:
        return (
            f"topic {topic!r} is the retry topic of consumer group {group!r}; the broker "
            "creates it when the group first appears and it cannot be created, updated or "
            "deleted by a client (tidemq group update --retry-queues sets its queue count)"
        )
    group = dlq_group(topic)
    if group is not None:
        return (
            f"topic {topic!r} is the dead-letter topic of consumer group {group!r}; the "
            "broker creates it and it cannot be created, updated or deleted by a client"
        )
    return None
