# `make demo` and `make test` create .venv and install on first use; later runs reuse it.
PYTHON ?= python3
ARGS ?=
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast gpu-check bench install clean

$(STAMP): pyproject.toml scripts/install.sh
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	PYTHON=$(VPY) bash scripts/install.sh test
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)  # extra options: make demo ARGS="--trainer.strategy.init_args.qcomms fp8"
	$(VENV)/bin/lightning-recsys fit --config examples/configs/synthetic_dlrm.yaml $(ARGS)

test: $(STAMP)
	$(VPY) -m pytest tests -q --durations=20

test-fast: $(STAMP)
	$(VPY) -m pytest tests/unit -q

gpu-check: $(STAMP)  # results under OUT (default gpu-results/); see docs/architecture.md, "GPU check"
	PYTHON=$(VPY) bash scripts/gpu_check.sh $(or $(OUT),gpu-results)

bench: $(STAMP)  # about 11 min on 2 cores; the emulated cluster needs root and iproute2 (else it exits 2; make -k goes on)
	$(VPY) -m pip install -q --disable-pip-version-check -e ".[test,bench]"
	$(VPY) benchmarks/emulated_cluster.py
	$(VPY) benchmarks/cost_model.py
	$(VPY) benchmarks/overhead.py
	$(VPY) benchmarks/planner_balance.py

clean:
	rm -rf $(VENV) .pytest_cache lightning_logs
