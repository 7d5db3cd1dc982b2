"""A SIGINT that the kernel hands to a thread other than the main one (any thread may take
a process-directed signal) must still interrupt the main thread's Handle.wait.

The loop thread sends SIGINT to itself (pthread_kill) while the main thread waits on a
sleep that runs on it; prints how long the interrupt took to raise, or "not interrupted".
"""

import asyncio
import signal
import threading
import time

from dsml.blocking_loop import LoopThread

loop = LoopThread()
handle = loop.start(asyncio.sleep(30), "a 30 s sleep")


def interrupt_from_the_loop_thread() -> None:
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)


time.sleep(0.2)  # the main thread below is in its wait by then, or soon after: either works
loop.loop.call_soon_threadsafe(interrupt_from_the_loop_thread)
started = time.monotonic()
try:
    handle.wait()
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - started:.3f} s", flush=True)
