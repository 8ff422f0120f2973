#!/usr/bin/env bash
# Parity harness: slime's OWN generate_rollout and plugin mode's on the same real CPU engines, the returned
# samples compared field by field for six scenarios (scripts/check_parity.py says which and how).
#
#   scripts/check_parity.sh [--engine-env ENV] SLIME_SRC
#
# The engines, slime's Python (SLIME_PYTHON) and the engine lock are scripts/check_against_slime.sh's (its
# header says how to build slime's Python); this runs check_parity.py as its client. Exit 1 on a difference
# the harness cannot explain.
DRIVER=check_parity.py exec "$(dirname "$0")/check_against_slime.sh" "$@"
