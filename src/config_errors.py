"""The one exception the config package raises for bad user input."""
from __future__ import annotations

import difflib
from typing import Iterable


class ConfigError(ValueError):
    """A spec or config.h5 that cannot be used.

    ``path`` names the offending key (``model.layers[3].kernel``) or file, ``message`` says what is wrong and
    ``hint`` what to do about it. ``str(err)`` is the one line the command-line tools print.
    """

    def __init__(self, path: str, message: str, hint: str = ""):
        self.path = path
        self.message = message
        self.hint = hint
        super().__init__(self.line())

    def line(self) -> str:
        where = f"{clip(self.path)}: " if self.path else ""
        tail = f" (hint: {clip(self.hint)})" if self.hint else ""
        return f"{where}{clip(self.message)}{tail}"


MAX_WORD = 200  # characters of one key, value or path a message repeats before it is shortened


def clip(text: str, limit: int = MAX_WORD) -> str:
    """``text`` with every run of more than ``limit`` non-blank characters (a 60,000-character key, a pasted
    blob) shortened to its start and end around ``...[N characters]...``: a message repeats what it names,
    and a whole screen of it would hide the message."""
    text = str(text)
    if len(text) <= limit:
        return text
    out = []
    for word in text.split(" "):
        if len(word) > limit:
            keep = limit // 2
            word = f"{word[:keep]}...[{len(word)} characters]...{word[-keep // 4:]}"
        out.append(word)
    return " ".join(out)


def did_you_mean(word: str, choices: Iterable[str], what: str = "") -> str:
    """Hint text: the closest of ``choices`` to ``word``, or the list of choices when none is close."""
    choices = [str(c) for c in choices]
    cutoff = 0.5 if len(str(word)) <= 3 else 0.6  # 'p2' -> 'p1' is a likely slip; longer words need more
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=cutoff)
    if close:
        return f"did you mean '{close[0]}'?"
    if not choices:
        return f"no {what or 'value'} is allowed here"
    shown = ", ".join(choices[:20]) + (", ..." if len(choices) > 20 else "")
    return f"choose one of {what + ': ' if what else ''}{shown}"


def join_path(path: str, key) -> str:
    """``join_path('model.layers', 3) == 'model.layers[3]'``;
    ``join_path('model', 'name') == 'model.name'``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)
