"""The worker process's entry point: ``python -m solosave._src.worker.entry <fd> <trainer pid>``
(or ``--zygote <socket> <owner pid>``: a zygote that forks workers, ``worker/zygote.py``).

Started only by :class:`solosave._src.worker.host.ProcessTransport`; ``fd`` is its end of the duplex
pipe to the trainer. A module of its own, so that ``-m`` does not execute a module that the
package has already imported.
"""

import sys
from multiprocessing.connection import Connection

from solosave._src.worker.host import worker_main

if __name__ == "__main__":
    if sys.argv[1] == "--zygote":  # python -m ... --zygote SOCKET OWNER_PID (worker/zygote.py)
        from solosave._src.worker.zygote import serve

        serve(sys.argv[2], int(sys.argv[3]), worker_main)
    else:
        worker_main(Connection(int(sys.argv[1])), int(sys.argv[2]))
