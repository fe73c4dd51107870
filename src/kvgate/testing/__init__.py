"""What kvgate's tests and benchmarks share: a fake engine and the helpers around it.

It ships in the package so that benchmark scripts and other projects' tests can start the
same engine the suite uses (`from kvgate.testing import FakeEngine`); nothing in the
gateway imports it.
"""

from kvgate.testing.fake_engine import EngineRequest, FakeEngine
from kvgate.testing.polling import eventually
from kvgate.testing.ports import free_port

__all__ = ["EngineRequest", "FakeEngine", "eventually", "free_port"]
