VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test lint demo bench
setup:
	python3 -m venv $(VENV) && $(VENV)/bin/pip install -q -r requirements-dev.txt
test:
	$(PY) -m pytest -q
lint:
	$(VENV)/bin/ruff check src tests
demo:
	$(VENV)/bin/quicksave demo
bench:
	$(VENV)/bin/quicksave bench --size-mib 1024
