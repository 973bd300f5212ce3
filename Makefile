# kvlab — two commands do everything on a fresh machine: `make test` and `make book`.
PYTHON_SYSTEM ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch is pinned and installed first, so that kvlab's own range
# requirement (torch>=2.3) never pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
NB_SOURCES := $(sort $(wildcard notebooks/[0-9][0-9]-*.md))
NB_TIMEOUT ?= 300

.PHONY: venv test lint unit nbval book lab notebooks notebook bench clean site-check lab-check \
	browser student toolchain course book-student seal pdf

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON_SYSTEM) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[book,dev,site]"
	touch $@

lint: venv
	$(VENV)/bin/ruff check .

unit: venv toolchain
	$(PY) -m pytest -n 2 tests

nbval: venv toolchain
	$(PY) -m pytest -p no:randomly --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=$(NB_TIMEOUT) notebooks/

test: lint unit nbval pdf site-check

# Re-generate every .ipynb from its .md source and execute it (outputs are committed).
notebooks: venv
	@for nb in $(NB_SOURCES); do $(MAKE) --no-print-directory notebook NB=$$nb || exit 1; done

# One chapter: make notebook NB=notebooks/03-refcounts-cow.md
notebook: venv
	$(PY) tools/execute_notebook.py --timeout $(NB_TIMEOUT) $(NB)
	$(PY) tools/inline_values.py $(NB)

book: venv
	$(VENV)/bin/jupyter-book build . --config book.yml --toc docs/toc.yml -W -n --keep-going
	@echo "The book: $(CURDIR)/_build/html/index.html"

# The whole book as one PDF, offline: _build/pdf/kvlab.pdf (tools/book_pdf.py). Jupyter Book's
# single-page build, printed by headless Chromium (MathJax and every figure come from the build)
# and checked (every page of the table of contents bookmarked, its title on the page the
# bookmark opens, figures present); then the site is built again with the PDF copied in and
# linked from its navigation (docs/_ext/kvlab_pdf.py). About 6-8 minutes on 2 busy cores.
pdf: venv browser
	$(VENV)/bin/jupyter-book build . --config book.yml --toc docs/toc.yml --builder singlehtml \
		-W -n --keep-going
	$(PY) tools/book_pdf.py _build/singlehtml --out _build/pdf/kvlab.pdf
	@$(MAKE) --no-print-directory book
	@echo "The book as a PDF: $(CURDIR)/_build/pdf/kvlab.pdf (on the site: _build/html/kvlab.pdf)"

# JupyterLab with the book's settings (.jupyter/lab/settings/overrides.json: chapters' .md
# sources open as notebooks; Lab does not rewrite the stored widget state, so a chapter opens
# unmodified and saves unchanged) and MyST rendered by jupyterlab-myst. The committed notebooks
# are trusted first, so their widgets and kernel-free twins render; kernels export the twins
# (KVLAB_KERNEL_FREE=1), so a chapter run and saved in Lab keeps what the site shows. The server
# reads .jupyter/jupyter_server_config.py (a chapter opens unmodified under any Python version),
# which loads the book's Lab extension (.jupyter/labextensions/kvlab-solutions: running a cell
# keeps an unopened solution collapsed, outputs included, and so does the save after it).
LAB_SETTINGS := $(CURDIR)/.jupyter/lab/settings
lab: venv
	$(VENV)/bin/jupyter trust notebooks/*.ipynb
	KVLAB_KERNEL_FREE=1 JUPYTER_CONFIG_PATH=$(CURDIR)/.jupyter $(VENV)/bin/jupyter lab notebooks/ \
		--LabApp.app_settings_dir=$(LAB_SETTINGS) $(if $(filter 0,$(shell id -u)),--allow-root,)

# A C++ compiler for the engine's CPU attention kernel (kvlab/kernels/cpu.py; Debian's g++
# is installed when missing and run as root). Without one the engine warns and uses its torch
# path, and the stored notebook outputs would gain that warning.
toolchain:
	@command -v c++ >/dev/null || \
	{ if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && apt-get install -y -q g++; \
	  else echo "note: no C++ compiler; kvlab's CPU attention kernel falls back to torch"; fi; }

# Headless Chromium for the browser checks (Debian; installed when missing and run as root).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	{ if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && apt-get install -y -q chromium chromium-driver; \
	  else echo "site-check needs chromium and chromium-driver (apt-get install)"; exit 1; fi; }

# The built site in a real browser at 1280 and 390 px: console errors, failed or external
# requests, unrendered math, broken images, boxes cut off sideways, wrapped code lines, figures
# or widget frames wider than the screen or with text under 9 px as displayed, figures without
# alt text, ☰ / contents buttons that open nothing, a contents drawer that a pick or Esc does
# not close, widget outputs without their kernel-free twin, visible nbval markers, duplicate
# figures, dead widgets; then the search page opened from disk (file://). It reports how many
# figures fit at each width and what a first visit to each page downloads (--weights: per page).
site-check: venv browser book
	$(PY) tools/site_check.py _build/html

# A chapter in JupyterLab started as `make lab` starts it (tools/lab_check.py): the .md opens as a
# notebook, MyST renders (admonitions, citations, no raw roles), numbers in prose show as numbers,
# the .md and the .ipynb open unmodified and save unchanged, solutions are collapsed and
# labelled, Run All + save keeps the widgets' twins and every solution collapsed with its
# outputs hidden (about 3 minutes on 2 busy cores).
lab-check: venv browser
	$(PY) tools/lab_check.py notebooks/04-prefix-reuse.md

# Every chapter without its solution cells, into student/ (git-ignored); text that holds only
# beside the solutions (cells tagged edition-book) is replaced by the student edition's.
student: venv
	$(PY) tools/student.py --out student

# The nbgrader course (tools/course.py): course/source/<chapter>/ instructor sources with solution
# markers, autograded test cells with points, hand-graded answers with their rubric in a task
# cell's mark scheme; course/answer-key.md; course/exchange/, the exchange nbgrader_config.py
# names. Then, in course/: generate, release, collect, autograde, feedback without a hub, as
# course/README.md gives them.
course: venv
	$(PY) tools/seal_answers.py --check
	$(PY) tools/course.py --out course

# The exercises' sealed answers (kvlab/exercises/sealed_answers.json), recomputed with the
# instructor edition (course/answers.py); run after a change to kvlab or to an exercise.
seal: venv
	$(PY) tools/seal_answers.py --write

# The site without solutions (for a term with open exercise sets): the book's sources with every
# solution cell removed and the student edition's text (tools/student.py --site), built as
# `make book` builds the book.
book-student: venv
	$(PY) tools/student.py --site _build/student-src
	$(VENV)/bin/jupyter-book build _build/student-src --config $(CURDIR)/_build/student-src/book.yml \
		--toc $(CURDIR)/_build/student-src/docs/toc.yml -W -n --keep-going
	@echo "The book without solutions: $(CURDIR)/_build/student-src/_build/html/index.html"

bench: venv
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf _build .pytest_cache student
