"""A run is prepared once: the model folder read and fingerprinted, layers and truncation resolved against it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from layertap.batch import Part, PartFile
from layertap.errors import InputError
from layertap.model.fingerprint import fingerprint_model
from layertap.prepared_run import prepare_run
from layertap.settings import load_settings
from layertap.store.extraction_key import ExtractionKey
from layertap.store.normalise import NormaliseRules


def test_prepare_resolves_layers_truncation_and_key_once(tiny_model, monkeypatch):
    import layertap.prepared_run as prepared
    import layertap.model.truncation as truncation

    reads = []
    real_check = prepared.check_model_folder
    monkeypatch.setattr(prepared, "check_model_folder", lambda *a: reads.append(a) or real_check(*a))
    monkeypatch.setattr(truncation, "read_model_info", lambda *_: pytest.fail("config.json read again"))
    settings = load_settings(env_file=None, model=tiny_model, layers="-1, 0,-1", truncate=True, pooling="mean")
    run = prepare_run(settings)
    assert len(reads) == 1
    assert run.layers == [0, run.model.num_layers]
    assert run.truncate_to == run.model.max_position_embeddings and run.truncate_to
    expected = ExtractionKey(fingerprint_model(tiny_model), run.settings.model, "mean", "float32",
                             NormaliseRules().rules_id, run.model.hidden_size, run.model.num_layers,
                             run.truncate_to)
    assert run.key == expected and run.extraction_id == expected.extraction_id
    assert run.engine_options().model == run.settings.model


def test_a_layer_the_model_lacks_fails_at_preparation(tiny_model):
    with pytest.raises(InputError, match="out of range"):
        prepare_run(load_settings(env_file=None, model=tiny_model, layers="0,99"))


def test_a_part_cached_as_a_dict_reads_as_a_part():
    part = Part("b", "e", "p", [PartFile("p-0", "parts/e/p-0.parquet", ["h1"])], [0, 1], 1, ["h1"])
    assert Part.from_result(json.loads(json.dumps({**part.__dict__, "files": [f.__dict__ for f in part.files]}))) == part
    single = {"batch_id": "b", "extraction_id": "e", "part_id": "p", "relpath": "parts/e/p.parquet", "layers": [0],
              "num_prompts": 1, "rejected": {}, "seconds": 0.5, "num_tokens": 3}
    old = Part.from_result(single)
    assert old.files == [PartFile("p", "parts/e/p.parquet", None)] and old.prompt_hashes is None
    assert Part.from_result(dict(single, relpath=None)).files == []
    assert Part.from_result(replace(part, engine="0@h:1")).engine == "0@h:1"
