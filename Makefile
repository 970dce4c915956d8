PYTHON ?= python3
CONFIG ?= configs/tiny.yaml

.PHONY: install install-test run test

install:
	bash scripts/install.sh

install-test:
	bash scripts/install.sh test

# Installs, then runs the main job (asynchronous GRPO on the tiny CPU config).
run: install
	moe-rl train $(CONFIG)

# Installs with test extras, then runs the whole test suite (CPU; GPU tests are skipped).
test: install-test
	TRITON_INTERPRET=1 $(PYTHON) -m pytest -q tests
