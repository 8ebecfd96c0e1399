"""The blocking producer's loop (client/blocking.py, ``_LoopHost``): a thread that sends alone
runs the producers' event loop itself inside ``send`` (the round trip on the calling thread),
and hands it back when another thread needs it or when it stops sending -- no caller ever
waits on a loop nobody runs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

import tidemq
from tidemq.client import blocking

pytestmark = pytest.mark.timeout(120)


def _owner() -> int:
    return blocking._host(blocking.PRODUCERS)._owner


def _wait_for(cond, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def test_a_thread_sending_alone_runs_the_loop_and_gives_it_back_when_idle(dev):
    with tidemq.Producer(dev.namesrv) as p:
        offsets = [p.send(tidemq.Message("bl-alone", b"m%d" % i)).queue_offset
                   for i in range(10)]
        assert all(o >= 0 for o in offsets)
        # The last sends ran the loop on this very thread: it holds the loop between sends.
        assert _owner() == threading.get_ident()
        # Idle for longer than RECLAIM_AFTER: the loop's thread takes it back.
        assert _wait_for(lambda: _owner() == 0)
        assert p.send(tidemq.Message("bl-alone", b"after")).queue_offset >= 0


def test_a_lone_send_costs_the_loop_one_iteration(dev):
    """The borrower runs the loop's iterations itself (no run_forever per send) and the
    hand-over writes the frame at once (no end-of-iteration write left to run): one
    iteration per send, the one that waits for the answer (two before: the second ran the
    write scheduled although the frame was already written)."""
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(5):
            p.send(tidemq.Message("bl-iter", b"w%d" % i))
        assert _owner() == threading.get_ident()
        loop = blocking._host(blocking.PRODUCERS).loop
        runs = [0, 0]
        real_once, real_forever = loop._run_once, loop.run_forever
        me = threading.get_ident()  # (the host thread runs the loop too if it reclaims it)

        def once() -> None:
            runs[0] += threading.get_ident() == me
            real_once()

        def forever() -> None:
            runs[1] += threading.get_ident() == me
            real_forever()

        loop._run_once = once  # type: ignore[method-assign]
        loop.run_forever = forever  # type: ignore[method-assign]
        try:
            n = 50
            for i in range(n):
                assert p.send(tidemq.Message("bl-iter", b"m%d" % i)).queue_offset >= 0
        finally:
            del loop._run_once, loop.run_forever
        assert runs[1] == 0
        # a send handed over after a reclaim (the machine stalled this thread for 10 ms)
        # runs no iteration here, a timer due meanwhile one more; never two per send
        assert n - 5 <= runs[0] <= n + 3


def test_a_thread_sending_alone_writes_each_message_without_the_hand_over(dev, monkeypatch):
    """The borrower's send of a message whose topic has nothing gathered or in flight is
    written at once as a batch of its own (Producer._lone_driven, Accumulator.start_lone):
    no inbox, no drain, no bucket list -- and it is still counted in flight while it waits,
    so a message of another thread gathers behind it. Each gets its own result, with or
    without a timeout, and a refused message still fails only its own send."""
    drains = [0]
    real_drain = blocking._Inbox._drain

    def drain(self: blocking._Inbox) -> None:
        drains[0] += 1
        real_drain(self)

    monkeypatch.setattr(blocking._Inbox, "_drain", drain)
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(5):
            p.send(tidemq.Message("bl-lane", b"w%d" % i))
        assert _owner() == threading.get_ident()
        acc = p._aio.accumulator
        seen: list[bool] = []
        real_start = acc.start_one

        def start_one(*args):  # the lane's batch counts as in flight when it is written
            seen.append(acc.answer_pending("bl-lane"))
            return real_start(*args)

        acc.start_one = start_one
        drains[0] = 0
        batches = acc.batches
        results = [p.send(tidemq.Message("bl-lane", b"m%d" % i), **opts)
                   for i in range(40) for opts in ({}, {"timeout": 5.0})]
        assert drains[0] == 0
        assert seen == [True] * 80
        assert acc.batches - batches == 80
        assert len({(r.queue_id, r.queue_offset) for r in results}) == 80
        assert all(r.queue_offset >= 0 for r in results)
        with pytest.raises(tidemq.MessageRejectedError):
            p.send(tidemq.Message("bl-lane", b"x", properties={"p": "v" * 40_000}))
        assert p.send(tidemq.Message("bl-lane", b"after")).queue_offset >= 0
        assert acc.npending == 0
        assert not acc.answer_pending("bl-lane")


def test_another_thread_gets_the_loop_back_while_one_thread_holds_it(dev):
    """Thread A holds the loop (and keeps sending); B's sends, calls and send_async are
    served at once, A's sends keep working, and every message is stored."""
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(5):
            p.send(tidemq.Message("bl-two", b"a%d" % i))
        assert _owner() == threading.get_ident()
        stop = threading.Event()
        a_sent = [5]

        def keep_sending() -> None:  # A keeps the loop busy while B works
            while not stop.is_set():
                p.send(tidemq.Message("bl-two", b"a%d" % a_sent[0]))
                a_sent[0] += 1

        # A is this thread until here; continue as thread A in the background.
        a = threading.Thread(target=keep_sending)
        a.start()
        try:
            t0 = time.monotonic()
            for i in range(20):
                assert p.send(tidemq.Message("bl-two", b"b%d" % i)).queue_offset >= 0
                assert p.send_async(tidemq.Message("bl-two", b"c%d" % i)).result(10)
            assert p.write_queues("bl-two")
            assert time.monotonic() - t0 < 10
        finally:
            stop.set()
            a.join(30)
        assert not a.is_alive()
        assert a_sent[0] > 5
        # The main thread took no further sends: whoever held the loop gives it back.
        assert _wait_for(lambda: _owner() == 0)


