"""The process's engine registry: which engine a failed batch may discard."""

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
