"""The SQL92 evaluator (protocol/sql_filter.py) against a small model, RocketMQ's corners, and
every kind of bad expression answered with SqlFilterError."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tidemq.protocol.members import bitmap, is_member, member_offsets, members
from tidemq.protocol.record import MessageData, encode_batch
from tidemq.protocol.sql_filter import SqlFilterError, compile_sql

# -- the model ------------------------------------------------------------------------------
# Expressions are generated as trees, rendered to SQL, and evaluated here directly. The model
# is written from RocketMQ's documented behaviour, not from the evaluator: a property compared
# with an integer must be a Java integer of the literal's width, with a double a Java double;
# a value that does not convert makes the whole evaluation fail (ERR), which AND/OR reach only
# when their left side did not decide; NULL is three-valued.


class ERR(Exception):
    pass


INT_RE = re.compile(r"[+-]?[0-9]+\Z")
DBL_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")


def to_int(s: str, bits: int) -> int:
    if not INT_RE.match(s):
        raise ERR
    v = int(s)
    if not -(2 ** (bits - 1)) <= v < 2 ** (bits - 1):
        raise ERR
    return v


def to_double(s: str) -> float:
    s = s.strip()
    if not DBL_RE.match(s):
        raise ERR
    return float(s)


def ev(node, props):  # noqa: C901 - one branch per construct, as the grammar
    kind = node[0]
    if kind == "const":
        return node[1]
    if kind == "and":
        lv = ev(node[1], props)
        if lv is False:
            return False
        rv = ev(node[2], props)
        if rv is False:
            return False
        return None if None in (lv, rv) else True
    if kind == "or":
        lv = ev(node[1], props)
        if lv is True:
            return True
        rv = ev(node[2], props)
        if rv is True:
            return True
        return None if None in (lv, rv) else False
    if kind == "not":
        v = ev(node[1], props)
        return None if v is None else not v
    if kind == "null":
        present = props.get(node[1]) is not None
        return (not present) if node[2] else present  # node[2]: IS NULL
    if kind == "in":
        v = props.get(node[1])
        if v is None:
            return None
        return (v in node[2]) != node[3]
    if kind == "cmp":
        _, name, op, lit = node
        v = props.get(name)
        if v is None:
            return None
        if isinstance(lit, str):  # only = and <>
            eq = v == lit
        else:
            if isinstance(lit, float):
                x = to_double(v)
            else:
                # a literal's width is that of its digits: -2147483648 is minus the 64-bit
                # 2147483648, so it reads properties as 64-bit integers (RocketMQ's typing)
                x = to_int(v, 32 if abs(lit) <= 2**31 - 1 else 64)
            eq = x == lit
            if op in ("<", "<=", ">", ">="):
                return {"<": x < lit, "<=": x <= lit, ">": x > lit, ">=": x >= lit}[op]
        return eq if op == "=" else not eq
    if kind == "between":
        _, name, lo, hi, negated = node
        if negated:
            return ev(("or", ("cmp", name, "<", lo), ("cmp", name, ">", hi)), props)
        return ev(("and", ("cmp", name, ">=", lo), ("cmp", name, "<=", hi)), props)
    raise AssertionError(kind)


def render(node) -> str:
    kind = node[0]
    if kind == "const":
        return "TRUE" if node[1] else "FALSE"
    if kind in ("and", "or"):
        return f"({render(node[1])} {kind.upper()} {render(node[2])})"
    if kind == "not":
        return f"NOT ({render(node[1])})"
    if kind == "null":
        return f"{node[1]} IS {'' if node[2] else 'NOT '}NULL"
    if kind == "in":
        items = ", ".join("'" + s.replace("'", "''") + "'" for s in node[2])
        return f"{node[1]} {'NOT ' if node[3] else ''}IN ({items})"
    if kind == "cmp":
        return f"{node[1]} {node[2]} {lit(node[3])}"
    if kind == "between":
        return f"{node[1]} {'NOT ' if node[4] else ''}BETWEEN {lit(node[2])} AND {lit(node[3])}"
    raise AssertionError(kind)


def lit(v) -> str:
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    if isinstance(v, float):
        return repr(v)
    return str(v) if v >= 0 else f"-{-v}"


NAMES = ["a", "b", "TAGS"]
VALUES = ["1", "2", "-3", "10", "2.5", "abc", "true", "", " 5", "3000000000", "it's", "1e2",
          "+7", "007"]
ints = st.sampled_from([0, 1, 2, 3, 10, -3, 3000000000, -5000000000, 2**31 - 1, -(2**31)])
floats = st.sampled_from([0.5, 2.5, 1e2, 3.0, 1e-3])
strs = st.sampled_from(VALUES)
names = st.sampled_from(NAMES)


@st.composite
def comparisons(draw):
    name = draw(names)
    if draw(st.booleans()):
        return ("cmp", name, draw(st.sampled_from(["=", "<>"])), draw(strs | ints | floats))
    return ("cmp", name, draw(st.sampled_from(["<", "<=", ">", ">=", "=", "<>"])),
            draw(ints | floats))


@st.composite
def betweens(draw):
    lo, hi = sorted([draw(ints), draw(ints)])
    return ("between", draw(names), lo, hi, draw(st.booleans()))


leaves = st.one_of(
    comparisons(),
    betweens(),
    st.tuples(st.just("null"), names, st.booleans()),
    st.tuples(st.just("in"), names, st.lists(strs, min_size=1, max_size=4).map(tuple),
              st.booleans()),
    st.tuples(st.just("const"), st.booleans()),
)
trees = st.recursive(
    leaves,
    lambda sub: st.one_of(
        st.tuples(st.just("and"), sub, sub),
        st.tuples(st.just("or"), sub, sub),
        st.tuples(st.just("not"), sub),
    ),
    max_leaves=8,
)
messages = st.fixed_dictionaries({}, optional={n: strs for n in NAMES})


@settings(max_examples=400, deadline=None)
@given(trees, st.lists(messages, min_size=1, max_size=6))
@example(("between", "a", -(2**31), 3000000000, False), [{"a": "3000000000"}])
def test_evaluator_agrees_with_the_model(tree, msgs):
    flt = compile_sql(render(tree))
    for props in msgs:
        tags = props.get("TAGS")
        user = {k: v for k, v in props.items() if k != "TAGS"}
        try:
            want = ev(tree, props)
        except ERR:
            want = None
        assert flt.evaluate(user, tags) is want, (render(tree), props)
        assert flt.matches(user, tags) is (want is True)


# -- RocketMQ's corners, one by one ------------------------------------------------------------


@pytest.mark.parametrize(("sql", "props", "tags", "selected"), [
    ("a > 5", {"a": "10"}, None, True),
    ("a > 5", {"a": "x"}, None, False),  # does not convert: not selected
    ("a > 5", {}, None, False),  # NULL
    ("a BETWEEN 0 AND 3 AND b = 'name2'", {"a": "2", "b": "name2"}, None, True),
    ("TAGS IN ('TagA', 'TagB')", {}, "TagA", True),
    ("TAGS IS NOT NULL AND a IS NULL", {}, "T", True),
    ("a <> 'x'", {}, None, False),  # a missing: NULL, not TRUE
    ("NOT (a = 'x')", {"a": "y"}, None, True),
    ("a = 5 OR b = 'x'", {"a": "abc", "b": "x"}, None, False),  # error on the left first
    ("b = 'x' OR a = 5", {"a": "abc", "b": "x"}, None, True),  # decided before the error
    ("a = 3000000000", {"a": "3000000000"}, None, True),  # a 64-bit literal reads longs
    ("a = 5", {"a": "3000000000"}, None, False),  # a 32-bit literal does not
    ("a = 5", {"a": "+5"}, None, True),
    ("a = 5", {"a": "5.0"}, None, False),  # not an integer
    ("a = 5.0", {"a": "5"}, None, True),  # a double literal reads doubles
    ("a > 1.5", {"a": " 2 "}, None, True),  # Double.valueOf trims
    ("a >= -3", {"a": "-3"}, None, True),
    ("a > b", {"a": "10", "b": "9"}, None, True),  # two strings: compared as doubles
    ("a > b", {"a": "10", "b": "x"}, None, False),
    ("a = TRUE", {"a": "True"}, None, True),  # Boolean.valueOf
    ("TRUE", {}, None, True),
    ("FALSE OR NULL", {}, None, False),
    ("a", {"a": "true"}, None, False),  # a bare property is never a boolean
    ("x = 'it''s' -- trailing comment\n", {"x": "it's"}, None, True),
    ("/* c */ x IN ('a') AND y NOT IN ('b', 'c')", {"x": "a", "y": "d"}, None, True),
    ("a nOt BeTwEeN 1 aNd 3", {"a": "5"}, None, True),
    ("index = 'x' AND In1 IS NULL", {"index": "x"}, None, True),  # keywords only whole
    ("$a_1 = 'v'", {"$a_1": "v"}, None, True),
    ("NOT a = 'x'", {"a": "x"}, None, False),  # (NOT a) = 'x': an error, as in RocketMQ
    ("-a = -5", {"a": "5"}, None, False),  # minus of a string is NULL
    ("a = -2147483648", {"a": "-2147483648"}, None, True),
    ("a = 1 AND a IS NOT NULL OR TAGS = 'x'", {}, "x", True),
])
def test_rocketmq_semantics(sql, props, tags, selected):
    assert compile_sql(sql).matches(props, tags) is selected


BAD = [
    ("", "required"),
    ("   ", "required"),
    ("a >", "ends too early"),
    ("(a = 1", "ends too early"),
    ("a ==1", "unexpected '=' at column 4"),
    ("a = 1 b", "unexpected 'b' at column 7"),
    ("a # 1", "unexpected character '#' at column 3"),
    ("a = NULL", "IS [NOT] NULL"),
    ("NULL = a", "IS [NOT] NULL"),
    ("a > 'x'", "cannot be compared"),
    ("a < TRUE", "cannot be compared"),
    ("a > NULL", "cannot be compared"),
    ("a > (b = 1)", "condition cannot be compared"),
    ("a BETWEEN 3 AND 1", "lower bound"),
    ("a BETWEEN NULL AND 3", "cannot be NULL"),
    ("a BETWEEN 'x' AND 'y'", "cannot be compared"),
    ("NOT 5", "not a condition"),
    ("5", "not a condition"),
    ("'x'", "not a condition"),
    ("a = 1 AND 'x'", "not a condition"),
    ("a in (1, 2)", "unexpected"),
    ("5 IN ('a')", "IN needs a property"),
    ("a IN ()", "unexpected"),
    ("TRUE = 1", "cannot be compared"),
    ("99999999999999999999", "64-bit"),
    ("a > 0.0", "smallest positive double"),
    ("a = 1e999", "largest double"),
    ("05 = a", "unexpected"),
    ("a = 'open", "unexpected character"),
    ("a.b = 1", "unexpected character '.'"),
    ("a = 1 -- comment without a newline", "unexpected"),
    ("a LIKE 'x%'", "unexpected"),
    ("a = 1 AND", "ends too early"),
    ("NOT " * 5000 + "TRUE", "nests more than 200 levels"),
    (" AND ".join(["a = 1"] * 3000), "nests more than 200 levels"),
]


def test_parentheses_do_not_nest_the_expression():
    assert compile_sql("(" * 2000 + "a = 1" + ")" * 2000).matches({"a": "1"}, None)


@pytest.mark.parametrize(("sql", "why"), BAD)
def test_bad_expressions_are_refused_with_the_reason(sql, why):
    with pytest.raises(SqlFilterError) as e:
        compile_sql(sql)
    assert why in e.value.message
    assert isinstance(e.value, ValueError)


TOKENS = ["a", "b", "TAGS", "=", "<>", "<", ">", ">=", "<=", "AND", "OR", "NOT", "IN", "IS",
          "NULL", "TRUE", "FALSE", "BETWEEN", "(", ")", ",", "'x'", "'it''s'", "1", "-", "+",
          "2.5", "0.0", "3000000000", "L", "--", "/*", "*/", "'", "é", "\n", "%", ".5E3"]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=12).map(" ".join) | st.text(max_size=30))
def test_any_text_compiles_or_is_refused_cleanly(text):
    try:
        flt = compile_sql(text)
    except SqlFilterError as exc:
        assert exc.message
        return
    # whatever compiles evaluates without raising, on any message
    for props in ({}, {"a": "1", "b": "x"}, {"a": "abc"}):
        assert flt.evaluate(props, "x") in (True, False, None)


# -- member bitmaps ---------------------------------------------------------------------------


@given(st.sets(st.integers(0, 300)))
def test_bitmap_round_trip(indices):
    bits = bitmap(sorted(indices))
    assert members(bits) == sorted(indices)
    assert all(is_member(bits, i) == (i in indices) for i in range(310))
    assert len(bits) == (max(indices) // 8 + 1 if indices else 0)


def test_member_offsets_walk_the_body_batch_by_batch():
    b1 = encode_batch("t", [MessageData(b"x")] * 5)
    b2 = encode_batch("t", [MessageData(b"y")] * 3)
    # stored queue offsets: 10.. and 15..
    b1[20:28] = (10).to_bytes(8, "little")
    b2[20:28] = (15).to_bytes(8, "little")
    body = bytes(b1 + b2)
    assert member_offsets(body, [bitmap([0, 4]), bitmap([2])]) == {10, 14, 17}
    assert member_offsets(body, [bitmap([1])]) == {11}  # batches without a bitmap: nobody's
    assert member_offsets(body[:30], [bitmap([0]), bitmap([0])]) == set()
