"""SQL92 property filters, as RocketMQ 4.9's ``MessageSelector.bySql`` reads them (ref BR10).

Sans-IO: :func:`compile_sql` turns an expression into a :class:`SqlFilter`, whose
``matches(properties, tags)`` says whether one message is selected. The broker evaluates it per
message at read time (``broker/sql_select.py``) and the client re-checks every message it is
handed (``client/selection.py``), so both sides run this one module.

The language (RocketMQ's SelectorParser.jj, itself ActiveMQ's JMS selector without LIKE,
arithmetic and hex/octal literals)::

    expr      := or
    or        := and ( OR and )*
    and       := equality ( AND equality )*
    equality  := compare ( '=' compare | '<>' compare | IS NULL | IS NOT NULL )*
    compare   := unary ( '>' unary | '>=' unary | '<' unary | '<=' unary
                       | [NOT] BETWEEN unary AND unary
                       | [NOT] IN '(' string ( ',' string )* ')' )*
    unary     := '+' unary | '-' unary | NOT unary | literal | identifier | '(' or ')'
    literal   := 'string' ('' inside is a quote) | 123 | 123L | 1.5 | .5 | 1E3
                 | TRUE | FALSE | NULL

Keywords are case-insensitive; identifiers (``[A-Za-z_$][A-Za-z0-9_$]*``) are property names,
case-sensitive; ``TAGS`` is the message's tag. ``-- comment`` (to a line end) and ``/* */``
are skipped.

Semantics are RocketMQ's, including its corners (tests/protocol/test_sql_filter.py checks
them against a separate model):

- A property is a string or absent (NULL). A literal is a string, an integer (a 32-bit
  ``Integer`` when it fits, else a 64-bit ``Long``), a double, TRUE/FALSE or NULL.
- Comparing a property with a number converts the property: to an integer for an integer
  literal (``Integer.valueOf``/``Long.valueOf``: digits with an optional sign, nothing else),
  to a double for a floating literal. ``>``, ``>=``, ``<``, ``<=`` between two strings convert
  both to doubles. A value that does not convert is an *evaluation error*: the whole
  expression selects nothing for that message (RocketMQ logs and drops it), whatever an
  ``OR`` elsewhere would have said -- except that AND/OR evaluate left to right and stop
  early, so an error on the right of a decided left side is never reached.
- NULL: a comparison with an absent property is NULL (unknown); ``NOT NULL`` is NULL; ``AND``
  and ``OR`` are three-valued (``FALSE AND NULL`` is FALSE, ``TRUE OR NULL`` TRUE). A message
  is selected only when the expression is TRUE. ``IS NULL`` / ``IS NOT NULL`` test presence.
  ``a <> 'x'`` does not select messages without ``a``.
- ``IN`` lists string literals only and needs a property on its left.
- Rejected when the expression is compiled (SqlFilterError, the broker's
  SUBSCRIPTION_PARSE_FAILED): syntax errors; ``= NULL`` (use IS NULL); a string, boolean or
  NULL literal, or a boolean expression, on either side of ``>``, ``>=``, ``<``, ``<=`` or
  BETWEEN; ``BETWEEN`` with bounds in the wrong order; integers beyond 64 bits; a floating
  literal that is infinite or 0 (RocketMQ refuses doubles below ``Double.MIN_VALUE``, so
  write ``a > 0`` rather than ``a > 0.0``); a literal number or string where a condition is
  expected (``NOT 5``, ``a = 1 AND 'x'``).
- ``NOT`` binds tighter than comparisons, as in RocketMQ: ``NOT a = 'x'`` is
  ``(NOT a) = 'x'``, an evaluation error; write ``NOT (a = 'x')``.

Hand-written here: only the evaluation (closures compiled from the tree, ~0.3-1 µs per
message); the grammar is lark's (LALR).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SqlFilter", "SqlFilterError", "compile_sql", "TAGS", "MAX_DEPTH"]

#: The identifier that names the message's tag.
TAGS = "TAGS"

_GRAMMAR = r"""
start: or_expr

