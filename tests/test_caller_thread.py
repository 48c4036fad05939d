"""The serve loop's executor: work submitted from other threads runs, in order, on the thread that calls `work`."""

import threading

import pytest

from bitquilt.serve.caller_thread import CallerThreadExecutor


def test_work_runs_on_the_calling_thread_in_order_and_errors_reach_the_submitter():
    steps = CallerThreadExecutor()
    ran: list[tuple[int, threading.Thread]] = []
    futures = []

    def submit_from_elsewhere():
        futures.extend(steps.submit(lambda i=i: ran.append((i, threading.current_thread())) or i * i)
                       for i in range(5))
        futures.append(steps.submit(lambda: 1 / 0))

    t = threading.Thread(target=submit_from_elsewhere)
    t.start()
    t.join()
    steps.work(until=lambda: all(f.done() for f in futures))
    assert [i for i, _ in ran] == list(range(5))
    assert all(thread is threading.current_thread() for _, thread in ran)
    assert [f.result() for f in futures[:5]] == [0, 1, 4, 9, 16]
    with pytest.raises(ZeroDivisionError):
        futures[5].result()


def test_shutdown_cancels_what_waits_and_refuses_new_work():
    steps = CallerThreadExecutor()
    waiting = steps.submit(lambda: "never")
    steps.shutdown(wait=False, cancel_futures=True)
    assert waiting.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        steps.submit(lambda: None)
    steps.work(until=lambda: True)  # returns at once: nothing is left to run