def test_a_thread_holding_the_loop_can_close_and_reopen(dev):
    p = tidemq.Producer(dev.namesrv).start()
    for i in range(5):
        p.send(tidemq.Message("bl-close", b"x%d" % i))
    assert _owner() == threading.get_ident()
    p.close()  # a call on the loop by the holder itself: the loop goes back first
    with tidemq.Producer(dev.namesrv) as q:
        assert q.send(tidemq.Message("bl-close", b"again")).queue_offset >= 0


def test_a_send_that_fails_while_the_caller_runs_the_loop_raises_its_own_error(dev):
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(5):
            p.send(tidemq.Message("bl-err", b"ok%d" % i))
        assert _owner() == threading.get_ident()
        with pytest.raises(tidemq.MessageRejectedError):
            p.send(tidemq.Message("bl-err", b"x", properties={"p": "v" * 40_000}))
        assert p.send(tidemq.Message("bl-err", b"after")).queue_offset >= 0
        assert p._aio.accumulator.npending == 0


def test_many_threads_on_two_topics_and_pinned_queues_are_all_answered_promptly(dev):
    """Messages handed over while a batch of their topic is in flight wake nobody and leave
    when that batch is answered (client/blocking.py, _Inbox); other topics and pinned sends
    wake the loop themselves. Under 12 threads mixing them, every send is answered, each with
    its own offset, and none waits for long (a message left behind in the inbox would wait
    for some later wake-up, or hang to its 40 s slack)."""
    with tidemq.Producer(dev.namesrv, send_timeout=10.0) as p:
        p.send(tidemq.Message("bl-x", b"warm"))
        p.send(tidemq.Message("bl-y", b"warm"))
        slowest = [0.0]
        offsets: list[tuple[str, int, int]] = []
        lock = threading.Lock()

        def run(t: int) -> None:
            for i in range(150):
                topic = "bl-x" if (i + t) % 3 else "bl-y"
                opts = {"queue_id": t % 2} if i % 7 == 0 else {}
                t0 = time.monotonic()
                r = p.send(tidemq.Message(topic, b"%d-%d" % (t, i)), **opts)
                took = time.monotonic() - t0
                with lock:
                    slowest[0] = max(slowest[0], took)
                    offsets.append((topic, r.queue_id, r.queue_offset))

        threads = [threading.Thread(target=run, args=(t,)) for t in range(12)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads)
        assert len(offsets) == 12 * 150 and len(set(offsets)) == 12 * 150
        assert slowest[0] < 5.0, f"a send took {slowest[0]:.1f} s"


def test_the_loop_changes_hands_many_times_without_a_stall(dev):
    """A sends in a loop (and so borrows the loop again and again) while B keeps calling the
    producer (each call has the loop handed back to its thread): hundreds of hand-overs each
    way, and both finish."""
    with tidemq.Producer(dev.namesrv) as p:
        p.send(tidemq.Message("bl-hands", b"warm"))
        stop = threading.Event()
        calls = [0]

        def b() -> None:
            while not stop.is_set():
                p.write_queues("bl-hands")
                calls[0] += 1

        tb = threading.Thread(target=b)
        tb.start()
        try:
            t0 = time.monotonic()
            for i in range(400):
                assert p.send(tidemq.Message("bl-hands", b"%d" % i), timeout=10).queue_offset >= 0
            assert time.monotonic() - t0 < 60
        finally:
            stop.set()
            tb.join(30)
        assert not tb.is_alive() and calls[0] > 0


