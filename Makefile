# sixfold: make install | demo | serve | test | bench | perf-analyzer   (everything lives in .venv)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
MODEL  ?= rm2
MAX_ROWS ?= 50000
CARDS  ?= 6
# The host's spec for the plan, the same for demo and serve: auto is this machine, calibrated once
# (about 10 s, on first use) and cached; host-cpu is the generic one.
HOST_SPEC ?= auto

.PHONY: install demo serve test bench clean mlserver-venv triton-venv perf-analyzer

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first: any other torch spec pulls gigabytes of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: install
	$(PY) scripts/demo.py --model $(MODEL) --max-rows $(MAX_ROWS) --cards $(CARDS) --host-spec $(HOST_SPEC)

# make serve's ports (sixfold-serve's defaults; 0 picks a free one, printed at start; -1 turns REST
# or metrics off) and any other sixfold-serve flags, e.g.
#   make serve HTTP_PORT=9000 GRPC_PORT=9001 SERVE_ARGS="--workers 2 --log-format json"
# (SERVE_ARGS, not ARGS: ARGS is perf-analyzer's.)
HTTP_PORT    ?= 8000
GRPC_PORT    ?= 8001
METRICS_PORT ?= 8002
SERVE_ARGS   ?=

serve: install
	$(VENV)/bin/sixfold-serve --model $(MODEL) --max-rows $(MAX_ROWS) --cards $(CARDS) --host-spec $(HOST_SPEC) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) bench/run_all.py

# Triton's perf_analyzer against a running server (make serve): scripts/perf_analyzer fetches the
# libraries it needs on first use; the queries are sixfold-loadgen's, exported once to PA_DATA.
PA_URL  ?= 127.0.0.1:8001
PA_DATA ?= runs/perf_analyzer/$(MODEL).json
ARGS    ?= -m $(MODEL) -i grpc -u $(PA_URL) --input-data $(PA_DATA) --concurrency-range 1:4 \
           --measurement-interval 3000

perf-analyzer: install
	@test -f $(PA_DATA) || $(VENV)/bin/sixfold-loadgen --url $(PA_URL) --model $(MODEL) --pool 16 \
		--export-perf-analyzer $(PA_DATA)
	scripts/perf_analyzer $(ARGS)

# Seldon MLServer 1.7 serving the same torch model: the non-sixfold KServe v2 peer (benchmarks only).
mlserver-venv: .venv-mlserver/.stamp

.venv-mlserver/.stamp:
	$(PYTHON) -m venv .venv-mlserver
	.venv-mlserver/bin/pip install -q torch==2.13.0
	.venv-mlserver/bin/pip install -q "mlserver==1.7.*" numpy
	touch $@

# NVIDIA Triton 2.51 (the tritonserver inside the nvidia-pytriton 0.7.0 wheel, Python backend only) serving the
# same torch model (benchmarks only). Its Python-backend stub runs only from a venv of the distribution's own
# python3.11 (a pyenv build fails inside the stub), hence TRITON_PYTHON.
TRITON_PYTHON ?= /usr/bin/python3.11
triton-venv: .venv-triton/.stamp

.venv-triton/.stamp:
	@test -x $(TRITON_PYTHON) || { echo "make triton-venv: $(TRITON_PYTHON) not found (the distribution's python3.11 package; set TRITON_PYTHON=...)"; exit 2; }
	$(TRITON_PYTHON) -m venv .venv-triton
	.venv-triton/bin/pip install -q --upgrade pip
	.venv-triton/bin/pip install -q torch==2.13.0
	.venv-triton/bin/pip install -q nvidia-pytriton==0.7.0 numpy
	touch $@

clean:
	rm -rf $(VENV) .venv-mlserver .venv-triton build *.egg-info runs
