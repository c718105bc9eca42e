"""Download progress on stderr (rich), installed into models.download by the CLI's entry point."""

from __future__ import annotations


def rich_progress():
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )


def install() -> None:
    from localspec.models import download

    download.progress_factory = rich_progress
