from runner_fixtures import engines, model_dirs, references

__all__ = ["engines", "model_dirs", "references"]  # session fixtures, shared with pytest from here
