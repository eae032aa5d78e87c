"""Deprecated: `sandbox.warm_workers` is now `sandbox.warm_sandboxes` (removed in the next
release). Importing this module warns and gives that same module object, so that setting
`MAX_SANDBOXES_PER_KEY` through either name changes the one bound."""

import sys
import warnings

from sandbox import warm_sandboxes

warnings.warn("sandbox.warm_workers is deprecated: use sandbox.warm_sandboxes",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = warm_sandboxes
