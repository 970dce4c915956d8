PYTHON ?= python3
CONFIG ?= configs/tiny.yaml
# pytest-xdist workers for `make test`: 2 fits the 2-core CI machines (the suite takes ~12-14 min there
# with the second megatron-core pass); PYTEST_WORKERS=0 runs it in one process
PYTEST_WORKERS ?= 2

.PHONY: install install-test run test docs

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
	rc=0; TRITON_INTERPRET=1 $(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) tests || rc=$$?; \
	TRITON_INTERPRET=1 PYTHON=$(PYTHON) bash scripts/megatron_core.sh test -n $(PYTEST_WORKERS) || rc=1; exit $$rc

# Regenerates docs/config.md from the config schema (tests/test_docs.py fails while it is stale).
docs:
	$(PYTHON) -m moe_rl.config_doc
