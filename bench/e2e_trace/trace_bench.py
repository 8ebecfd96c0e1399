"""bench e2e with per-message stage stamps. argv: namesrv out [seconds] ; env E2E_CENSUS=1."""
import os, sys, time, asyncio, struct, uuid, json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_common as T
tn = T.tn
census = os.environ.get("E2E_CENSUS") == "1"
if census:
    T.census_hook()
T.gc_hook()
from tidemq.client import connection as cc
from tidemq.client import consumer as cons
from tidemq.protocol.codes import RequestCode
EV = T.EV
req = EV["req"] = {}   # opaque -> [code, qid, qoff, t_queued, t_written]
resp = EV["resp"] = []  # (opaque, t_read_entry, header)
qsince = []
o_sr = cc.Connection.start_request
def start_request(self, code, header=None, body=b"", timeout=cc.DEFAULT_TIMEOUT if hasattr(cc, "DEFAULT_TIMEOUT") else 3.0, sink=None):
    o = self._next_opaque
    f = o_sr(self, code, header, body, timeout, sink)
    qid = getattr(header, "queue_id", None); qoff = getattr(header, "queue_offset", None)
    if self.address.endswith(BROKER_PORT):
        r = req[o] = [int(code), qid, qoff, tn(), 0]
        qsince.append(r)
    return f
cc.Connection.start_request = start_request
BROKER_PORT = "?"
o_fl = cc.Connection._flush
def _flush(self):
    t = tn(); o_fl(self)
    if self.address.endswith(BROKER_PORT):
        t2 = tn()
        for r in qsince:
            r[4] = t2
        qsince.clear()
        EV.setdefault("cw", []).append((t, t2))
cc.Connection._flush = _flush
o_dr = cc.Connection.data_received
cur = [0]
def data_received(self, data):
    t = cur[0] = tn()
    if self.address.endswith(BROKER_PORT):
        dec = self._decoder
        if not isinstance(dec, DecProxy):
            dec = self._decoder = DecProxy(dec)
        dec.frames = frames = []
        o_dr(self, data)
        t2 = tn()
        for fr in frames:
            h = fr.header
            resp.append((fr.opaque, t, t2, getattr(h, "queue_id", None), getattr(h, "queue_offset", None), getattr(h, "count", None)))
    else:
        o_dr(self, data)
class DecProxy:
    def __init__(self, d):
        object.__setattr__(self, "_d", d); object.__setattr__(self, "frames", [])
    def feed(self, data):
        fr = self._d.feed(data); self.frames.extend(fr); return fr
    def __getattr__(self, n):
        return getattr(self._d, n)
    def __setattr__(self, n, v):
        if n == "frames": object.__setattr__(self, n, v)
        else: setattr(self._d, n, v)
cc.Connection.data_received = data_received
o_push = cons.PullConsumer._push
pushes = EV["push"] = []
def _push(self, q, msgs, nxt):
    if msgs:
        pushes.append((q.mq.queue_id, msgs[0].queue_offset, len(msgs), cur[0], tn()))
    return o_push(self, q, msgs, nxt)
cons.PullConsumer._push = _push
o_handle = cons.PullConsumer._handle
hs = EV["handle"] = []
def _handle(self, q, offset, status, h, body):
    t = tn(); o_handle(self, q, offset, status, h, body); hs.append((cur[0], t, tn()))
cons.PullConsumer._handle = _handle

from tidemq.bench.client_bench import ensure_topic, run_loop
from tidemq.client.connection import ConnectionPool
from tidemq.client.consumer import PullConsumer
from tidemq.client.message import Message
from tidemq.client.producer import Producer
_TS = struct.Struct("<q")
async def e2e(namesrv, topic, size=1024, rate=10000, seconds=10.0, queues=8):
    global BROKER_PORT
    await ensure_topic(namesrv, topic, queues)
    group = f"bench-e2e-{uuid.uuid4().hex[:12]}"
    recv = EV["recv"] = []
    pad = b"\0" * (size - 8)
    stop = asyncio.Event()
    pool = ConnectionPool()
    consumer = PullConsumer(namesrv, group, consume_from="last", auto_commit=False, pull_batch_size=256, pool=pool)
    consumer.subscribe(topic)
    async with consumer, Producer(namesrv, pool=pool, batch_max_delay=0.0) as producer:
        await consumer.poll(timeout=0.01)
        for _ in range(200):
            if all(consumer.position(mq) is not None for mq in consumer.assignment()):
                break
            await asyncio.sleep(0.01)
        await producer.send(Message(topic, _TS.pack(time.time_ns()) + pad))
        await asyncio.sleep(0.2)
        await consumer.poll(timeout=0.01)
        BROKER_PORT = ":" + os.environ["E2E_BROKER_PORT"]
        async def receive():
            while not stop.is_set():
                msgs = await consumer.poll(timeout=0.2)
                now = time.time_ns()
                for m in msgs:
                    recv.append((m.queue_id, m.queue_offset, _TS.unpack_from(m.body)[0], now))
        rx = asyncio.ensure_future(receive())
        total = int(rate * seconds); sent = 0
        pending = set()
        ticks = EV["ticks"] = []
        t0 = time.perf_counter(); c0 = time.process_time()
        while sent < total:
            due = min(total, int((time.perf_counter() - t0) * rate) + 1)
            ticks.append((tn(), due - sent))
            while sent < due:
                f = producer.send_async(Message(topic, _TS.pack(time.time_ns()) + pad))
                pending.add(f); f.add_done_callback(pending.discard); sent += 1
            await asyncio.sleep(0.001)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        cpu = time.process_time() - c0
        deadline = time.perf_counter() + 5
        while len(recv) < sent and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        stop.set(); await rx
    pool.close()
    lat = sorted((r[3] - r[2]) / 1e6 for r in recv)
    pct = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
    return {"sent": sent, "received": len(lat), "p50": pct(.5), "p99": pct(.99), "p999": pct(.999), "max": lat[-1], "cpu_us": cpu / sent * 1e6}
if __name__ == "__main__":
    ns, out = sys.argv[1], sys.argv[2]
    secs = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
    T.dump(out)
    if census:
        res = asyncio.run(e2e(ns, "lat", seconds=secs))
    else:
        res = run_loop(e2e(ns, "lat", seconds=secs))
    print(json.dumps(res))
