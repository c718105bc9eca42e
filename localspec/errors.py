"""Domain errors. The CLI turns these into one `error:` line and an exit code; nothing else catches them."""


class LocalspecError(Exception):
    """Base class: a problem the user can act on. Message is one line."""

    exit_code = 1


class UsageError(LocalspecError):
    exit_code = 2


class ModelLoadError(LocalspecError):
    pass


class IncompatibleDraftError(LocalspecError):
    pass


class ContextOverflowError(LocalspecError):
    pass


class DecodeError(LocalspecError):
    pass


class DownloadError(LocalspecError):
    pass


class AlgorithmBugError(LocalspecError):
    """`localspec bench` found outputs that differ from plain decoding by more than float order can explain."""

    exit_code = 3
