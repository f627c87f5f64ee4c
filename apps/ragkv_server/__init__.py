"""The ragkv HTTP service: ``ragkv_server.server`` (FastAPI app factory, ``python -m ragkv_server.server``), ``ragkv_server.config``
(settings), ``ragkv_server.schemas`` (request/response models), ``ragkv_server.service`` (workers, admission, metrics)."""