?or_expr: and_expr
        | or_expr OR and_expr                  -> or_
?and_expr: eq_expr
         | and_expr AND eq_expr                -> and_
?eq_expr: cmp_expr
        | eq_expr "=" cmp_expr                 -> eq
        | eq_expr "<>" cmp_expr                -> ne
        | eq_expr IS NULL                      -> is_null
        | eq_expr IS NOT NULL                  -> is_not_null
?cmp_expr: unary
         | cmp_expr ">" unary                  -> gt
         | cmp_expr ">=" unary                 -> ge
         | cmp_expr "<" unary                  -> lt
         | cmp_expr "<=" unary                 -> le
         | cmp_expr BETWEEN unary AND unary    -> between
         | cmp_expr NOT BETWEEN unary AND unary -> not_between
         | cmp_expr IN "(" strings ")"         -> in_
         | cmp_expr NOT IN "(" strings ")"     -> not_in
strings: STRING ("," STRING)*
?unary: "+" unary
      | "-" unary                              -> neg
      | NOT unary                              -> not_
      | primary
?primary: STRING                               -> string
        | DECIMAL                              -> decimal
        | FLOAT                                -> float_
        | TRUE                                 -> true
        | FALSE                                -> false
        | NULL                                 -> null
        | ID                                   -> prop
        | "(" or_expr ")"

NOT: "NOT"i
AND: "AND"i
OR: "OR"i
BETWEEN: "BETWEEN"i
IN: "IN"i
IS: "IS"i
TRUE: "TRUE"i
FALSE: "FALSE"i
NULL: "NULL"i
ID: /[A-Za-z_$][A-Za-z0-9_$]*/
FLOAT.3: /[0-9]+\.[0-9]*([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+/
DECIMAL.2: /0|[1-9][0-9]*[lL]?/
STRING: /'(''|[^'])*'/s
WS: /[ \t\n\r\f]+/
LINE_COMMENT: /--[^\n\r]*(\r\n|\n|\r)/
BLOCK_COMMENT: /\/\*[^*]*\*+([^*\/][^*]*\*+)*\//
%ignore WS
%ignore LINE_COMMENT
%ignore BLOCK_COMMENT
"""

_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1
_DOUBLE_MIN = 5e-324  # Java's Double.MIN_VALUE


class SqlFilterError(ValueError):
    """An expression that does not compile; ``message`` says where and why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _EvalError(Exception):
    """A value that does not convert while evaluating: the message is not selected."""


class _Long(int):
    """A 64-bit integer literal (Java ``Long``); a plain int is a 32-bit ``Integer``."""

    __slots__ = ()


# -- Java conversions (convertStringExpressions is always on in RocketMQ's parser) --------------

_JAVA_INT = re.compile(r"[+-]?[0-9]+\Z")
_JAVA_DOUBLE = re.compile(
    r"[+-]?(NaN|Infinity|([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)[fFdD]?\Z"
)


def _java_int(s: str, lo: int, hi: int) -> int:
    """Integer.valueOf / Long.valueOf: an optional sign and ASCII digits, in range."""
    if _JAVA_INT.match(s):
        v = int(s)
        if lo <= v <= hi:
            return v
    raise _EvalError(f"{s!r} is not a {'32' if hi == _INT_MAX else '64'}-bit integer")


def _java_double(s: str) -> float:
    """Double.valueOf: surrounding control characters and spaces are trimmed (Java's trim);
    decimal forms, NaN, Infinity and an f/d suffix (hexadecimal floats are not read)."""
    t = s.strip("".join(chr(c) for c in range(33)))
    m = _JAVA_DOUBLE.match(t)
    if m is None:
        raise _EvalError(f"{s!r} is not a number")
    core = t.rstrip("fFdD") if m.group(1) not in ("NaN", "Infinity") else t
    if core.lstrip("+-") == "NaN":
        return math.nan
    if core.lstrip("+-") == "Infinity":
        return -math.inf if core.startswith("-") else math.inf
    return float(core)


