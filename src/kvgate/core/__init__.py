"""The pure core of kvgate: no I/O, an injected clock, seeded randomness.

Everything here runs unchanged in the live gateway and in the virtual-time simulator.
"""
