VENV := .venv
PY := $(VENV)/bin/python
CLI := $(VENV)/bin/slime-moe-rollout

.PHONY: venv demo test test-e2e bench clean

venv:
	@VENV=$(VENV) bash scripts/setup_venv.sh

# The main job on its embedded default: fix status, then 2 real SGLang CPU engines stream a rollout.
demo: venv
	$(CLI) patches status
	$(CLI) run --config training_configs/tiny-cpu.yaml --output rollouts.jsonl

# The test suite (CPU). The heaviest engine configurations run in `make test-e2e`.
test: venv
	$(PY) -m pytest -m "not e2e" -q -p no:cacheprovider

test-e2e: venv
	$(PY) -m pytest -m "e2e" -q -p no:cacheprovider

bench: venv
	for b in benchmarks/[!_]*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV)
