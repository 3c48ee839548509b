"""The worker process's entry point: ``python -m solosave._worker_entry <fd>``.

Started only by :class:`solosave._worker.ProcessTransport`; ``fd`` is its end of the duplex
pipe to the trainer. A module of its own, so that ``-m`` does not execute a module that the
package has already imported.
"""

import sys
from multiprocessing.connection import Connection

from solosave._worker import _worker_main

if __name__ == "__main__":
    _worker_main(Connection(int(sys.argv[1])))
