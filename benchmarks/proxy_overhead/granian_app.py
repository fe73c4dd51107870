"""kvgate's ASGI app for granian (`granian --interface asgi granian_app:app`), configured
from `KVGATE_*` like `kvgate serve`. Used only by `bench.py` to compare servers."""

from __future__ import annotations

import logging
import os

from kvgate.config import load_config
from kvgate.gateway.app import Gateway

_access = logging.getLogger("kvgate.access")
_access.propagate = False
_access.setLevel(logging.INFO)
_access.addHandler(logging.FileHandler(os.environ.get("KVGATE_BENCH_ACCESS_LOG", os.devnull)))

app = Gateway(load_config(None))
