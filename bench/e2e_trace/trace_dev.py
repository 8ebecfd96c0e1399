"""tidemq dev with stage stamps. env E2E_TRACE_OUT=path, E2E_CENSUS=1 (stdlib loop + callback census)."""
import os, sys, time, signal
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_common as T
tn = T.tn
if os.environ.get("E2E_CENSUS") == "1":
    sys.modules["uvloop"] = None
    T.census_hook()
T.gc_hook()
if os.environ.get("E2E_TYPES") == "1": T.census_types()
GCONLY = os.environ.get('E2E_GCONLY') == '1'
from tidemq.base import connection as bc
from tidemq.broker import pull_processor as pp, send_processor as sp
EV = T.EV
rd = EV["rd"] = []; wr = EV["wr"] = []; snd = EV["send"] = []; pl = EV["pull"] = []; held = EV["held"] = []
cur = [0]
o_dr = bc.ServerConnection.data_received
def data_received(self, data):
    t = cur[0] = tn()
    o_dr(self, data)
    rd.append((t, tn(), len(data)))
if not GCONLY: bc.ServerConnection.data_received = data_received
o_send = bc.ServerConnection._send
def _send(self, parts):
    t = tn(); o_send(self, parts); wr.append((t, tn(), len(parts)))
if not GCONLY: bc.ServerConnection._send = _send
o_sh = sp.SendProcessor.handle
def sh(self, conn, frame):
    t = tn(); o_sh(self, conn, frame); snd.append((frame.opaque, cur[0], t, tn()))
if not GCONLY: sp.SendProcessor.handle = sh
o_ph = pp.PullProcessor.handle
def ph(self, conn, frame):
    t = tn(); o_ph(self, conn, frame); pl.append((frame.opaque, cur[0], t, tn()))
if not GCONLY: pp.PullProcessor.handle = ph
o_eh = pp.PullProcessor.execute_held
def eh(self, h):
    t = tn(); o_eh(self, h); held.append((h.opaque, h.header.queue_id, h.header.queue_offset, h.suspended_at, t, tn()))
if not GCONLY: pp.PullProcessor.execute_held = eh
T.dump(os.environ["E2E_TRACE_OUT"])
# SIGTERM -> clean exit so atexit runs (the cli handles SIGTERM itself; make sure)
from tidemq.cli.main import main
sys.argv = ["tidemq"] + sys.argv[1:]
main()
