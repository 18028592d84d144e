"""A finished worker leaves without Python's module teardown (training/stop.py), yet its exit
handlers run, its output is flushed, and a non-daemon thread still at work is waited for."""

import subprocess
import sys
import time

CODE = """
import atexit, sys, threading, time
from megatron_multilora.training.stop import exit_without_teardown
atexit.register(lambda: print("handler ran", end=""))
print("unflushed,", end="")
if sys.argv[1] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread done,", end=""))).start()
exit_without_teardown()
print("never")
"""


def run(mode: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CODE, mode], capture_output=True, text=True, timeout=120
    )
    return done, time.perf_counter() - start


def test_exit_runs_the_handlers_flushes_and_waits_for_working_threads():
    done, _ = run("plain")
    assert (done.returncode, done.stdout) == (0, "unflushed,handler ran"), done.stderr
    done, seconds = run("thread")
    assert (done.returncode, done.stdout) == (0, "unflushed,thread done,handler ran"), done.stderr
    assert seconds >= 0.5
