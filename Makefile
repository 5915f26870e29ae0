# make test        : create .venv if missing, install CPU torch + megalysses[test], run the suite
# make quickstart  : build the stdlib corpus + tokenizer + dataset, train a small GPT on 4 CPU processes
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
NPROC  ?= 4

.PHONY: venv test quickstart clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_CPU)"
	$(PY) -m pip install --quiet -e ".[test,plot]"
	touch $@

venv: $(VENV)/.installed

test: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs
