VENV := .venv
PY := $(VENV)/bin/python
CLI := $(VENV)/bin/slime-moe-rollout

# Extra reviewed SGLang variants (tests/test_version_matrix.py), each in .venvs/sglang-<variant>.
# The slime variant needs a slime checkout: make test SLIME_SRC=/path/to/slime
MATRIX_ENVS := 0.5.15.post1 $(if $(SLIME_SRC),0.5.15.post1+slime)

.PHONY: venv envs demo test test-e2e bench clean

venv:
	@bash scripts/setup_venv.sh

envs: venv
	@for v in $(MATRIX_ENVS); do SLIME_SRC="$(SLIME_SRC)" bash scripts/setup_sglang_env.sh $$v || exit 1; done

# The main job on its embedded default: fix status, then 2 real SGLang CPU engines stream a rollout.
demo: venv
	$(CLI) patches status
	$(CLI) run --config training_configs/tiny-cpu.yaml --output rollouts.jsonl

# The test suite (CPU). The heaviest engine configurations run in `make test-e2e`.
test: venv envs
	SLIME_MOE_ROLLOUT_MATRIX="$(MATRIX_ENVS)" $(PY) -m pytest -m "not e2e" -q -p no:cacheprovider

test-e2e: venv
	$(PY) -m pytest -m "e2e" -q -p no:cacheprovider

bench: venv
	for b in benchmarks/[!_]*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .venvs