def _kind(v: object) -> str:
    t = type(v)
    if t is str:
        return "S"
    if t is int:
        return "I"
    if t is _Long:
        return "L"
    if t is float:
        return "D"
    if t is bool:
        return "B"
    raise AssertionError(f"unexpected value {v!r}")


def _dcmp(a: float, b: float) -> int:
    """Double.compareTo: NaN above everything and equal to itself, -0.0 below 0.0."""
    if a < b:
        return -1
    if a > b:
        return 1
    an, bn = a != a, b != b
    if an or bn:
        return (an > bn) - (an < bn)
    sa, sb = math.copysign(1.0, a), math.copysign(1.0, b)
    return (sa > sb) - (sa < sb)


def _compare(lv: Any, rv: Any) -> int:
    """RocketMQ's ComparisonExpression.__compare with string conversion on: bring both sides
    to one type, then compareTo; -1 for pairs it cannot relate; _EvalError when a string does
    not convert (NumberFormatException) or a boolean meets a string on the left (a
    ClassCastException in RocketMQ: both end the evaluation)."""
    lk, rk = _kind(lv), _kind(rv)
    if lk != rk:
        if lk == "B":
            if rk == "S":
                raise _EvalError("a boolean cannot be compared with a string")
            return -1
        if lk == "S":
            if rk == "B":
                lv, lk = lv.lower() == "true", "B"
            elif rk == "I":
                lv, lk = _java_int(lv, _INT_MIN, _INT_MAX), "I"
            elif rk == "L":
                lv, lk = _java_int(lv, _LONG_MIN, _LONG_MAX), "I"
                rk = "I"
            else:
                lv, lk = _java_double(lv), "D"
        elif rk == "B":
            return -1
        elif rk == "S":
            if lk == "D":
                rv, rk = _java_double(rv), "D"
            else:
                rv = _java_int(rv, *((_INT_MIN, _INT_MAX) if lk == "I" else (_LONG_MIN, _LONG_MAX)))
                rk = lk
        # numbers of two kinds: integers compare as integers, anything with a double as doubles
        if "D" in (lk, rk):
            lv, rv = float(lv), float(rv)
            lk = rk = "D"
    if lk == "D":
        return _dcmp(lv, rv)
    order: int = (lv > rv) - (lv < rv)
    return order


# -- compiled nodes --------------------------------------------------------------------------

Fn = Callable[[Mapping[str, str], Any], Any]
_NOCONST = object()


class _Node:
    """A compiled sub-expression: ``fn(properties, tags)`` gives its value (None = NULL)."""

    __slots__ = ("fn", "const", "boolean", "prop")

    def __init__(self, fn: Fn, *, const: object = _NOCONST, boolean: bool = False,
                 prop: str | None = None) -> None:
        self.fn = fn
        self.const = const  # the value, for a literal
        self.boolean = boolean  # RocketMQ's BooleanExpression: a condition
        self.prop = prop  # the property name, for an identifier


def _const(v: object, *, boolean: bool = False) -> _Node:
    return _Node(lambda p, t: v, const=v, boolean=boolean)


def _describe(n: _Node) -> str:
    if n.prop is not None:
        return n.prop
    if n.const is _NOCONST:
        return "a condition" if n.boolean else "an expression"
    v = n.const
    if v is None:
        return "NULL"
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    return repr(v)


def _as_condition(n: _Node) -> _Node:
    """asBooleanExpression: a condition stays; a property is cast (selects only when it is a
    boolean, which a string property never is); anything else is refused."""
    if n.boolean:
        return n
    if n.prop is not None:
        get = n.fn

        def cast(p: Mapping[str, str], t: Any) -> Any:
            v = get(p, t)
            if v is None:
                return None
            return v if type(v) is bool else False

        return _Node(cast, boolean=True)
    raise SqlFilterError(f"{_describe(n)} is not a condition (it cannot be true or false)")


