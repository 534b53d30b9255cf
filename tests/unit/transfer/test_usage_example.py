"""The usage example in transfer/__init__.py runs as written."""
import numpy as np

import transfer


def test_package_docstring_example_runs():
    doc = transfer.__doc__
    code = doc[doc.index("    import numpy"):doc.index("Public API")]
    scope: dict = {}
    exec("\n".join(line[4:] for line in code.splitlines()), scope)
    try:
        block = scope["BLOCK"]
        assert np.array_equal(scope["staging"].host[:block],
                              scope["arena"].array[5 * block:6 * block])
    finally:
        scope["worker"].close()
        scope["store"].close()
        scope["arena"].close()
