"""What kvgate's tests and benchmarks share: a fake engine, a simulated one in a known state,
the helpers around them, and the sums over the core's books only tests ask for (`books`).

It ships in the package so that benchmark scripts and other projects' tests can start the
same engine the suite uses (`from kvgate.testing import FakeEngine`); nothing in the
gateway imports it.
"""

from kvgate.testing.fake_engine import EngineRequest, FakeEngine
from kvgate.testing.polling import eventually
from kvgate.testing.ports import free_port
from kvgate.testing.sim import overloaded_engine

__all__ = ["EngineRequest", "FakeEngine", "eventually", "free_port", "overloaded_engine"]
