"""How the engine core is started: forked from a single-threaded process, spawned from a threaded one, the
user's choice kept; a file kept out of forked children really leaves them. Each case runs in a freshly
spawned process, as a runner process is: its thread count, environment and fork handlers are its own."""

from __future__ import annotations

import multiprocessing
import os
import select
import threading
import time

import pytest

from layertap.runner.engine_core_start import START_METHOD, choose_engine_core_start, keep_out_of_forked_children


def in_fresh_process(target, *args):
    """Run `target(*args)` in a spawned process; return what it returned."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_answer, args=(sender, target, args))
    child.start()
    sender.close()
    try:
        assert receiver.poll(60), "the process did not answer"
        ok, value = receiver.recv()
    finally:
        child.join(10)
    assert ok, value
    return value


def _answer(sender, target, args) -> None:
    try:
        sender.send((True, target(*args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        sender.send((False, repr(exc)))


def _choices(user_setting: str | None) -> tuple[str, str, str | None]:
    if user_setting is None:
        os.environ.pop(START_METHOD, None)
    else:
        os.environ[START_METHOD] = user_setting
    alone = choose_engine_core_start()
    release = threading.Event()
    helper = threading.Thread(target=release.wait)
    helper.start()
    try:
        with_a_thread = choose_engine_core_start()
    finally:
        release.set()
        helper.join()
    return alone, with_a_thread, os.environ.get(START_METHOD)


def _single_threaded() -> bool:
    return threading.active_count() == 1


def test_fork_while_the_process_runs_one_thread_spawn_beside_others():
    assert in_fresh_process(_single_threaded)
    assert in_fresh_process(_choices, None) == ("fork", "spawn", "spawn")


def test_the_user_s_own_setting_is_kept():
    assert in_fresh_process(_choices, "spawn") == ("spawn", "spawn", "spawn")
    assert in_fresh_process(_choices, "forkserver") == ("forkserver", "forkserver", "forkserver")


def _caller_sees_the_end_of_its_pipe(keep_out: bool) -> bool:
    """A child forked from this process outlives it holding (or not) its end of a pipe: does the reader on
    the other end see the pipe close when this end is closed here?"""
    reader, writer = os.pipe()
    if keep_out:
        keep_out_of_forked_children(writer)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    try:
        os.close(writer)
        readable, _, _ = select.select([reader], [], [], 5.0)
        return bool(readable) and os.read(reader, 1) == b""
    finally:
        child.kill()
        child.join()
        os.close(reader)


@pytest.mark.parametrize("keep_out", [True, False])
def test_a_forked_child_does_not_hold_a_file_kept_out_of_it(keep_out):
    """Kept out, the pipe closes with this process's end; otherwise the child holds it open (the control)."""
    assert in_fresh_process(_caller_sees_the_end_of_its_pipe, keep_out) is keep_out
