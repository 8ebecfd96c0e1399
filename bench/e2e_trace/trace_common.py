import atexit, gc, os, pickle, time, sys, signal
tn = time.time_ns
EV = {"gc": []}
def gc_hook():
    st = {}
    def cb(phase, info):
        if phase == "start":
            st["t"] = tn(); st["c"] = time.thread_time_ns()
        else:
            EV["gc"].append((st.get("t", 0), tn(), info["generation"], info["collected"], time.thread_time_ns() - st.get("c", 0)))
    gc.callbacks.append(cb)
def census_hook():
    """stdlib asyncio: time every callback (wall + thread CPU), keep the long ones."""
    import asyncio.events as ev
    orig = ev.Handle._run
    long = EV.setdefault("cb", [])
    tot = EV.setdefault("cbtot", {})
    def _run(self):
        t = tn(); c = time.thread_time_ns()
        try:
            return orig(self)
        finally:
            dt = tn() - t; dc = time.thread_time_ns() - c
            name = getattr(self._callback, "__qualname__", None) or repr(self._callback)
            if name.endswith("__step") or name.endswith("__wakeup") or "step" in name:
                try:
                    coro = self._callback.__self__.get_coro()
                    name = "task:" + coro.__qualname__
                except Exception:
                    pass
            a = tot.get(name)
            if a is None:
                tot[name] = [1, dc, dc]
            else:
                a[0] += 1; a[1] += dc; a[2] = max(a[2], dc)
            if dc > 200_000 or dt > 1_000_000:
                long.append((t, dt, dc, name))
    ev.Handle._run = _run
def dump(path):
    def _d():
        with open(path, "wb") as f:
            pickle.dump(EV, f)
    atexit.register(_d)
def census_types(period=3.0):
    import threading, collections
    out = EV.setdefault("types", [])
    def run():
        while True:
            time.sleep(period)
            c = collections.Counter(type(o).__name__ for o in gc.get_objects())
            out.append((tn(), gc.get_count(), [len(gc.get_objects(i)) for i in range(3)], c.most_common(25)))
    threading.Thread(target=run, daemon=True).start()