def _check_equal_operand(n: _Node) -> None:
    if n.const is None:
        raise SqlFilterError("NULL cannot be compared with '=' or '<>'; use IS [NOT] NULL")


def _check_ordered_operand(n: _Node) -> None:
    if n.const is not _NOCONST and (type(n.const) not in (int, _Long, float)):
        raise SqlFilterError(
            f"{_describe(n)} cannot be compared with '<', '<=', '>', '>=' or BETWEEN: only "
            "numbers (and properties holding numbers) can"
        )
    if n.boolean:
        raise SqlFilterError(
            "a condition cannot be compared with '<', '<=', '>', '>=' or BETWEEN"
        )


def _equal(a: _Node, b: _Node) -> _Node:
    fa, fb = a.fn, b.fn

    def eq(p: Mapping[str, str], t: Any) -> Any:
        lv = fa(p, t)
        rv = fb(p, t)
        if lv is None or rv is None:
            if lv is None and rv is None:
                return True
            return None if lv is None else False
        if type(lv) is type(rv) and type(lv) is not float:
            return lv == rv
        return _compare(lv, rv) == 0

    return _Node(eq, boolean=True)


def _not(n: _Node) -> _Node:
    f = n.fn

    def neg(p: Mapping[str, str], t: Any) -> Any:
        v = f(p, t)
        if v is None:
            return None
        return not v

    return _Node(neg, boolean=True)


_ORDER: dict[str, Callable[[int], bool]] = {
    ">": lambda c: c > 0,
    ">=": lambda c: c >= 0,
    "<": lambda c: c < 0,
    "<=": lambda c: c <= 0,
}


def _ordered(op: str, a: _Node, b: _Node) -> _Node:
    _check_ordered_operand(a)
    _check_ordered_operand(b)
    fa, fb, test = a.fn, b.fn, _ORDER[op]

    def cmp(p: Mapping[str, str], t: Any) -> Any:
        lv = fa(p, t)
        if lv is None:
            return None
        rv = fb(p, t)
        if rv is None:
            return None
        if type(lv) is str and type(rv) is str:
            return test(_dcmp(_java_double(lv), _java_double(rv)))
        return test(_compare(lv, rv))

    return _Node(cmp, boolean=True)


def _and(a: _Node, b: _Node) -> _Node:
    fa, fb = a.fn, b.fn

    def both(p: Mapping[str, str], t: Any) -> Any:
        lv = fa(p, t)
        if lv is False:
            return False
        rv = fb(p, t)
        if rv is False:
            return False
        if lv is None or rv is None:
            return None
        return True

    return _Node(both, boolean=True)


def _or(a: _Node, b: _Node) -> _Node:
    fa, fb = a.fn, b.fn

    def either(p: Mapping[str, str], t: Any) -> Any:
        lv = fa(p, t)
        if lv is True:
            return True
        rv = fb(p, t)
        if rv is True:
            return True
        if lv is None or rv is None:
            return None
        return False

    return _Node(either, boolean=True)


def _prop(name: str) -> _Node:
    if name == TAGS:
        return _Node(lambda p, t: t, prop=name)
    return _Node(lambda p, t: p.get(name), prop=name)


def _negate(n: _Node) -> _Node:
    if n.const is not _NOCONST and type(n.const) in (int, _Long, float):
        v: Any = n.const
        # -2147483648 stays a Long, as in RocketMQ (the literal was read as a Long first)
        return _const(_Long(-v) if type(v) is _Long else (-v))
    f = n.fn

    def neg(p: Mapping[str, str], t: Any) -> Any:
        v = f(p, t)
        if v is None:
            return None
        tv = type(v)
        if tv is int or tv is float:
            return -v
        if tv is _Long:
            return _Long(-v)
        return None  # a string or a boolean has no negation: NULL, as in RocketMQ

    return _Node(neg)


