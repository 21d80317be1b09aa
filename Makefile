# sixfold: make install | demo | serve | test | bench   (everything lives in .venv)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
MODEL  ?= rm2
MAX_ROWS ?= 50000
CARDS  ?= 6

.PHONY: install demo serve test bench clean mlserver-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first: any other torch spec pulls gigabytes of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: install
	$(PY) scripts/demo.py --model $(MODEL) --max-rows $(MAX_ROWS) --cards $(CARDS)

serve: install
	$(VENV)/bin/sixfold-serve --model $(MODEL) --max-rows $(MAX_ROWS) --cards $(CARDS)

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) bench/run_all.py

# Seldon MLServer 1.7 serving the same torch model: the non-sixfold KServe v2 peer (benchmarks only).
mlserver-venv: .venv-mlserver/.stamp

.venv-mlserver/.stamp:
	$(PYTHON) -m venv .venv-mlserver
	.venv-mlserver/bin/pip install -q torch==2.13.0
	.venv-mlserver/bin/pip install -q "mlserver==1.7.*" numpy
	touch $@

clean:
	rm -rf $(VENV) .venv-mlserver build *.egg-info runs
