"""Silencing what a user cannot act on, where it is understood.

  parse(source, **kw)   ast.parse of model-written code: the SyntaxWarnings (Python 3.12:
                        invalid escapes such as "\\d") and DeprecationWarnings its compile
                        raises are about the model's code, not the run; a program that does
                        not parse still raises SyntaxError
  quiet_orbax()         orbax logs every step of every save and restore at INFO; keep its
                        warnings and errors (absl's handler, as launch/*.py use)
"""

from __future__ import annotations

import ast
import logging
import os
import warnings


def parse(source: str, *args, **kwargs) -> ast.AST:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.parse(source, *args, **kwargs)


def quiet_orbax() -> None:
    from absl import logging as absl_logging
    absl_logging.get_absl_handler().addFilter(
        lambda r: r.levelno >= logging.WARNING or f"{os.sep}orbax{os.sep}" not in r.pathname)
