"""Live speculation figures in plain words (speed with a sparkline of the recent rate, drafts accepted, tokens per
step, first token, prompt reused, which kind of drafting ran), the expert figures behind F3 (drafted and accepted per
drafting source, acceptance per draft position, draft and verify time, mean accepted length, the k in use and its
cap, the controller's reason) and each model's memory. Names and sizes are never broken mid-word: a name too long for
the panel is cut with an ellipsis, a size keeps its unit."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Sparkline, Static

from localspec.core.report import rate_text, rollback_text
from localspec.tui.sources import source_kind

NBSP = "\u00a0"


def _bar(frac: float, width: int = 12) -> str:
    n = int(round(max(0.0, min(1.0, frac)) * width))
    return "█" * n + "░" * (width - n)


def method_text(stats) -> str:
    """The method asked for; under auto, with the drafter that produced most of the answer (auto → lookup)."""
    used = stats.main_method
    return f"{stats.method} → {used}" if stats.method == "auto" and used != "none" else stats.method


def mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:,.0f}{NBSP}MiB"  # a no-break space: the number never ends a line without its unit


def one_line(text: str, style: str = "") -> Text:
    """A line that is cut with an ellipsis rather than wrapped (so a word is never split)."""
    return Text(text, style=style, no_wrap=True, overflow="ellipsis")


class StatsPanel(Vertical):
    def __init__(self, show_timings: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.show_timings = show_timings
        self.expert = False
        self.rates: list[float] = []
        self.memory: dict[str, int] = {}
        self.last = None
        self.draft_kind: str | None = None  # the loaded engine's draft_kind (run --json's field)

    def compose(self):
        yield Static("speed", classes="title")
        yield Static("", id="tps")
        spark = Sparkline([], id="spark")
        spark.display = False  # shown once there are rates to draw
        yield spark
        yield Static("", id="figures")
        yield Static("", id="expert")
        yield Static("", id="memory")

    def on_mount(self) -> None:
        self.query_one("#expert").display = self.expert

    def _t(self, v: float, fmt: str) -> str:
        return format(v, fmt) if self.show_timings else "--"

    def set_expert(self, on: bool) -> None:
        self.expert = on
        self.query_one("#expert").display = on
        if self.last is not None:
            self.update_stats(self.last, sample=False)

    def update_stats(self, stats, sample: bool = True) -> None:
        """Show `stats`; `sample`: add the recent rate to the sparkline (the app calls this twice a second while
        an answer streams, and once at its end)."""
        self.last = stats
        if sample and self.show_timings:
            recent = stats.recent_rate()
            if recent is not None:
                self.rates.append(recent)
                self.rates = self.rates[-60:]
                spark = self.query_one("#spark", Sparkline)
                spark.data = list(self.rates)
                spark.display = len(self.rates) > 1
        rate = rate_text(stats.rate()) if self.show_timings else "--"
        self.query_one("#tps", Static).update(one_line(f"{rate} tokens/s", "bold"))
        if stats.drafted:
            accepted = f"{stats.acceptance_rate:.0%} ({stats.accepted} of {stats.drafted})"
        else:
            accepted = "— (nothing drafted)"
        per_step = f"{stats.tokens_per_pass:.2f}" if stats.target_passes else "—"
        lines = [
            f"drafts accepted  {accepted}",
            f"tokens per step  {per_step}",
            f"first token      {self._t(stats.ttft_s, '.2f')}{NBSP}s",
            f"tokens           {stats.completion_tokens}",
            f"prompt reused    {stats.cached_prompt_tokens} of {stats.prompt_tokens}",
            f"method           {method_text(stats)}",
            f"drafting         {self.kind_text(stats)}",
            "details: F3" + ("" if self.expert else " (show)"),
        ]
        self.query_one("#figures", Static).update(Text("\n".join(lines), no_wrap=True, overflow="ellipsis"))
        if self.expert:
            self.query_one("#expert", Static).update(self._expert(stats))

    def kind_text(self, stats) -> str:
        """Which kind of drafting produced most of the answer's drafts: same vocabulary, through text, head or
        model-free; "none" when nothing was drafted."""
        used = stats.main_method
        return "none" if used == "none" else source_kind(used, self.draft_kind)

    @staticmethod
    def sources(stats) -> dict[str, tuple[int, int]]:
        """The answer's (drafted, accepted) tokens per drafting source (Stats.by_source)."""
        return {m: (d or 0, a or 0) for m, (_, d, a) in stats.by_source().items()}

    def _sources(self, stats) -> str:
        sources = self.sources(stats)
        if not sources:
            return "drafted by source  —\n"
        out = "drafted by source (accepted/drafted)\n"
        for src, (d, a) in sorted(sources.items(), key=lambda kv: -kv[1][0]):
            rate = f"{a / d:4.0%}" if d else "   —"
            out += f" {src:<7}{source_kind(src, self.draft_kind):<16}{f'{a}/{d}':>9} {rate}\n"
        return out

    def _expert(self, stats) -> Text:
        used = ", ".join(f"{m} {n}" for m, n in stats.method_used.most_common()) or "-"
        ks = ", ".join(f"{a}:{b}" for a, b in sorted(stats.k_used.items())) or "-"
        mal = f"{stats.mean_accepted_length:.2f}" if stats.drafting_steps else "—"
        out = Text(no_wrap=False)
        out.append(self._sources(stats))
        out.append("acceptance by draft position\n")
        for i, a in enumerate(stats.acceptance_by_position[:8]):
            out.append(f" {i + 1:>2} {_bar(a)} {a:.0%}\n")
        out.append(f"draft time       {self._t(stats.draft_s, '.2f')}{NBSP}s\n")
        out.append(f"verify time      {self._t(stats.verify_s, '.2f')}{NBSP}s\n")
        out.append(f"mean accepted    {mal}\n")
        out.append(f"k in use         {ks}\n")
        out.append(f"k cap            {stats.k_cap or '-'}\n")
        out.append(f"steps            {used}")
        if getattr(stats, "exactness", ""):
            out.append(f"\nexactness        {stats.exactness}")
            if stats.exactness_reason:
                out.append(f"\n{stats.exactness_reason}", style="dim")
        rollback = rollback_text(stats)
        if rollback:  # a recurrent or hybrid model: how rejected drafts were undone
            out.append(f"\n{rollback}")
        if stats.reason:
            out.append(f"\nreason: {stats.reason}", style="dim")
        return out

    def set_memory(self, memory: dict[str, int]) -> None:
        self.memory = memory
        lines = ["memory"]
        for name, b in memory.items():
            lines += [name, f"{NBSP * 2}{mib(b)}"]
        self.query_one("#memory", Static).update(Content("\n".join(lines)))  # not markup: names may hold brackets
