"""Layer selection in Hugging Face's `output_hidden_states` convention.

Index 0 is the embedding output, i the output of decoder block i, and N (the number of blocks) the
entry after the final norm, so a model with N blocks has N + 1 selectable layers.
"""

from __future__ import annotations

from layertap.errors import InputError


def resolve_layers(spec: str | int | list[int] | tuple[int, ...], num_layers: int) -> list[int]:
    """Turn "all", "0,4,-1", an int or a list into sorted, unique indices in 0..num_layers."""
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "all":
            return list(range(num_layers + 1))
        try:
            items = [int(part) for part in text.replace(" ", "").split(",") if part]
        except ValueError:
            raise InputError(f"layers: expected 'all' or a comma list of integers, got {spec!r}") from None
    elif isinstance(spec, int):
        items = [spec]
    else:
        items = [int(x) for x in spec]
    if not items:
        raise InputError("layers: no layer given")
    resolved = set()
    for index in items:
        actual = index + num_layers + 1 if index < 0 else index
        if not 0 <= actual <= num_layers:
            raise InputError(
                f"layers: index {index} is out of range for a model with {num_layers} layers "
                f"(valid: 0..{num_layers} or -{num_layers + 1}..-1)"
            )
        resolved.add(actual)
    return sorted(resolved)
