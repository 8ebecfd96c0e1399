

import os as _os

# The CLI's processes (broker, dev, benchmarks) never call BLAS, yet numpy's OpenBLAS starts a
# worker thread per core at import that spins ~100 ms of CPU: on a 2-core machine that is a
# core's worth of start-up time taken from the broker. Users' own settings win.
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
