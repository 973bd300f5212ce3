# kvlab — two commands do everything on a fresh machine: `make test` and `make book`.
PYTHON_SYSTEM ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch is pinned and installed first, so that kvlab's own range
# requirement (torch>=2.3) never pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
NB_SOURCES := $(sort $(wildcard notebooks/[0-9][0-9]-*.md))
NB_TIMEOUT ?= 120

.PHONY: venv test lint unit nbval book lab notebooks notebook bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON_SYSTEM) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[book,dev]"
	touch $@

lint: venv
	$(VENV)/bin/ruff check .

unit: venv
	$(PY) -m pytest -n 2 tests

nbval: venv
	$(PY) -m pytest -p no:randomly --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=$(NB_TIMEOUT) notebooks/

test: lint unit nbval

# Re-generate every .ipynb from its .md source and execute it (outputs are committed).
notebooks: venv
	@for nb in $(NB_SOURCES); do $(MAKE) --no-print-directory notebook NB=$$nb || exit 1; done

# One chapter: make notebook NB=notebooks/03-refcounts-cow.md
notebook: venv
	$(PY) tools/execute_notebook.py --timeout $(NB_TIMEOUT) $(NB)

book: venv
	$(VENV)/bin/jupyter-book build . --config book.yml --toc toc.yml -W -n --keep-going
	@echo "The book: $(CURDIR)/_build/html/index.html"

lab: venv
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root,)

bench: venv
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf _build .pytest_cache
