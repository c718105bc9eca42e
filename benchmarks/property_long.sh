#!/usr/bin/env bash
# The exactness property test (tests/test_property.py) over many more random cases than CI runs: every drafter, an
# adversarial one and a random policy, warm and cold caches, N = 1 and 4, on the tiny fabricated models.
# Usage: benchmarks/property_long.sh [CASES] [SEEDS]   (default 100 cases per test, seeds 1..3)
# Prints pytest's summary per seed; a failure names the case's seed (LOCALSPEC_PROPERTY_SEED reruns it).
set -euo pipefail
cd "$(dirname "$0")/.."
cases=${1:-100}
seeds=${2:-3}
for seed in $(seq 1 "$seeds"); do
  echo "seed $seed, $cases cases per test"
  LOCALSPEC_PROPERTY_CASES=$cases LOCALSPEC_PROPERTY_SEED=$seed python -m pytest tests/test_property.py -q -p no:randomly
done
