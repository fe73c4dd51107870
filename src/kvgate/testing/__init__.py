"""What kvgate's tests and benchmarks share: a fake engine, a simulated one in a known state,
the helpers around them, and the sums over the core's books only tests ask for (`books`).

- `fake_engine`, `polling`, `sim`: the fake engine, waiting for a condition, and a
  simulated engine after a known overload (exported here, with `free_port`).
- `chaos`: fronts that make simulated engines crash, restart, stall and reset, and garble
  or hang their metrics, and the monkey that injects those faults at random.
- `soak`, `soak_clients`, `soak_report`: the chaos soak (a real `kvgate serve` behind
  chaos fronts, misbehaving clients, the books read at the end).

It ships in the package so that benchmark scripts and other projects' tests can start the
same engine the suite uses (`from kvgate.testing import FakeEngine`); nothing in the
gateway imports it."""

from kvgate.procs.ports import free_port
from kvgate.testing.fake_engine import EngineRequest, FakeEngine
from kvgate.testing.polling import eventually
from kvgate.testing.sim import overloaded_engine

__all__ = ["EngineRequest", "FakeEngine", "eventually", "free_port", "overloaded_engine"]
