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

# Installs with test extras, then runs the whole test suite (CPU; GPU tests are skipped), then
# tests/megatron again against each supported megatron-core release other than the installed one
# (scripts/megatron_core.sh; MEGATRON_CORE_VERSIONS= turns that off). Both passes always run.
test: install-test
	rc=0; TRITON_INTERPRET=1 $(PYTHON) -m pytest -q tests || rc=$$?; \
	TRITON_INTERPRET=1 PYTHON=$(PYTHON) bash scripts/megatron_core.sh test || rc=1; exit $$rc
