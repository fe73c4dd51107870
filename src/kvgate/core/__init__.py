"""The pure core of kvgate: no I/O, an injected clock, seeded randomness.

Everything here runs unchanged in the live gateway and in the virtual-time simulator. At a
glance, from a request's arrival to its end:

- `request`, `cost`: what a request asks for, and what it costs in KV tokens;
- `flow/`: the flow controller the shell holds: start a request now, let it wait for room,
  or refuse it (its queue and fairness; each tenant's limits are `tenants`);
- `admission`: the contract between the flow controller and a placement policy
  (`AdmissionPolicy`) and their answers (`Admit`, `Reject`, `Ticket`);
- `policies/`: the placement, `adaptive` (the benchmark's baselines: `policies/baselines/`),
  composed in `policies/base.py` of
- `plan/`: the per-node plan: each request's hold and its reflection in samples (`holds`),
  each node's pace (`pace`), its envelope and the predictions made from it (`envelope`,
  `forecast`), expected output lengths (`lengths`), the feedback margin (`margin`);
- `replicas/`: replicas that admit as one: the view each publishes (`view`), how it is
  built and taken (`exchange`) and folded in (`peers`), the claims on each node's slack
  (`claims`);
- `nodes`, `signals`: what each engine says about itself, and its state;
- `settings`, `clock`, `rates`, `retry_after`: settings, time, measured rates, Retry-After.
"""
