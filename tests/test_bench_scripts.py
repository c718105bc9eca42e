"""The timing scripts in benchmarks/ start each localspec process without the suffix cache that earlier runs left:
they send the same prompts every round, and a kept cache drafts a repeated answer whole, so a later round (or a `run`
after the server answered the same prompt) would time repeated work instead of a first request. The repeated-work
series measures that cache on purpose, in a cache dir of its own."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
# a localspec process that generates: an argv list `"-m", "localspec", "run"` (Python), or a shell line (not a
# comment) that runs `localspec run|serve`, `python -m localspec run|serve` or serve_concurrency.sh's configurable command
ARGV = re.compile(r'"-m", "localspec", "(run|serve)"')
SHELL = re.compile(r'^(?!\s*#).*(?:-m localspec|(?<![\w-])localspec|"\$\{LS\[@\]\}") (run|serve)\b', re.M)


def starts_localspec(p: Path) -> bool:
    return bool((ARGV if p.suffix == ".py" else SHELL).search(p.read_text()))


def test_every_timing_script_starts_localspec_without_an_earlier_runs_cache():
    starters = [p for p in sorted(BENCH.glob("*")) if p.suffix in (".py", ".sh") and starts_localspec(p)]
    assert {p.name for p in starters} >= {"native_compare.sh", "serve_concurrency.sh", "serve_latency.py",
                                          "parallel_runs.py", "repeated_work.py"}
    bare = [p.name for p in starters
            if "LOCALSPEC_SUFFIX_CACHE" not in p.read_text() and "LOCALSPEC_CACHE_DIR" not in p.read_text()]
    assert not bare, f"these start localspec with the user's suffix cache: {bare}"
