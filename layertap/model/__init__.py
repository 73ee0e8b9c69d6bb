"""The model folder: its fingerprint and shape (`fingerprint`), layer selection (`layers`), how long prompts
may be (`truncation`), and the tiny model tests and the demo run on (`tiny_model`)."""
