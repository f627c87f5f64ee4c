"""The ragkv HTTP service: ``ragkv.apps.server`` (FastAPI app factory, ``python -m ragkv.apps.server``), ``ragkv.apps.config``
(settings), ``ragkv.apps.schemas`` (request/response models), ``ragkv.apps.service`` (workers, admission, metrics)."""
