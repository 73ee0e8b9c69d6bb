"""The process's engine registry: which engine a failed batch may discard, and what a run settles before its
engine starts."""

from layertap.runner import engine_cache
from layertap.settings import Settings


class _Engine:
    """Stands in for a runner: the registry only asks whether it answers, and closes it."""

    def __init__(self, answers: bool):
        self.answers, self.closed = answers, False

    def healthy(self) -> bool:
        return self.answers

    def close(self) -> None:
        self.closed = True


def _settings(tmp_path) -> Settings:
    return Settings(model=str(tmp_path))


def test_a_dead_engine_is_discarded(tmp_path, monkeypatch):
    settings, dead = _settings(tmp_path), _Engine(answers=False)
    key = engine_cache.runner_key(settings)
    monkeypatch.setitem(engine_cache._runners, key, dead)
    assert engine_cache.discard_if_dead(settings, dead)
    assert key not in engine_cache._runners and dead.closed


def test_an_engine_that_answers_is_kept(tmp_path, monkeypatch):
    settings, alive = _settings(tmp_path), _Engine(answers=True)
    key = engine_cache.runner_key(settings)
    monkeypatch.setitem(engine_cache._runners, key, alive)
    assert not engine_cache.discard_if_dead(settings, alive)
    assert engine_cache._runners[key] is alive and not alive.closed


def test_a_batch_that_saw_an_engine_die_keeps_the_replacement_another_batch_started(tmp_path, monkeypatch):
    settings, dead, fresh = _settings(tmp_path), _Engine(answers=False), _Engine(answers=True)
    key = engine_cache.runner_key(settings)
    monkeypatch.setitem(engine_cache._runners, key, fresh)  # another batch already replaced the dead engine
    engine_cache.discard_if_dead(settings, dead)
    assert engine_cache._runners[key] is fresh and not fresh.closed
    assert dead.closed


# A handler that, like Prefect's API log handler, takes logging's module lock (getLogger) while it holds its
# own; one thread logs through it without pause while the engine starts on another, as tasks do in a run.
_ENGINE_BESIDE_A_LOGGING_THREAD = """
import logging, sys, threading, time
from layertap.runner import engine_cache
from layertap.settings import Settings

class LikePrefects(logging.Handler):
    def emit(self, record):
        time.sleep(0.002)
        logging.getLogger("like-prefects")

busy = logging.getLogger("a-task")
busy.addHandler(LikePrefects())
busy.propagate = False
settings = Settings(model=sys.argv[1], enforce_eager=True, runner_process=False)
starting = engine_cache.start_early(settings)
threading.Thread(target=lambda: [busy.warning("tick") for _ in iter(int, 1)], daemon=True).start()
starting.join(240)
print("engine up" if engine_cache.open_runners() == 1 else "engine still starting")
engine_cache.close_runners(force=True)
"""


def test_an_engine_started_early_comes_up_beside_a_thread_that_then_logs(tiny_model, fresh_python):
    """vLLM configures logging as its engine starts (module lock, then each handler's); `start_early` settles
    it on the calling thread first, so the engine's start no longer meets a handler holding its own lock and
    wanting the module's."""
    script = _ENGINE_BESIDE_A_LOGGING_THREAD.replace("sys.argv[1]", repr(tiny_model))
    assert fresh_python(script, timeout=120).strip().endswith("engine up")
