"""draftrelay: remote speculative drafting for LLM serving."""

import math
import os

__version__ = "0.1.0"


class SettingError(ValueError):
    """A DRAFTRELAY_* environment setting with a value it does not take. Raised where the setting is read
    (some at import); the message names the variable, the value and what it takes, and `draftrelay`'s
    command line prints it as one line and exits 2 instead of a traceback."""


def env_choice(name: str, default: str, modes: tuple[str, ...]) -> str:
    """The value of the environment setting `name` (`default` where unset), which must be one of `modes`
    (SettingError naming the variable, the value and the modes otherwise)."""
    value = os.environ.get(name, default)
    if value not in modes:
        raise SettingError(f"{name}={value!r}: expected one of {', '.join(modes)}")
    return value


def env_ms(name: str, default: float = 0.0) -> float:
    """The environment setting `name` in milliseconds (`default` where unset or empty): a finite number >= 0
    (SettingError naming the variable and the value otherwise)."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise SettingError(f"{name}={raw!r}: expected a number of milliseconds >= 0")
    return value
