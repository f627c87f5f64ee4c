"""The ragkv HTTP service: ``apps.server`` (FastAPI app factory, ``python -m apps.server``), ``apps.config``
(settings), ``apps.schemas`` (request/response models), ``apps.service`` (workers, admission, metrics)."""
