# One-command entry points that set themselves up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
EXTRAS ?= dev

.PHONY: install train test clean

$(BIN)/gpurl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

install: $(BIN)/gpurl

# The main job. ARGS takes Hydra overrides: make train ARGS="train.steps=10"
train: install
	$(BIN)/gpurl train $(ARGS)

# The full test suite (CPU; several forced host devices per test process).
test: install
	$(BIN)/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV) runs outputs multirun
