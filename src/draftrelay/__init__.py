"""draftrelay: remote speculative drafting for LLM serving."""

__version__ = "0.1.0"


class SettingError(ValueError):
    """A DRAFTRELAY_* environment setting with a value it does not take. Raised where the setting is read
    (some at import); the message names the variable, the value and what it takes, and `draftrelay`'s
    command line prints it as one line and exits 2 instead of a traceback."""
