"""Prefect flows composing the tasks, deployment entrypoints, and the `layertap` command line (`flows.cli`).

The flows are imported on first use, so the command line starts without loading Prefect.
"""

__all__ = ["embed_flow"]


def __getattr__(name: str):
    if name == "embed_flow":
        from flows.embed import embed_flow

        return embed_flow
    raise AttributeError(f"module 'flows' has no attribute {name!r}")
