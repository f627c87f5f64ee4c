"""Deprecated: the service is the ``ragkv-server`` distribution (module ``ragkv_server``); ``ragkv.apps.*``
imports it, with a warning, for one release."""

import warnings

from ragkv._moved import install

install()
warnings.warn(
    "ragkv.apps is deprecated (issue 40): see ragkv._moved.MOVED for the new homes",
    DeprecationWarning,
    stacklevel=2,
)
