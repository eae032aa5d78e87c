"""HTML escaping of untrusted text (model output, feedback, task names) for the report."""

import html

# Control characters (a terminal's colour codes, NULs) are shown as \xNN, not sent.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0, 9), 11, 12, *range(14, 32), 127)}


def esc(value) -> str:
    """`value` as HTML text: markup shown, never run; control characters visible."""
    return html.escape(str(value).translate(_CONTROL), quote=True)
