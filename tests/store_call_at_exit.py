"""A script whose loader heartbeat is inside a store call while the interpreter
finalizes (tests/test_store_threads_at_exit.py): the store's host stalls for 1 s
just before the script ends, and finalization takes 2 s (as torch's does, with
DataLoader workers to shut down), so the call returns during finalization.
Prints the host's pid first. Usage: store_call_at_exit.py PORT"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

from torch._C._distributed_c10d import TCPStore

from odb_core.torch.transport import PeerBoard

port = int(sys.argv[1])
serve = (
    "import time\nfrom torch._C._distributed_c10d import TCPStore\n"
    f"s = TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False)\n"
    "print('up', flush=True)\ntime.sleep(120)\n"
)
# the host and the waker must not hold this script's stderr open: the test reads it to EOF
host = subprocess.Popen(
    [sys.executable, "-c", serve], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
)
print(host.pid, flush=True)
assert host.stdout is not None and host.stdout.readline().strip() == b"up"
store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
os.kill(host.pid, signal.SIGSTOP)
subprocess.Popen(
    ["sh", "-c", f"sleep 1; kill -CONT {host.pid}"],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)
board = PeerBoard(store, 1, 0, 2, 30.0)
board.start_watch()  # its first beat waits on the stalled store
time.sleep(0.2)


class SlowTeardown:
    def __del__(self) -> None:
        time.sleep(2)


keep = SlowTeardown()  # freed in finalization, after the interpreter stops other threads