def test_fork_while_this_thread_holds_the_loop(dev):
    """fork() between two sends of a thread that holds the loop: the child gets fresh loops
    and connections on its first call, and the parent's thread still holds and uses its own."""
    import os

    with tidemq.Producer(dev.namesrv) as p:
        for i in range(5):
            p.send(tidemq.Message("bl-fork", b"p%d" % i))
        assert _owner() == threading.get_ident()
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if its sends were stored
            code = 1
            try:
                rs = [p.send(tidemq.Message("bl-fork", b"c%d" % i), timeout=10)
                      for i in range(5)]
                if all(r.queue_offset >= 0 for r in rs):
                    code = 0
                p.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert p.send(tidemq.Message("bl-fork", b"parent again")).queue_offset >= 0


def test_the_blocking_transaction_producer_sends_and_commits(dev):
    """The blocking TransactionProducer is built like the Producer (it lacked the facade's
    inbox before, so its plain send failed): a transaction commits, a plain send works."""
    s = tidemq.LocalTransactionState
    with tidemq.TransactionProducer(dev.namesrv, "bl-txn-pg",
                                    checker=lambda m: s.UNKNOW) as p:
        r = p.send_in_transaction(tidemq.Message("bl-txn", b"committed"),
                                  lambda m, a: s.COMMIT_MESSAGE)
        assert r.local_transaction_state is s.COMMIT_MESSAGE
        assert p.send(tidemq.Message("bl-txn", b"plain")).queue_offset >= 0


