# The two set-up commands (README): `make run` and `make test`. Everything else is a helper for them.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
MODELS ?= models
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test test-fast lint venv export serve bench clean

$(BIN)/mha-serving: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[cpu,export,test]"
	touch $(BIN)/mha-serving

venv: $(BIN)/mha-serving

## run: export the default head configurations and train the first decoder (if missing), serve them on an embedded local Ray
run: venv
	$(BIN)/mha-serving up --models $(MODELS) --host $(HOST) --port $(PORT)

## test: lint, then the whole test suite (real Ray Serve on 127.0.0.1; GPU tests skip without a GPU) in two lanes
## (tests/conftest.py): every test of a Ray, one after another, beside the other files
test: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder

## test-fast: the inner loop: the tests not marked `slow` or `serve` (no Ray Serve, no lint), under 3 min on 2 cores
test-fast: venv
	$(BIN)/python -m pytest -m "not slow and not serve"

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

export: venv
	$(BIN)/mha-serving export --out $(MODELS)

serve: venv
	$(BIN)/mha-serving serve --models $(MODELS) --host $(HOST) --port $(PORT)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
