VENV := .venv
PY := $(VENV)/bin/python
CLI := $(VENV)/bin/slime-moe-rollout

# Extra reviewed SGLang variants (tests/test_version_matrix.py), each in .venvs/sglang-<variant>.
# The slime variant needs a slime checkout: make test SLIME_SRC=/path/to/slime
MATRIX_ENVS := 0.5.15.post1 0.5.16 0.5.17 0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 $(if $(SLIME_SRC),0.5.15.post1+slime)

.PHONY: venv envs demo test test-e2e bench bench-quick image-check clean

venv:
	@VENV=$(VENV) bash scripts/setup_venv.sh

envs: venv
	@for v in $(MATRIX_ENVS); do SLIME_SRC="$(SLIME_SRC)" bash scripts/setup_sglang_env.sh $$v || exit 1; done

# The main job on its embedded default: fix status, then 2 real SGLang CPU engines stream a rollout.
demo: venv
	$(CLI) patches status
	$(CLI) run --config training_configs/tiny-cpu.yaml --output rollouts.jsonl --overwrite

# The test suite (CPU). The heaviest engine configurations run in `make test-e2e`.
test: venv envs
	SLIME_MOE_ROLLOUT_MATRIX="$(MATRIX_ENVS)" $(PY) -m pytest -m "not e2e" -q -p no:cacheprovider --durations=20
	$(MAKE) --no-print-directory bench-quick

test-e2e: venv
	$(PY) -m pytest -m "e2e" -q -p no:cacheprovider

# Every benchmark, judged against benchmarks/targets.toml: exits non-zero on a MISS.
bench: venv
	$(PY) benchmarks/run_all.py

# The small no-engine subset (part of `make test`): every one must run and print its judged lines;
# a MISS is reported, not failed (timing on a shared machine is no test).
bench-quick: venv
	$(PY) benchmarks/run_all.py --quick

# docker/Dockerfile built for real with buildah on local bases that mirror slime's image, judged line by
# line (docker/image_check.sh; root, a Debian mirror and PyPI). Not part of `make test`.
image-check:
	@SLIME_SRC="$(SLIME_SRC)" bash docker/image_check.sh

clean:
	rm -rf $(VENV) .venvs
