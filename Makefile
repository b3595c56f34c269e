# One-command entry points that set themselves up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
EXTRAS ?= dev

.PHONY: install slurm train train-env test test-fast clean

$(BIN)/gpurl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

install: $(BIN)/gpurl

# Slurm for tests/test_slurm.py, which starts its own private single-node cluster. Installs
# the Debian packages only when a binary is missing and only as root with apt-get; the
# policy-rc.d (only if none exists, removed after) keeps the packages' system services from
# starting. Otherwise one line says the Slurm tests will skip.
SLURM_PACKAGES := munge slurmctld slurmd slurm-client
slurm:
	@missing=; for b in srun slurmctld slurmd munged; do \
	  PATH="$$PATH:/usr/sbin:/sbin" command -v $$b >/dev/null 2>&1 || missing="$$missing $$b"; done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "Installing Slurm for the Slurm tests (missing:$$missing): $(SLURM_PACKAGES)"; \
	  policy=/usr/sbin/policy-rc.d; \
	  if [ ! -e $$policy ]; then printf '#!/bin/sh\nexit 101\n' > $$policy && chmod +x $$policy \
	    && trap "rm -f $$policy" EXIT; fi; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $(SLURM_PACKAGES); } >/dev/null \
	    || echo "Installing $(SLURM_PACKAGES) failed; Slurm tests will be skipped."; \
	else echo "Slurm binaries missing:$$missing; not root with apt-get, so Slurm tests will be skipped."; fi

# The main job. ARGS takes Hydra overrides: make train ARGS="train.steps=10"
train: install
	$(BIN)/gpurl train $(ARGS)

# The multi-turn job: GRPO with a calculator tool on the real Gemma 3 270M (README).
train-env: install
	$(BIN)/gpurl train env=calculator train=turns $(ARGS)

# The full test suite (CPU; several forced host devices per test process). Its programs
# compile and run on one core at a time, so 2 pytest workers (pytest-xdist) use a 2-core
# machine; tests/conftest.py says which tests share a worker. WORKERS=0 runs in one process.
WORKERS ?= 2
XDIST = $(if $(filter 0,$(WORKERS)),,-n $(WORKERS))
test: install slurm
	$(BIN)/python -m pytest $(XDIST) $(ARGS)

# The unit tier: every test without a tier marker (pyproject.toml lists them), under 2 min.
FAST_TIER := not (multiprocess or slurm or realmodel or e2e or slow or gpu or index or cuda_lowering)
test-fast: install
	$(BIN)/python -m pytest $(XDIST) -m "$(FAST_TIER)" $(ARGS)

clean:
	rm -rf $(VENV) runs outputs multirun