def _switches_per_send(namesrv: str, rounds: int = 3) -> float:
    """The fewest voluntary context switches per blocking send over ``rounds`` rounds of 16
    threads sending 150 messages each (after 20 to settle)."""
    import resource

    best = 99.0
    with tidemq.Producer(namesrv) as p:
        p.send(tidemq.Message("bl-bell", b"warm"))
        n = 150
        for _ in range(rounds):
            per_thread: list[float] = []
            lock = threading.Lock()

            def run(t: int, per_thread: list[float] = per_thread,
                    lock: threading.Lock = lock) -> None:
                for i in range(20):  # settle: every thread handing over, batches in flight
                    p.send(tidemq.Message("bl-bell", b"w%d-%d" % (t, i)))
                c0 = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
                for i in range(n):
                    p.send(tidemq.Message("bl-bell", b"%d-%d" % (t, i)))
                c1 = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
                with lock:
                    per_thread.append((c1 - c0) / n)

            threads = [threading.Thread(target=run, args=(t,)) for t in range(16)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(60)
            assert not any(th.is_alive() for th in threads)
            best = min(best, sum(per_thread) / len(per_thread))
    return best


def test_blocking_senders_of_many_threads_sleep_less_on_the_doorbell_than_on_a_lock(
        dev, monkeypatch):
    """A caller handed over to the loop sleeps until its answer: the loop rings the caller's
    doorbell with a write that releases the GIL (client/blocking.py, _Bell), so the woken
    caller runs at once. Released with a threading.Lock (the fallback off Linux), with the
    GIL held, a caller often sleeps a second time, on the GIL. Measured in the same run, as
    the best of three rounds each: quiet machine 2.1-2.3 against 2.4-2.7 per send, loaded
    1.0-1.6 against 2.2-2.7 (docs/producer-path.md)."""
    bell = _switches_per_send(dev.namesrv)
    monkeypatch.setattr(blocking, "_Waiter", blocking._LockWaiter)
    monkeypatch.setattr(blocking, "_BELLS", False)  # and the lock's order of wake-ups
    with_lock = _switches_per_send(dev.namesrv)
    assert bell < with_lock - 0.1, (
        f"voluntary context switches per blocking send: doorbell {bell:.2f}, "
        f"lock {with_lock:.2f}")


def test_a_late_answer_to_a_waiter_that_gave_up_does_not_end_the_next_wait_early():
    """The doorbell is the thread's, shared by its sends: a ring meant for a send that timed
    out is still in it when the thread's next send waits. That wait must not return before its
    own answer (nor with another's result)."""
    late = blocking._Waiter()
    with pytest.raises(tidemq.RequestTimeoutError):
        late.wait(0.05)
    late.set_result("stale")  # type: ignore[arg-type]  # the loop thread, too late
    late.set_result("stale")  # type: ignore[arg-type]  # (rung twice: two stale bytes)
    w = blocking._Waiter()
    threading.Timer(0.2, w.set_result, args=("mine",)).start()
    t0 = time.monotonic()
    assert w.wait(5.0) == "mine"
    assert time.monotonic() - t0 >= 0.15


def test_a_child_after_fork_gets_a_doorbell_of_its_own():
    """The bell made in the parent is the parent's (its socket pair is shared with the child
    after fork()): a waiter made in the child uses a new one, so a ring in one process never
    wakes a sleeper in the other."""
    import os

    parent = blocking._Waiter()._bell
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            w = blocking._Waiter()
            if w._bell is not parent:
                threading.Timer(0.05, w.set_result, args=("ok",)).start()
                code = 0 if w.wait(5.0) == "ok" else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert blocking._Waiter()._bell is parent


def test_sixteen_threads_travel_as_one_batch_not_two_groups(dev):
    """The callers of an answered batch are woken before what gathered leaves (each puts its
    next message into the inbox before it sleeps again), so 16 threads sending in a loop
    travel together in batches of about 16 -- not as two alternating groups of ~8, which is
    what writing the next batch before waking them gave (7-9 messages per batch). Best of
    three rounds: a loaded machine delays some callers past a batch now and then."""
    best = 0.0
    with tidemq.Producer(dev.namesrv) as p:
        p.send(tidemq.Message("bl-lockstep", b"warm"))
        acc = p._aio.accumulator

        def run(n: int) -> None:
            for _ in range(n):
                p.send(tidemq.Message("bl-lockstep", b"x" * 200))

        for _ in range(3):
            b0, m0 = acc.batches, acc.batched_messages
            threads = [threading.Thread(target=run, args=(150,)) for _ in range(16)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(60)
            assert not any(th.is_alive() for th in threads)
            best = max(best, (acc.batched_messages - m0) / (acc.batches - b0))
            if best >= 11:
                break
    assert best >= 11, f"at best {best:.1f} messages per batch from 16 threads"


def test_a_wait_with_no_time_left_times_out_instead_of_sleeping_for_ever():
    """A zero SO_RCVTIMEO means "no timeout" to the kernel: a waiter given no time at all must
    still give up (here at once), not sleep until some ring that never comes."""
    w = blocking._Waiter()
    t0 = time.monotonic()
    with pytest.raises(tidemq.RequestTimeoutError):
        w.wait(0.0)
    assert time.monotonic() - t0 < 2.0


def _held_inbox(p, monkeypatch):
    """The producer's inbox as while a batch of its topic is in flight: a put wakes nobody,
    and what is put stays in the inbox until the answer's drain (here: the test's).

    First waits until the loop has finished with the warm-up send's answer: it wakes the
    caller before its own drain (``wake_first``), and on a loaded machine that drain could
    run after the test's first put and take the message away."""
    p._host.run(asyncio.sleep(0))  # a callback queued after the answer's: it is done
    inbox = p._inbox
    monkeypatch.setattr(inbox, "_answer_pending", lambda topic: True)
    return inbox


def test_the_loop_waits_for_the_callers_an_answer_woke_before_their_batch_leaves(
        dev, monkeypatch):
    """An answer woke 3 callers and only one has put its next message when the loop gets to
    the drain: the loop waits (blocking._Inbox._gather) until the third is in -- rung by it,
    not by the timeout -- and the three leave as one batch (before, the drain took the one
    message and the stragglers went in a second, smaller batch)."""
    monkeypatch.setattr(blocking, "GATHER_WAIT", 5.0)
    with tidemq.Producer(dev.namesrv) as p:
        p.send(tidemq.Message("bl-gather", b"warm"))
        inbox = _held_inbox(p, monkeypatch)
        sinks = [concurrent.futures.Future() for _ in range(3)]
        inbox.put(tidemq.Message("bl-gather", b"0"), {}, sinks[0], True)
        took: list[float] = []

        def the_loop() -> None:
            t0 = time.monotonic()
            inbox._gather(3)
            took.append(time.monotonic() - t0)

        th = threading.Thread(target=the_loop)
        th.start()
        time.sleep(0.2)
        assert th.is_alive(), "the drain did not wait for the callers still on their way"
        inbox.put(tidemq.Message("bl-gather", b"1"), {}, sinks[1], True)
        time.sleep(0.1)
        assert th.is_alive()
        inbox.put(tidemq.Message("bl-gather", b"2"), {}, sinks[2], True)
        th.join(3.0)
        assert not th.is_alive() and took[0] < 3.0, "the last caller did not ring the loop"
        assert inbox._impatient == 0
        monkeypatch.setattr(blocking, "GATHER_WAIT", 0.05)  # (their answer wakes nobody)
        acc = p._aio.accumulator
        b0 = acc.batches
        p._host.loop.call_soon_threadsafe(inbox._drain)
        results = [s.result(10) for s in sinks]
        assert acc.batches - b0 == 1
        assert [r.queue_offset - results[0].queue_offset for r in results] == [0, 1, 2]


def test_callers_that_do_not_come_back_in_time_cost_one_wait_then_none(dev, monkeypatch):
    """The wait is bounded (GATHER_WAIT), and when the woken callers did not all come back
    (they do other work between sends) the next GATHER_PAUSE answered batches leave without
    waiting at all."""
    monkeypatch.setattr(blocking, "GATHER_WAIT", 0.05)
    with tidemq.Producer(dev.namesrv) as p:
        p.send(tidemq.Message("bl-gather", b"warm"))
        inbox = _held_inbox(p, monkeypatch)
        sink: concurrent.futures.Future = concurrent.futures.Future()
        inbox.put(tidemq.Message("bl-gather", b"0"), {}, sink, True)
        t0 = time.monotonic()
        inbox._gather(3)
        assert time.monotonic() - t0 >= 0.04
        assert inbox._impatient == blocking.GATHER_PAUSE
        t0 = time.monotonic()
        inbox._gather(3)
        assert time.monotonic() - t0 < 0.03
        assert inbox._impatient == blocking.GATHER_PAUSE - 1
        p._host.loop.call_soon_threadsafe(inbox._drain)
        assert sink.result(10).topic == "bl-gather"


def _batch_result(n: int) -> tidemq.SendResult:
    from tidemq.client.message import SendStatus

    return tidemq.SendResult(SendStatus.SEND_OK, "", "bl-turn", 3, 100, n, "b", 7, 40)


def test_the_callers_of_a_batch_are_woken_in_turn_each_with_its_own_result():
    """The loop rings only the first caller of an answered batch (blocking._wake_in_turn);
    each caller, woken, rings the next: every one of them returns, with its own offset and
    sequence."""
    n = 4
    got: dict[int, tidemq.SendResult] = {}
    made: list[blocking._Waiter | None] = [None] * n
    ready = threading.Barrier(n + 1)

    def caller(i: int) -> None:
        w = made[i] = blocking._Waiter()  # the thread's own doorbell
        ready.wait()
        got[i] = w.wait(5.0)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    ready.wait()
    t0 = time.monotonic()
    blocking._wake_in_turn(_batch_result(n), made)
    for th in threads:
        th.join(5.0)
    assert time.monotonic() - t0 < 3.0
    assert [got[i].queue_offset for i in range(n)] == [100, 101, 102, 103]
    assert [got[i].base_seq for i in range(n)] == [40, 41, 42, 43]


def test_a_caller_that_gave_up_does_not_stop_the_callers_after_it():
    """A caller that timed out before its batch was answered will not wake the next one: the
    loop does it for it, and the callers after it still return at once."""
    made: list[blocking._Waiter | None] = [None] * 3
    got: dict[int, object] = {}
    ready = threading.Barrier(4)

    def caller(i: int, timeout: float) -> None:
        w = made[i] = blocking._Waiter()
        ready.wait()
        try:
            got[i] = w.wait(timeout)
        except tidemq.RequestTimeoutError as exc:
            got[i] = exc

    threads = [threading.Thread(target=caller, args=(i, 0.05 if i == 1 else 5.0))
               for i in range(3)]
    for th in threads:
        th.start()
    ready.wait()
    threads[1].join(5.0)
    assert isinstance(got[1], tidemq.RequestTimeoutError)
    t0 = time.monotonic()
    blocking._wake_in_turn(_batch_result(3), made)
    threads[0].join(5.0)
    threads[2].join(5.0)
    assert time.monotonic() - t0 < 3.0, "the caller after the one that gave up was not woken"
    assert got[0].queue_offset == 100 and got[2].queue_offset == 102  # type: ignore[union-attr]