def _in(n: _Node, values: list[str], negated: bool) -> _Node:
    if n.prop is None:
        raise SqlFilterError(f"IN needs a property on its left, not {_describe(n)}")
    f, members = n.fn, frozenset(values)

    def isin(p: Mapping[str, str], t: Any) -> Any:
        v = f(p, t)
        if v is None:
            return None
        return (v in members) != negated

    return _Node(isin, boolean=True)


def _between(v: _Node, lo: _Node, hi: _Node, negated: bool) -> _Node:
    if not negated and lo.const is not _NOCONST and hi.const is not _NOCONST:
        if lo.const is None or hi.const is None:
            raise SqlFilterError("BETWEEN bounds cannot be NULL")
        try:
            wrong = _compare(hi.const, lo.const) < 0
        except _EvalError as exc:
            raise SqlFilterError(f"BETWEEN bounds do not compare: {exc}") from None
        if wrong:
            raise SqlFilterError(
                f"BETWEEN {_describe(lo)} AND {_describe(hi)}: the lower bound must not be "
                "above the upper bound"
            )
    if negated:
        return _or(_ordered("<", v, lo), _ordered(">", v, hi))
    return _and(_ordered(">=", v, lo), _ordered("<=", v, hi))


def _decimal(text: str) -> _Node:
    digits = text[:-1] if text[-1] in "lL" else text
    v = int(digits)
    if v > _LONG_MAX:
        raise SqlFilterError(f"{text} does not fit a 64-bit integer")
    return _const(v if v <= _INT_MAX else _Long(v))


def _float(text: str) -> _Node:
    v = float(text)
    if math.isinf(v):
        raise SqlFilterError(f"{text} is beyond the largest double")
    if v < _DOUBLE_MIN:
        raise SqlFilterError(
            f"{text} is below the smallest positive double; RocketMQ refuses floating literals "
            "of 0 (write 0 as an integer)"
        )
    return _const(v)


def _string(token: str) -> str:
    return token[1:-1].replace("''", "'")


#: nesting depth refused at compile time, so that evaluating (recursive closures) stays far
#: from Python's recursion limit wherever the broker or a client calls it
MAX_DEPTH = 200


def _build(tree: Any, depth: int = 0) -> _Node:
    """The compiled node of a lark tree (recursive; depth bounded by MAX_DEPTH)."""
    from lark import Token

    if isinstance(tree, Token):  # pragma: no cover - every token sits under a named rule
        raise SqlFilterError(f"unexpected {tree!r}")
    if depth > MAX_DEPTH:
        raise SqlFilterError(f"the expression nests more than {MAX_DEPTH} levels deep")
    d, ch = tree.data, tree.children

    def sub(t: Any) -> _Node:  # a child, one level deeper
        return _build(t, depth + 1)
    if d == "start":
        return _as_condition(sub(ch[0]))
    if d == "or_":
        return _or(_as_condition(sub(ch[0])), _as_condition(sub(ch[2])))
    if d == "and_":
        return _and(_as_condition(sub(ch[0])), _as_condition(sub(ch[2])))
    if d in ("eq", "ne"):
        a, b = sub(ch[0]), sub(ch[1])
        _check_equal_operand(a)
        _check_equal_operand(b)
        if a.const is not _NOCONST and b.const is not _NOCONST and a.boolean and not b.boolean:
            raise SqlFilterError(f"{_describe(a)} cannot be compared with {_describe(b)}")
        n = _equal(a, b)
        return n if d == "eq" else _not(n)
    if d == "is_null":
        return _equal(sub(ch[0]), _const(None, boolean=True))
    if d == "is_not_null":
        return _not(_equal(sub(ch[0]), _const(None, boolean=True)))
    if d in ("gt", "ge", "lt", "le"):
        op = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}[d]
        return _ordered(op, sub(ch[0]), sub(ch[1]))
    if d == "between":
        return _between(sub(ch[0]), sub(ch[2]), sub(ch[4]), False)
    if d == "not_between":
        return _between(sub(ch[0]), sub(ch[3]), sub(ch[5]), True)
    if d in ("in_", "not_in"):
        values = [_string(s) for s in ch[-1].children]
        return _in(sub(ch[0]), values, d == "not_in")
    if d == "neg":
        return _negate(sub(ch[0]))
    if d == "not_":
        return _not(_as_condition(sub(ch[1])))
    if d == "string":
        return _const(_string(ch[0]))
    if d == "decimal":
        return _decimal(str(ch[0]))
    if d == "float_":
        return _float(str(ch[0]))
    if d == "true":
        return _const(True, boolean=True)
    if d == "false":
        return _const(False, boolean=True)
    if d == "null":
        return _const(None, boolean=True)
    if d == "prop":
        return _prop(str(ch[0]))
    raise AssertionError(f"unknown rule {d}")  # pragma: no cover


