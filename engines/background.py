"""Calls in the background, for server mode (engines/server.py's request lanes,
engines/staleness.py's draws ahead):

    in_background(fn, *args)   fn(*args) on a daemon thread -> a Future
    result_everywhere(future)  its result, or on every rank the exception it raised on any
"""
import threading
from concurrent.futures import Future

import torch.distributed as dist

from common import all_ranks_ok, ddp, world


def in_background(fn, *args):
    """fn(*args) on a daemon thread -> a Future holding its result, or its exception.

    .result() raises the exception again in the caller's thread. It is a daemon,
    not a ThreadPoolExecutor's worker. Those are joined at exit, so a run that
    stops for another reason would wait for the call in flight (up to the rollout
    server's timeout).
    """
    future = Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    name = f"in_background({getattr(fn, '__name__', fn)})"
    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def result_everywhere(future):
    """future.result(), with one verdict for all ranks.

    If it raised on any rank, every rank raises that exception (the first rank's).
    So none is left waiting in the next collective, and each says why. This is for
    a call each rank makes on its own (--async: each rank's request to the server).
    """
    result = None
    error = None
    try:
        result = future.result()
    except Exception as e:
        error = e

    if all_ranks_ok(error is None):
        return result

    # one process: no group to gather over
    if not ddp:
        raise error

    errors = [None] * world
    dist.all_gather_object(errors, error)
    raise next(e for e in errors if e is not None)
