PY ?= .venv/bin/python
.PHONY: setup test test-slow lint bench serve env-table
setup:
	bash scripts/setup.sh
test:
	bash scripts/test.sh
test-slow:
	bash scripts/test.sh -m slow
lint:
	$(PY) -m ruff check tiered_kv engine bench tests examples scripts
	$(PY) -m mypy tiered_kv engine bench examples scripts tests
bench:
	.venv/bin/tiered-kv bench
serve:
	.venv/bin/tiered-kv serve
env-table:
	$(PY) scripts/env_table.py --write
