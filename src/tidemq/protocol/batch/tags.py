"""Tags: the hash the broker filters on and the one tag-expression parser.

A message carries at most one tag. The batch's message index keeps a 64-bit hash of it (0 = no
tag); the broker filters by hash and the client re-checks the tag string, as RocketMQ does with
its tag hash codes (a hash collision can only let a message through, never drop one).

A subscription's tag expression is read as RocketMQ's FilterAPI reads it, by broker and client
alike (``parse_tag_expression`` is the only parser): ``"*"``, empty or None means every message;
anything else is the set of the ``||``-separated tags, trimmed. ``"*"`` is special only as the
whole expression: ``"A || *"`` is the set {"A", "*"} (the official clients filter that way), so
it does *not* mean "everything". An expression that names no tag (``"||"``) is a ValueError.
"""

from __future__ import annotations

from hashlib import blake2b

__all__ = ["tag_hash", "parse_tag_expression", "tag_hashes"]


def tag_hash(tag: str | None) -> int:
    """64-bit hash of a tag for broker-side filtering; 0 means "no tag". The first 8 bytes
    (little-endian) of BLAKE2b over the UTF-8 tag; 1 if that happens to be 0."""
    if not tag:
        return 0
    h = int.from_bytes(blake2b(tag.encode(), digest_size=8).digest(), "little")
    return h or 1


def parse_tag_expression(expression: str | None) -> frozenset[str] | None:
    """The tags of a subscription expression; None means every message.

    ``None``, ``""``, ``"*"`` (spaces around allowed) -> None; ``"TagA || TagB"`` ->
    {"TagA", "TagB"}; ``"A || *"`` -> {"A", "*"}. ValueError for one that names no tag."""
    if expression is None:
        return None
    expr = expression.strip()
    if not expr or expr == "*":
        return None
    tags = frozenset(t for t in (s.strip() for s in expr.split("||")) if t)
    if not tags:
        raise ValueError(f"tag expression {expression!r} names no tag; use '*' or 'TagA || TagB'")
    return tags


def tag_hashes(expression: str | None) -> frozenset[int] | None:
    """The tag hashes the broker filters on for ``expression`` (None: every message)."""
    tags = parse_tag_expression(expression)
    return None if tags is None else frozenset(tag_hash(t) for t in tags)
