# make quickstart  : stdlib corpus -> tokenizer -> dataset (cached), train a small GPT on 4 processes
#                    with tp=2 x sp=2, then sample text from the checkpoint; installs what training and the
#                    plots need (torch, megalysses[plot]) into .venv, with pip's progress shown
# make test        : the suite; .venv gets the test extra too (pytest, transformers, triton, ...)
# make venv        : .venv with everything the suite needs, as `make test` makes it
# make test-gpu    : the GPU tier (pytest -m gpu) with the machine's own python and CUDA torch
# make gpu-check   : a GPU window's one command (benchmarks/gpu_check.py, ~7 min): the GPU tier's fast subset,
#                    the three-way benchmark, the memory probes (allocated, reserved and used memory against
#                    the model, the trace and the plan's budget; a larger GPU capped at an H100's 79.6 GiB),
#                    a profile; results in GPU_CHECK_OUT
# make lint        : ruff (rules in pyproject.toml) on the Python code, hadolint on the Dockerfile,
#                    kubernetes-validate on examples/kubernetes/*.yaml
# make docs        : regenerate docs/CONFIG.md from the config schema (a test fails while it is out of date)
#
# Which torch. Installed only where the environment has none: TORCH (the requirement) from the default index,
# or from TORCH_INDEX. PyPI's Linux torch is the CUDA build (several GB); a CPU machine takes the CPU build with
#     make quickstart TORCH_INDEX=https://download.pytorch.org/whl/cpu
# A GPU machine keeps its own CUDA torch with SYSTEM_SITE_PACKAGES=1 (.venv sees the system's packages, torch
# among them) or VENV=/path/to/env (an existing environment, a conda one say, used as it is and added to).
PYTHON    ?= python3
VENV      ?= .venv
PY        := $(VENV)/bin/python
TORCH     ?= torch==2.13.0
TORCH_INDEX ?=
SYSTEM_SITE_PACKAGES ?= 0
NPROC     ?= 4
DATA      ?= data

.PHONY: venv test test-gpu gpu-check lint docs quickstart corpus clean

# training and plotting only; pip shows what it fetches and installs
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(if $(filter 1,$(SYSTEM_SITE_PACKAGES)),--system-site-packages )$(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) )"$(TORCH)"
	$(PY) -m pip install -e ".[plot]"
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install -e ".[test]"
	touch $@

venv: $(VENV)/.test

# TEST_WORKERS pytest processes share the tests out (pytest-xdist); each multi-process test starts its own ranks
# beside them, so more workers than cores only makes those wait: 2 suits a 2-core runner
TEST_WORKERS ?= 2
test: $(VENV)/.test
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 tests

# the GPU tier alone, with the CUDA machine's own python and torch (which has `pip install -e ".[test]"`):
# `make venv` would install the CPU torch
GPU_PYTHON ?= python3
test-gpu:
	OMP_NUM_THREADS=1 $(GPU_PYTHON) -m pytest -q -m gpu tests

# everything a GPU window measures, in GPU_CHECK_BUDGET seconds (cold compiles included), written into
# GPU_CHECK_OUT after every stage: copy its gpu_<gpu>.md and .json into benchmarks/results/ to record them
GPU_CHECK_OUT    ?= runs/gpu_check
GPU_CHECK_BUDGET ?= 420
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py --budget $(GPU_CHECK_BUDGET) --out-dir $(GPU_CHECK_OUT)

$(VENV)/.lint: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install -e ".[lint]"
	touch $@

docs: $(VENV)/.installed
	$(PY) tools/config_doc.py --output docs/CONFIG.md

# the Kubernetes manifests against the bundled schemas (no network) of the oldest release they need and
# of the newest kubernetes-validate knows; --strict refuses unknown fields. kustomization.yaml is kustomize's
# list of them, not a Kubernetes object (tests/faults/test_kubernetes.py checks what it renders)
K8S_MANIFESTS := $(filter-out %/kustomization.yaml,$(wildcard examples/kubernetes/*.yaml))
lint: $(VENV)/.lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/kubernetes-validate --strict --quiet -k 1.31.0 $(K8S_MANIFESTS)
	$(VENV)/bin/kubernetes-validate --strict --quiet $(K8S_MANIFESTS)

$(DATA)/stdlib.jsonl: | $(VENV)/.installed
	$(PY) tools/build_corpus.py --stdlib --output $@

$(DATA)/stdlib_tokenizer.model: $(DATA)/stdlib.jsonl
	$(PY) tools/train_tokenizer.py --input $< --model-prefix $(DATA)/stdlib_tokenizer --vocab-size 4096 --byte-fallback

$(DATA)/stdlib_text_document.idx: $(DATA)/stdlib.jsonl $(DATA)/stdlib_tokenizer.model
	$(PY) tools/preprocess_data.py --input $< --output-prefix $(DATA)/stdlib --json-keys text --append-eod \
		--workers 2 --tokenizer-type sentencepiece --tokenizer-model $(DATA)/stdlib_tokenizer.model

corpus: $(DATA)/stdlib_text_document.idx

quickstart: $(VENV)/.installed corpus
	rm -rf runs/quickstart
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) pretrain.py --config configs/quickstart.yaml
	$(PY) tools/plot_metrics.py runs/quickstart
	$(PY) tools/generate.py --run runs/quickstart --prompt "def " --max-new-tokens 120

clean:
	rm -rf $(VENV) runs
