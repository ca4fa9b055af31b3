"""Tandem's Python front end.

``tandem.torch`` makes a PyTorch training script a Tandem worker: see
docs/pytorch.md. This package holds the pieces that do not need torch: the
extension module over the C++ worker runtime and the error type.
"""

from . import _tandem

__version__ = _tandem.__version__


class TandemError(RuntimeError):
    """A failure reported by Tandem's runtime.

    ``code`` is the status code's name (``"INVALID_ARGUMENT"``,
    ``"UNAVAILABLE"``, ...), ``message`` says what went wrong, and ``fatal``
    is False for failures that a membership change explains (the step is
    retried after a resynchronisation) and True for those that end training.
    """

    def __init__(self, code, message, fatal=True):
        super().__init__(f"{message} [{code}]")
        self.code = code
        self.message = message
        self.fatal = fatal


_tandem._set_error_type(TandemError)


def builtin_corpus():
    """The built-in training text of Tandem's reference trainer (48 KiB of generated prose), as bytes."""
    return _tandem.builtin_corpus()


__all__ = ["TandemError", "builtin_corpus", "__version__"]
