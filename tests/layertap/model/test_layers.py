"""Layer selection follows Hugging Face's output_hidden_states indices."""

import pytest

from layertap.errors import InputError
from layertap.model.layers import resolve_layers


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("all", [0, 1, 2, 3, 4]), ("0,4,-1", [0, 4]), ("-5", [0]), (" 2, 1 ", [1, 2]), (3, [3]), ([-2, 0], [0, 3])],
)
def test_resolves_against_a_four_layer_model(spec, expected):
    assert resolve_layers(spec, num_layers=4) == expected


@pytest.mark.parametrize("spec", ["5", "-6", "x", "", [7]])
def test_out_of_range_or_malformed_is_a_clear_error(spec):
    with pytest.raises(InputError, match="layers"):
        resolve_layers(spec, num_layers=4)
