"""What a consumer subscribed to in one topic: a tag expression or an SQL92 expression (BR10).

Two explicit forms, so an SQL string is never read as a tag name::

    consumer.subscribe("orders", "created || paid")           # tags
    consumer.subscribe("orders", sql="region = 'eu' AND amount > 100")   # SQL92 properties

A tag expression that looks like SQL (it holds ``=``, ``<``, ``>``, a quote or a parenthesis)
is refused with a ValueError pointing to ``sql=``. An SQL92 expression is compiled when it is
subscribed (``protocol/sql_filter.py``; SqlFilterError, a ValueError, with the reason), sent
with every pull (expression type SQL92) and every heartbeat, and evaluated by the broker; the
client then keeps exactly the messages the broker named (the answer's member bitmaps,
``protocol/members.py``) and re-checks each one itself, as RocketMQ re-checks tags.

Immutable; any thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tidemq.protocol.batch.tags import parse_tag_expression
from tidemq.protocol.members import member_offsets
from tidemq.protocol.sql_filter import SqlFilter, SqlFilterError, compile_sql

if TYPE_CHECKING:
    from tidemq.client.message import MessageExt

__all__ = ["Selection", "EVERYTHING", "SQL92", "TAG", "SqlFilterError"]

TAG = "TAG"
SQL92 = "SQL92"
_SQLISH = frozenset("=<>'()")


class Selection:
    """One topic's subscription: ``expression`` and its ``expression_type`` (TAG or SQL92)."""

    __slots__ = ("expression", "expression_type", "tags", "sql")

    def __init__(self, expression: str = "*", *, sql: str | None = None) -> None:
        if sql is not None:
            if expression not in ("*", "", None):
                raise ValueError("subscribe with a tag expression or sql=..., not both")
            self.expression = sql
            self.expression_type = SQL92
            self.tags: frozenset[str] | None = None
            self.sql: SqlFilter | None = compile_sql(sql)
            return
        if expression and not _SQLISH.isdisjoint(expression):
            raise ValueError(
                f"tag expression {expression!r} looks like an SQL92 expression; subscribe with "
                "sql=... to filter by properties (a tag expression is '*' or 'TagA || TagB')"
            )
        self.expression = expression
        self.expression_type = TAG
        self.tags = parse_tag_expression(expression)
        self.sql = None

    @property
    def filters(self) -> bool:
        """True when the broker must be told the expression (anything but every message)."""
        return self.sql is not None or self.tags is not None

    def keep(
        self, msgs: list[MessageExt], body: bytes | bytearray | memoryview,
        members: Sequence[bytes],
    ) -> list[MessageExt]:
        """The messages of a pull answer that are this subscription's: the broker's members
        (when it named them) that the SQL filter also selects here. Tags were re-checked by
        the decoder already."""
        flt = self.sql
        if flt is None:
            return msgs
        allowed = member_offsets(body, list(members)) if members else None
        matches = flt.matches
        return [m for m in msgs
                if (allowed is None or m.queue_offset in allowed)
                and matches(m.properties, m.tags)]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Selection) and other.expression == self.expression
                and other.expression_type == self.expression_type)

    def __hash__(self) -> int:
        return hash((self.expression, self.expression_type))

    def __repr__(self) -> str:
        if self.sql is not None:
            return f"Selection(sql={self.expression!r})"
        return f"Selection({self.expression!r})"


#: every message (the retry topic's subscription, a topic subscribed with "*")
EVERYTHING = Selection("*")
