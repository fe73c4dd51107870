"""The per-node plan: what each engine holds and will hold, from the requests placed on it.

`holds` (each admitted request's hold, and its reflection in the engine's samples) feed the
`forecast` (each node's `envelope`, cached, and the drain schedule and start estimates made
from it at the node's `pace`). `lengths` says how long outputs are expected to run;
`margin` lowers a node's ceilings when its samples show more than was planned.
"""
