from runner_fixtures import engines, model_dirs, references  # noqa: F401  (session fixtures)
