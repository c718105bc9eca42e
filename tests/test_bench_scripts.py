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


def starts_localspec(name: str, text: str) -> bool:
    return bool((ARGV if name.endswith(".py") else SHELL).search(text))


def test_every_timing_script_starts_localspec_without_an_earlier_runs_cache():
    scripts = {p.name: p.read_text() for p in sorted(BENCH.glob("*")) if p.suffix in (".py", ".sh")}
    starters = {name: text for name, text in scripts.items() if starts_localspec(name, text)}
    assert set(starters) >= {"native_compare.sh", "serve_concurrency.sh", "serve_latency.py", "parallel_runs.py",
                             "repeated_work.py"}
    bare = [name for name, text in starters.items()
            if "LOCALSPEC_SUFFIX_CACHE" not in text and "LOCALSPEC_CACHE_DIR" not in text]
    assert not bare, f"these start localspec with the user's suffix cache: {bare}"
