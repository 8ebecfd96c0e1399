"""The 30 s route refresh fetches only what changed (GET_ROUTES_CHANGED), against a real
`tidemq dev`: nothing changed -> no route fetched; one topic gets more queues -> that route
only, and the client sends to the new queues."""

from __future__ import annotations

import asyncio

from tidemq import aio

TOPICS = [f"rr-{i}" for i in range(24)]
TICK = 0.2  # the clients' refresh interval here (30 s by default)


async def _until(cond, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_refresh_fetches_only_the_routes_that_changed(dev):
    async def main() -> None:
        async with aio.Admin(dev.namesrv) as admin:
            for t in TOPICS:
                await admin.create_topic(t, 4)
        async with aio.Producer(dev.namesrv, route_refresh=TICK) as p:
            for t in TOPICS:
                await p.send(aio.Message(t, b"x"))
            routes = p.routes
            # The first refresh cannot know what changed since the routes it holds were
            # fetched: it fetches them all (those held then); then only what changed.
            await asyncio.sleep(3 * TICK)
            quiet = routes.fetches
            assert len(TOPICS) <= quiet <= 2 * len(TOPICS)
            await asyncio.sleep(8 * TICK)
            assert routes.fetches == quiet, "a refresh fetched routes although none changed"

            async with aio.Admin(dev.namesrv) as admin:
                await admin.create_topic(TOPICS[3], 16)
            await _until(lambda: len(routes.cached(TOPICS[3]).write_queues) == 16)
            await asyncio.sleep(3 * TICK)
            assert routes.fetches == quiet + 1, "more than the changed route was fetched"
            got = {(await p.send(aio.Message(TOPICS[3], b"y"),
                                 queue_id=q)).queue_id for q in (12, 15)}
            assert got == {12, 15}

    asyncio.run(main())


def test_a_client_of_an_older_name_server_refreshes_everything(dev):
    """Without GET_ROUTES_CHANGED (any error answer), a refresh fetches every held route, as
    before the request existed."""

    async def main() -> None:
        async with aio.Producer(dev.namesrv, route_refresh=3600) as p:
            for t in TOPICS[:5]:
                await p.send(aio.Message(t, b"x"))
            routes = p.routes
            assert sorted(await routes.changed_topics()) == sorted(TOPICS[:5])  # first: all
            assert await routes.changed_topics() == []  # nothing changed since
            routes._ns_instance = "a restarted name server's history"
            assert sorted(await routes.changed_topics()) == sorted(TOPICS[:5])

    asyncio.run(main())


def test_a_consumer_starts_with_one_route_fetch_per_topic(dev):
    """The first heartbeat fetches every subscribed topic's route; the first rebalance, right
    after it, uses them rather than fetching each again (issue 17: 12,500 topics)."""

    async def main() -> None:
        topics = [f"rs-{i}" for i in range(12)]
        async with aio.Admin(dev.namesrv) as admin:
            for t in topics:
                await admin.create_topic(t, 2)
        c = aio.PullConsumer(dev.namesrv, "g-route-start", consume_from="first")
        for t in topics:
            c.subscribe(t)
        async with c:
            assert len(c.assignment()) == 2 * len(topics)
            assert c.routes.fetches == len(topics)

    asyncio.run(main())
