# Two commands on a fresh machine: `make run` (set up and serve) and `make test` (the suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: install lint model migrate run test test-deps test-packages

$(INSTALLED): requirements.txt requirements-model.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-model.txt
	touch $@

# The page's marked, DOMPurify and highlight.js (its prebuilt browser script, and a light and a
# dark theme) come from npm at set-up time; static/vendor/ is git-ignored.
VENDOR := static/vendor/.installed
$(VENDOR): package.json package-lock.json
	@command -v npm >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm; } \
	  || { echo "The chat page needs Node.js and npm: sudo apt-get install nodejs npm" >&2; exit 1; }
	npm ci --no-audit --no-fund --loglevel=error
	mkdir -p static/vendor
	cp node_modules/marked/lib/marked.umd.js node_modules/dompurify/dist/purify.min.js static/vendor/
	cp node_modules/@highlightjs/cdn-assets/highlight.min.js static/vendor/
	cp node_modules/@highlightjs/cdn-assets/styles/github.min.css node_modules/@highlightjs/cdn-assets/styles/github-dark.min.css static/vendor/
	touch $@

install: $(INSTALLED) $(VENDOR)

# Converts the packaged model once, then measures its weight formats once on this machine
# (TOKSTREAM_WEIGHTS=auto reads the choice; `manage.py measure_weights --force` measures again).
model: install
	$(PY) manage.py prepare_model
	$(PY) manage.py measure_weights

migrate: install
	$(PY) manage.py migrate --noinput

run: model migrate
	$(PY) manage.py serve

# The relay tests' real upstream: llama.cpp's server, built once (tests/build_llama_server.sh)
# and kept outside the checkout, so a fresh clone on this machine reuses it.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_SERVER ?= $(HOME)/.cache/tokstream/llama-server-$(LLAMA_CPP_VERSION)/llama-server
export TOKSTREAM_LLAMA_SERVER := $(LLAMA_SERVER)
$(LLAMA_SERVER): | $(INSTALLED) test-packages
	tests/build_llama_server.sh $@ $(LLAMA_CPP_VERSION) $(PY)

# The tests start their own redis-server, and drive Debian's Chromium (Playwright cannot
# download a browser here); llama-server is built with cmake and g++.
TEST_PACKAGES := chromium redis-server cmake g++
test-deps: test-packages $(LLAMA_SERVER)

test-packages:
	@missing=$$(for p in $(TEST_PACKAGES); do command -v $$p >/dev/null || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "The tests need: sudo apt-get install $$missing" >&2; exit 1; fi; \
	fi

# Lint and format check (ruff, configured in pyproject.toml); CI runs it before the tests.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: model test-deps
	$(PY) -m pytest
