"""Live speculation statistics: tokens/s with a sparkline, acceptance, mean accepted length, acceptance per
draft position, time to first token, draft vs verify time, k in use and each model's memory."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import Sparkline, Static


def _bar(frac: float, width: int = 12) -> str:
    n = int(round(max(0.0, min(1.0, frac)) * width))
    return "█" * n + "░" * (width - n)


class StatsPanel(Vertical):
    def __init__(self, show_timings: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.show_timings = show_timings
        self.rates: list[float] = []
        self.memory: dict[str, int] = {}
        self.last = None

    def compose(self):
        yield Static("speed", classes="title")
        yield Static("", id="tps")
        spark = Sparkline([], id="spark")
        spark.display = False  # shown once there are rates to draw
        yield spark
        yield Static("", id="figures")
        yield Static("", id="positions")
        yield Static("", id="memory")

    def _t(self, v: float, fmt: str) -> str:
        return format(v, fmt) if self.show_timings else "--"

    def update_stats(self, stats, k: int | None = None) -> None:
        self.last = stats
        if stats.generation_s > 0 and self.show_timings:
            self.rates.append(stats.tokens_per_second)
            self.rates = self.rates[-60:]
            spark = self.query_one("#spark", Sparkline)
            spark.data = list(self.rates)
            spark.display = len(self.rates) > 1
        self.query_one("#tps", Static).update(Text(f"{self._t(stats.tokens_per_second, '.1f')} tok/s", style="bold"))
        used = ", ".join(f"{m} {n}" for m, n in stats.method_used.most_common()) or "-"
        ks = ", ".join(f"{a}:{b}" for a, b in sorted(stats.k_used.items())) or "-"
        lines = [
            f"acceptance   {stats.acceptance_rate:.0%} ({stats.accepted}/{stats.drafted})",
            f"mean accepted length {stats.mean_accepted_length:.2f}",
            f"ttft         {self._t(stats.ttft_s, '.2f')} s",
            f"draft        {self._t(stats.draft_s, '.2f')} s",
            f"verify       {self._t(stats.verify_s, '.2f')} s",
            f"k in use     {ks}" + (f" (cap {stats.k_cap})" if stats.k_cap else ""),
            f"steps        {used}",
        ]
        if stats.reason:
            lines.append(stats.reason)
        self.query_one("#figures", Static).update("\n".join(lines))
        pos = ["acceptance by draft position"] + [
            f" {i + 1:>2} {_bar(a)} {a:.0%}" for i, a in enumerate(stats.acceptance_by_position[:8])
        ]
        self.query_one("#positions", Static).update("\n".join(pos))

    def set_memory(self, memory: dict[str, int]) -> None:
        self.memory = memory
        self.query_one("#memory", Static).update(
            "memory\n" + "\n".join(f" {name}: {b / 2**20:,.0f} MiB" for name, b in memory.items())
        )
