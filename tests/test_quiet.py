"""ptrain.quiet: model-written code's compile warnings stay out of the run's log (a warning
filter that makes them errors shows that none escapes), and it still parses as Python does."""

import warnings

import pytest

from ptrain import quiet, rewards

# Invalid escapes (Python 3.12: SyntaxWarning; 3.11: DeprecationWarning), "is" with a literal.
CODE = 'def f(x):\n    if x is 1:\n        return "\\d"\n    return x\n'


def test_model_code_parses_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning would be an exception here
        assert rewards._defines(CODE, "f")
        assert quiet.parse(CODE).body[0].name == "f"
    with pytest.raises(SyntaxError):
        quiet.parse("def f(:\n")