@functools.cache
def _parser() -> Any:
    from lark import Lark

    return Lark(_GRAMMAR, parser="lalr", lexer="contextual", maybe_placeholders=False)


def _shown(expression: str) -> str:
    """The expression as error messages quote it (long ones cut)."""
    return repr(expression) if len(expression) <= 120 else repr(expression[:117]) + "..."


def _syntax_message(expression: str, exc: Exception) -> str:
    from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedToken

    if isinstance(exc, UnexpectedEOF) or (
        isinstance(exc, UnexpectedToken) and exc.token.type == "$END"
    ):
        return f"SQL92 expression {_shown(expression)} ends too early (incomplete)"
    col = getattr(exc, "column", "?")
    if isinstance(exc, UnexpectedToken):
        what = f"{str(exc.token)!r}"
    elif isinstance(exc, UnexpectedCharacters):
        what = f"character {exc.char!r}"
    else:  # pragma: no cover
        what = "input"
    return f"SQL92 expression {_shown(expression)} is invalid: unexpected {what} at column {col}"


class SqlFilter:
    """A compiled SQL92 selector; immutable, safe to share between threads."""

    __slots__ = ("expression", "_fn")

    def __init__(self, expression: str, fn: Fn) -> None:
        self.expression = expression
        self._fn = fn

    def evaluate(self, properties: Mapping[str, str], tags: str | None) -> bool | None:
        """TRUE, FALSE or None (NULL); raises nothing: an evaluation error is None too."""
        try:
            return self._fn(properties, tags)  # type: ignore[no-any-return]
        except _EvalError:
            return None

    def matches(self, properties: Mapping[str, str], tags: str | None) -> bool:
        """True when the message is selected (the expression is TRUE for it)."""
        try:
            return self._fn(properties, tags) is True
        except _EvalError:
            return False

    def __repr__(self) -> str:
        return f"SqlFilter({self.expression!r})"


@functools.lru_cache(maxsize=1024)
def compile_sql(expression: str) -> SqlFilter:
    """The filter of ``expression``; SqlFilterError (a ValueError) when it does not compile."""
    from lark.exceptions import LarkError, VisitError

    if not isinstance(expression, str) or not expression.strip():
        raise SqlFilterError("an SQL92 expression is required (it was empty)")
    try:
        tree = _parser().parse(expression)
    except VisitError as exc:  # pragma: no cover - no transformer runs inside lark
        raise SqlFilterError(str(exc.orig_exc)) from None
    except LarkError as exc:
        raise SqlFilterError(_syntax_message(expression, exc)) from None
    try:
        node = _build(tree)
    except SqlFilterError as exc:
        raise SqlFilterError(f"SQL92 expression {_shown(expression)} is invalid: {exc.message}"
                             ) from None
    return SqlFilter(expression, node.fn)
